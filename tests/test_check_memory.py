"""The checks' memory bound (devices.CHECK_MEMORY_BYTES): the oracle and the check data made in slices give the
same numbers as whole, and a check that cannot get its memory (an injected allocation failure) is freed,
retried once, then a named skip -- at load a named refusal, while serving a skip the canary retries -- never
an out-of-memory error raised in the serving process."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import moe_faults
from helpers.cases import case

import sm120_fp4
from sm120_fp4 import backends, canary, nvfp4, serving, verify
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.demo import synthetic
from sm120_fp4.devices import Device
from sm120_fp4.errors import RefusedToServe

SIM = Device(-1, "simulated (no GPU)", (12, 0), simulated=True, source="simulate")
NO_MEMORY = "CUDA out of memory. Tried to allocate 3.50 GiB (injected)"


def test_the_dense_oracle_in_blocks_of_rows_is_the_whole_oracle(monkeypatch):
    from sm120_fp4.nvfp4 import reference

    for m, n, k in ((300, 520, 160), (129, 1056, 480)):
        _, _, args = verify.quantized_inputs((m, n, k), torch.device("cpu"), m)
        whole = nvfp4.reference_mm_fp4(*args, out_dtype=torch.float32)
        monkeypatch.setattr(reference, "_DEQUANT_ELEMENTS", 128 * k)  # blocks of 128 rows of each operand
        assert torch.equal(nvfp4.reference_mm_fp4(*args, out_dtype=torch.float32), whole)
        monkeypatch.undo()


@case(
    "properties",
    "the MoE self-test with a check memory bound so small that its oracle runs a few tokens at a time",
    "a healthy kernel passes and a kernel that drops one expert is refused, as with the whole oracle",
)
def test_the_moe_oracle_in_slices_of_tokens_judges_as_the_whole(monkeypatch):
    monkeypatch.setattr(verify.moe, "CHECK_MEMORY_BYTES", 1 << 20)
    config = verify.MoeConfig(cases=verify.SIMULATION_MOE_CONFIG.cases[:2])
    assert verify.run_moe("emulated", SIM, config).passed
    backends.register_moe("drops-expert", moe_faults.drops_one_expert)
    report = verify.run_moe("drops-expert", SIM, config)
    assert not report.passed and "T=64" in report.reason


def test_seeded_activations_in_slices_are_seeded_structured_and_bounded(monkeypatch):
    monkeypatch.setattr(verify.data, "CHECK_MEMORY_BYTES", 64 * 160 * 32 * 4)  # 64 rows of 160 at a time
    x = verify.seeded_activations(300, 160, 2.0, 5, torch.device("cpu"), torch.bfloat16)
    again = verify.seeded_activations(300, 160, 2.0, 5, torch.device("cpu"), torch.bfloat16)
    assert x.dtype == torch.bfloat16 and x.shape == (300, 160) and torch.equal(x, again)
    assert float(x.float().abs().max()) <= 2.0 and bool((x != 0).any(dim=1).all())


class NoMemory:
    """A dense kernel whose next `failures` calls fail to allocate (torch.OutOfMemoryError), then healthy."""

    def __init__(self) -> None:
        self.failures = 0

    def __call__(self, a, b, a_sf, b_sf, alpha, dtype, out):
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError(NO_MEMORY)
        return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.sglang
@case(
    "own failures",
    "the canary's re-check while serving cannot get its memory: the served call's allocation fails twice",
    "the run is skipped (no failure, no exit), logged once, counted in skipped_memory and retried at the next "
    "idle point, where it passes",
)
@pytest.mark.slow
def test_a_canary_run_that_cannot_get_its_memory_is_skipped_and_retried(sglang_unpatched, caplog):
    from sm120_fp4.sglang import layers

    caplog.set_level(logging.WARNING, "sm120_fp4")
    kernel = NoMemory()
    backends.register("no-memory", kernel)
    sm120_fp4.install(simulate="12.0", backends="no-memory", canary="30", canary_slice_ms="1000")
    layers.build_modelopt_layer(synthetic.make_checkpoint(96, 160, seed=1))
    c = serving.STATE.canary
    c.clock = Clock()
    canary.idle()  # armed
    kernel.failures = 2  # the check's first attempt and its retry
    c.clock.now += c.period
    canary.idle()
    status = c.status()
    assert c.runs == 0 and c.failures == 0 and status.skipped_memory == 1
    lines = [r.getMessage() for r in caplog.records if "skipped its re-check" in r.getMessage()]
    assert len(lines) == 1 and "out of GPU memory" in lines[0] and "injected" in lines[0]
    canary.idle()  # the retry
    assert c.runs == 1 and c.failures == 0 and c.status().last_run.passed


@pytest.mark.sglang
@case(
    "own failures",
    "a layer check at load whose data cannot be allocated ({times})",
    "{outcome}",
)
@pytest.mark.parametrize(
    "times, outcome",
    [
        ("once", "freed and retried: the layer is verified"),
        ("every time", "refused by name (the check was skipped: out of GPU memory, and the bound to leave free)"),
    ],
)
def test_a_layer_check_that_cannot_get_its_memory_is_retried_then_named(sglang_unpatched, monkeypatch, times, outcome):
    from sm120_fp4.sglang import layers

    failures = {"left": 1 if times == "once" else 10**6}
    real = verify.seeded_activations

    def allocation_fails(*args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError(NO_MEMORY)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "seeded_activations", allocation_fails)
    sm120_fp4.install(simulate="12.0", backends="emulated")
    checkpoint = synthetic.make_checkpoint(96, 160, seed=1)
    if times == "once":
        layers.build_modelopt_layer(checkpoint)
        [decision] = sm120_fp4.status().decisions
        assert decision.verified and decision.layers[0].passed
        return
    with pytest.raises(RefusedToServe) as refused:
        layers.build_modelopt_layer(checkpoint)
    assert "the check was skipped: out of GPU memory" in str(refused.value) and "MiB beyond" in str(refused.value)
