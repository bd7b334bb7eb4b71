"""SGLang's FlashInfer autotune gate with the library installed (simulated SM120, CPU, real SGLang modules).

The gate is SGLang's own ``should_run_flashinfer_autotune``, read through the names SGLang calls it by
(the module's function and base_runner's by-name import), against SGLang's real runtime context and
``ModelConfig`` for a throw-away checkpoint directory (``moe_layers.sglang_moe_context``). The model
runner is a stand-in holding only what the gate reads of it (device, model_config, model, speculative
roles); CUDA's compute capability is the one value a CPU cannot give (monkeypatched).
"""

from __future__ import annotations

import contextlib
import logging
import types

import pytest
import torch
from helpers import sglang_layers
from helpers.cases import case
from helpers.common import patch_state, simulated_moe_skip_reason, slow_but_one

import sm120_fp4
from sm120_fp4 import backends
from sm120_fp4.demo import synthetic
from sm120_fp4.sglang import autotune as gates
from sm120_fp4.sglang import release
from sm120_fp4.versions import version_in

if simulated_moe_skip_reason() is not None:
    pytest.skip(simulated_moe_skip_reason(), allow_module_level=True)
if not release.sglang_version() or not version_in(release.sglang_version(), ">=0.5.18"):
    pytest.skip(
        "SGLang's module-level autotune gate reading its runtime context exists from 0.5.18", allow_module_level=True
    )
moe_layers = pytest.importorskip("sm120_fp4.sglang.moe_layers")
fa = pytest.importorskip("sglang.srt.model_executor.runner.flashinfer_autotune")
base_runner = pytest.importorskip("sglang.srt.model_executor.runner.base_runner")
from flashinfer.autotuner import AutoTuner, autotune  # noqa: E402  (installed with SGLang's pin)
from sglang.srt import runtime_context as rc  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

CT, MODELOPT = moe_layers.COMPRESSED_TENSORS, moe_layers.MODELOPT
E, H, I, TOP_K = 8, 256, 128, 2
GATE_NAMES = ("flashinfer-autotune-gate", "flashinfer-autotune-gate-base-runner")


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test here starts and ends with SGLang unpatched."""


@pytest.fixture
def sm120(monkeypatch):
    """CUDA's answer for the compute capability SGLang's gate asks (the one fact a CPU cannot give)."""
    capability = {"value": (12, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: capability["value"])
    return capability


@pytest.fixture
def tuned_calls():
    """The dense and MoE 'cutlass' backends replaced by stand-ins (the emulated numbers) that record, per
    call, whether FlashInfer's autotuner was tuning then (what FlashInfer's own kernels consult)."""
    calls = {"dense": [], "moe": []}

    def dense(*args):
        calls["dense"].append(AutoTuner.get().is_tuning_mode)
        return backends.emulated_mm_fp4(*args)

    def moe(*args):
        calls["moe"].append(AutoTuner.get().is_tuning_mode)
        return backends.emulated_moe(*args)

    backends.register("cutlass", dense, replace=True)
    backends.register_moe("cutlass", moe, replace=True)
    yield calls
    backends.unregister("cutlass")
    backends.unregister_moe("cutlass")


def _runner(context, *, device: str = "cuda", speculative: str | None = None, draft: bool = False):
    """What SGLang's gate reads of a ModelRunner: SGLang's ModelConfig for the context's checkpoint."""
    return types.SimpleNamespace(
        device=device,
        model_config=ModelConfig.from_server_args(context.server_args),
        model=torch.nn.Module(),
        spec_algorithm=SpeculativeAlgorithm.from_string(speculative),
        is_draft_worker=draft,
    )


def _gates(mr, **kwargs) -> tuple[bool, bool]:
    """SGLang's answer through both of the names it calls the gate by."""
    return (fa.should_run_flashinfer_autotune(mr, **kwargs), base_runner.should_run_flashinfer_autotune(mr, **kwargs))


