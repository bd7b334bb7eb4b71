"""The checks' memory bound (devices.CHECK_MEMORY_BYTES): the oracle and the check data made in slices give the
same numbers as whole, and a check that cannot get its memory (an injected allocation failure) is freed,
retried once, then a named skip -- at load a named refusal, while serving a skip the canary retries -- never
an out-of-memory error raised in the serving process."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from helpers import moe_faults
from helpers.cases import case
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import sm120_fp4
from sm120_fp4 import backends, canary, devices, nvfp4, serving, verify
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.config import Settings
from sm120_fp4.demo import synthetic
from sm120_fp4.devices import Device
from sm120_fp4.errors import RefusedToServe
from sm120_fp4.serving import policy

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
    c = canary.active()
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


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those made under it, outside `paused` stretches
    (the served call's own): counted at every operation, from the storages made and not yet freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: kept for ptr, kept in self.live.items() if not kept[0].expired()}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out) if not self.paused else ():
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            made = storage is not None and storage.nbytes() and storage.data_ptr() not in inputs  # not a view
            if made and storage.data_ptr() not in self.live:
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _wide_layer(n: int, k: int, counter: LiveBytes, wrong_row: int | None = None):
    """A dense layer served by `emulated` (its own memory not counted), one output row 10% off where asked."""
    gen = torch.Generator().manual_seed(n)
    weight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    weight_sf = torch.randint(0x20, 0x48, nvfp4.swizzled_scale_shape(n, k), dtype=torch.uint8, generator=gen)
    input_gsf = torch.tensor(448.0 * 6 / 8.0)
    alpha = (1.0 / (input_gsf * 448.0 * 6 / 0.05)).reshape(1).float()
    watched = (weight, weight_sf.view(torch.float8_e4m3fn), alpha, input_gsf)

    def serve(x):
        counter.paused = True  # the served call's input, output and working memory are the engine's own
        try:
            qx, sx = nvfp4.quantize(x, input_gsf, check_finite=False)
            out = torch.empty((x.shape[0], n), dtype=x.dtype)
            emulated_mm_fp4(qx, weight.T, sx.view(torch.uint8), watched[1].T, alpha, x.dtype, out)
            if wrong_row is not None and x.shape[0] > wrong_row:
                out[wrong_row] *= 1.1  # within the whole call's relative error, not within its row's
            return out
        finally:
            counter.paused = False

    layer = types.SimpleNamespace(params_dtype=torch.bfloat16)
    return policy.dense_check(policy.Sizes(64, 1024, 1024), "wide", serve, layer, watched, n, k)


def test_a_large_m_dense_check_holds_the_reference_a_block_of_rows_at_a_time(monkeypatch):
    # M up to 1024, N=8192: the whole float32 reference (1025 x 8192) is 33.6 MB. Under an 8 MiB bound the check
    # holds everything it makes outside the served call within the bound, and judges as the whole reference does.
    settings = Settings(simulate="12.0", backends="emulated")
    device = devices.list_devices(settings.simulated_capability)[0]
    whole = 1025 * 8192 * 4
    serving.route(device.index, settings)  # decided first: the generic self-test is not this check
    counter = LiveBytes()
    with counter:
        report = serving.verify_layer(device.index, _wide_layer(8192, 32, counter), settings)
    assert report is not None and report.passed, report and report.reason
    assert counter.peak >= whole  # the tracker sees the whole reference where it fits the real bound
    serving.clear()
    bound = 8 << 20
    for module in (verify.engine, verify.data):
        monkeypatch.setattr(module, "CHECK_MEMORY_BYTES", bound)
    monkeypatch.setattr(verify.engine, "_COMPARE_ELEMENTS", 16 * 8192)  # chunks of 16 rows, blocks of 64
    serving.route(device.index, settings)
    counter = LiveBytes()
    with counter:
        report = serving.verify_layer(device.index, _wide_layer(8192, 32, counter), settings)
    assert report is not None and report.passed, report and report.reason
    assert counter.peak <= bound, f"the check held {counter.peak} bytes at once, above its {bound}-byte bound"
    serving.clear()
    with pytest.raises(RefusedToServe, match="M=767 .*: row 700 relative error"):  # in a later block of rows
        serving.verify_layer(device.index, _wide_layer(8192, 32, LiveBytes(), wrong_row=700), settings)