def _serve_layers(quantization: str):
    """A dense and a MoE NVFP4 layer of `quantization` built through SGLang's real methods (the weights hooks
    decide and verify them); returns a forward that runs both as SGLang serves them."""
    shards = sglang_layers.fused_dense_shards([32], 64)
    method, dense = sglang_layers.build_fused_dense_layer(shards, quantization)
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=3)
    if quantization == CT:
        moe = sglang_layers.build_compressed_tensors_moe_layer(ckpt, TOP_K)
    else:
        moe = moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)
    apply = method.apply_weights if quantization == CT else method.apply

    def forward():
        gen = torch.Generator().manual_seed(0)
        apply(dense, torch.randn(4, 64, generator=gen).to(torch.bfloat16))
        ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(4)])
        moe_layers.moe_forward(
            moe, torch.randn(4, H, generator=gen).to(torch.bfloat16), ids, torch.full((4, TOP_K), 0.5)
        )

    return forward


# The runner string each checkpoint has with SGLang's default flags (compressed-tensors: 'auto', pinned by the
# library through SGLang's flags; ModelOpt: --quantization modelopt_fp4, SGLang's own SM120 rule).
DEFAULT_FLAGS = [pytest.param(CT, "auto", id="compressed-tensors"), pytest.param(MODELOPT, "auto", id="modelopt")]


@pytest.mark.parametrize("quantization, runner", DEFAULT_FLAGS)
@pytest.mark.slow
def test_sglangs_gate_tunes_a_default_flags_nvfp4_checkpoint_served_here(
    sm120, tuned_calls, caplog, quantization, runner
):
    with moe_layers.sglang_moe_context(runner, quantization=quantization) as context:
        sglangs_own = _gates(_runner(context))
        configured = rc.get_exec().moe.moe_runner_backend
    caplog.set_level(logging.INFO, "sm120_fp4")
    sm120_fp4.install(simulate="12.0", backends="cutlass", moe_backends="cutlass")
    assert [patch_state(name) for name in GATE_NAMES] == ["applied", "applied"]
    with moe_layers.sglang_moe_context(runner, quantization=quantization) as context:
        forward = _serve_layers(quantization)
        mr = _runner(context)
        assert _gates(mr) == (True, True), f"SGLang alone says {sglangs_own}"
        assert _gates(mr) == (True, True), "asked twice (the draft and extend passes ask again)"
        assert rc.get_exec().moe.moe_runner_backend == configured, "SGLang's configured runner string is left as it was"
        # SGLang's warm-up runs its dummy forward through run_flashinfer_autotune_forward inside its autotune
        # context; on a CPU the context is FlashInfer's tuning switch alone (no streams, no cache file).
        del tuned_calls["dense"][:], tuned_calls["moe"][:]
        fa_context = fa.flashinfer_autotune_context
        fa.flashinfer_autotune_context = lambda model_runner, *, run_lm_head: autotune(True)
        try:
            fa.run_flashinfer_autotune_forward(mr, forward, run_lm_head=False)
        finally:
            fa.flashinfer_autotune_context = fa_context
        inside = {family: list(calls) for family, calls in tuned_calls.items()}
        forward()
    assert inside == {"dense": [True], "moe": [True]}, "the routed dense and MoE calls ran inside FlashInfer's tuning"
    assert tuned_calls == {"dense": [True, False], "moe": [True, False]}, "and untuned outside it"
    said = [r.getMessage() for r in caplog.records if "FlashInfer autotune runs" in r.getMessage()]
    assert len(said) == (0 if all(sglangs_own) else 1), "said once, and only where SGLang alone said no"
    if quantization == CT:
        assert sglangs_own == (False, False), "compressed-tensors is never tuned by SGLang's gate alone"
        assert "dense:cutlass, moe:cutlass" in said[0]


def _kv_sharding():
    return rc.get_parallel().override(enable_kv_cache_sharding=True)


# Each of SGLang's own refusals, as SGLang reads it (server arguments, parallel state, the runner, CUDA).
REFUSALS = {
    "not CUDA": dict(runner={"device": "cpu"}),
    "--disable-flashinfer-autotune": dict(server_args={"disable_flashinfer_autotune": True}),
    "deterministic inference": dict(
        server_args={"enable_deterministic_inference": True, "attention_backend": "triton"}
    ),
    "KV-cache sharding": dict(scope=_kv_sharding),
    "compute capability 8.9": dict(capability=(8, 9)),
    "the draft's tuning asked of a speculative target worker": dict(
        runner={"speculative": "EAGLE"}, gate={"for_speculative_draft": True}
    ),
    "the target's tuning asked of a speculative draft worker": dict(runner={"speculative": "EAGLE", "draft": True}),
}


@pytest.mark.parametrize("refusal", slow_but_one(REFUSALS))
@case(
    "configuration",
    "SGLang's FlashInfer autotune gate with the library serving a compressed-tensors NVFP4 checkpoint "
    "on a 12.x device and one of SGLang's own refusals ({refusal})",
    "the gate says no, as SGLang does: the library adds tuning only where the runner string or the quantization "
    "name was SGLang's one reason",
)
def test_every_one_of_sglangs_own_refusals_stands(sm120, refusal):
    # The gate itself (gates.make_gate) over SGLang's real one, with the served families stubbed: that the
    # installed gate reads the families from the routes is the end-to-end test above.
    spec = REFUSALS[refusal]
    gate = gates.make_gate(fa.should_run_flashinfer_autotune, lambda: ["dense:cutlass", "moe:cutlass"])
    with moe_layers.sglang_moe_context("auto", quantization=CT) as context:
        assert gate(_runner(context)) is True, "without the refusal, tuned"
        assert fa.should_run_flashinfer_autotune(_runner(context)) is False, "where SGLang alone says no"
    sm120["value"] = spec.get("capability", (12, 0))
    with (
        moe_layers.sglang_moe_context("auto", quantization=CT, server_args=spec.get("server_args")) as context,
        spec["scope"]() if "scope" in spec else contextlib.nullcontext(),
    ):
        mr, kwargs = _runner(context, **spec.get("runner", {})), spec.get("gate", {})
        assert gate(mr, **kwargs) is False and fa.should_run_flashinfer_autotune(mr, **kwargs) is False


@case(
    "configuration",
    "SGLang's FlashInfer autotune gate with default flags for a compressed-tensors checkpoint on a 12.x device and "
    "no NVFP4 layer served in this process",
    "SGLang's answer (no), unchanged",
)
def test_no_tuning_where_the_library_serves_no_layer(sm120):
    sm120_fp4.install(simulate="12.0", backends="cutlass", moe_backends="cutlass")
    assert [patch_state(name) for name in GATE_NAMES] == ["applied", "applied"]
    with moe_layers.sglang_moe_context("auto", quantization=CT) as context:
        assert _gates(_runner(context)) == (False, False)


@case(
    "configuration",
    "SGLang's FlashInfer autotune gate where the NVFP4 layers are served with backends FlashInfer does not tune",
    "SGLang's answer (no), unchanged: only the routed cutlass and b12x kernels consult FlashInfer's autotuner",
)
def test_no_tuning_where_the_served_backends_are_not_tunable(sm120):
    routes = {"dense": {0: "emulated", 1: "b12x"}, "moe": {0: "humming", 1: "cutlass"}}
    assert gates.tunable_backends(routes, 0) == [] and gates.tunable_backends(routes, 1) == [
        "dense:b12x",
        "moe:cutlass",
    ]
    gate = gates.make_gate(fa.should_run_flashinfer_autotune, lambda: gates.tunable_backends(routes, 0))
    with moe_layers.sglang_moe_context("auto", quantization=CT) as context:
        assert gate(_runner(context)) is False


def test_uninstall_restores_both_of_sglangs_names_for_the_gate():
    gate = fa.should_run_flashinfer_autotune
    assert base_runner.should_run_flashinfer_autotune is gate
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    assert [patch_state(name) for name in GATE_NAMES] == ["applied", "applied"]
    assert fa.should_run_flashinfer_autotune is not gate and base_runner.should_run_flashinfer_autotune is not gate
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")  # idempotent
    assert fa.should_run_flashinfer_autotune.__wrapped__ is gate
    sm120_fp4.uninstall()
    assert fa.should_run_flashinfer_autotune is gate and base_runner.should_run_flashinfer_autotune is gate
