"""Which vLLM attribute to patch in which release, and why, as one declared table (read in vLLM 0.32, 0.33 and 0.34)."""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import replace
from typing import Callable

from ..engines import make_call_hook
from ..patching import PatchSpec
from ..serving.policy import make_weights_hook
from . import simulation
from .hooks import compressed_tensors_check, graph_sizes, modelopt_check
from .moe import make_alias, make_defer, make_shapes
from .release import CT, CT_MOE, GPU_WORKER, LINEAR_FLASHINFER, MODELOPT, PLUGIN_GROUP, RELEASE, TARGET_VERSIONS
from .release import FI_CUTLASS_MOE as FI_MOE


def _is_callable(original: object) -> str | None:
    return None if callable(original) else f"not a function: {type(original).__name__}"


def _is_property(original: object) -> str | None:
    return None if isinstance(original, property) else f"not a property: {type(original).__name__}"


def _target(name: str, module: str, attribute: str, why: str, check=None) -> tuple[str, PatchSpec]:
    spec = PatchSpec(
        f"vllm-{name}", module, attribute, why, _UPSTREAM, _REMOVE, None, RELEASE.distribution(), check=check
    )
    return name, replace(spec, versions=TARGET_VERSIONS)


MOE_KIND = "ModelOptNvFp4FusedMoE"
CT_MOE_KIND = "CompressedTensorsW4A4Nvfp4MoEMethod"

_ALIAS_WHY = (
    "vLLM's FlashInfer NVFP4 linear kernels call mm_fp4 through vLLM's wrapper flashinfer_scaled_fp4_mm (bound by "
    "name; it transposes b and its scales) unchecked on SM12x: route calls on a served device to the verified backend"
)
_WEIGHTS_WHY = (
    "decide the device's backend at the first NVFP4 layer, refuse a kernel this library cannot route (naming "
    "--linear-backend flashinfer_cutlass; a weight-only W4A16 layer, FP4 Marlin or another kernel called directly, "
    "is refused too: SELFTEST=warn serves it unverified, listed in status().unverified), then verify the layer "
    "through vLLM's apply at every batch-size bucket"
)
_WARMUP_WHY = (
    "after vLLM's kernel warm-up (FlashInfer's autotuner picks its tactics there) and before CUDA-graph capture, "
    "re-run every verified configuration, also at the graph batch sizes: a kernel wrong only after tuning refuses"
)
_MOE_ALIAS_WHY = (
    "FlashInferExperts call cutlass_fused_moe through the alias flashinfer_cutlass_fused_moe (bound by name) unchecked "
    "on SM12x: route its unquantized NVFP4 calls on a served device to the verified fused-MoE backend"
)
_MOE_DEFER_WHY = (
    "on a served device FlashInferExperts take MoE activations unquantized (vLLM's expects_unquantized_inputs; the "
    "kernel quantizes when input_sf is None, as SGLang calls it): the convention the verified backend serves"
)
_MOE_SHAPES_WHY = "with unquantized NVFP4 activations the experts' output is (M, K), not vLLM's doubled packed K"
_MOE_WEIGHTS_WHY = (
    "decide the device's fused-MoE backend before vLLM processes the weights; refuse any backend but "
    "flashinfer_cutlass (naming --moe-backend flashinfer_cutlass), weight-only W4A16 (served by Marlin, unverified "
    "only under SELFTEST=warn, listed in status().unverified), and what the check does not cover (expert "
    "parallelism, SwiGLU clamps, another layout); then verify the layer through its own apply (bf16 in) against the "
    "oracle from its processed weights, at every batch-size bucket"
)
_UPSTREAM = "no upstream check exists (vLLM's warm-ups compile and tune; none compares FP4 outputs with a reference)"
_REMOVE = "when vLLM verifies its NVFP4 GEMM output at start-up on SM12x"
_ONLY_NVFP4 = " (ModelOpt checkpoints: ModelOptLinearMethod serves FP8, MXFP8 and NVFP4; only NVFP4 layers are checked)"
_CT = " (compressed-tensors W4A4 NVFP4 checkpoints)"
_MOE_CT = _MOE_WEIGHTS_WHY + " (compressed-tensors W4A4 NVFP4 checkpoints: the same backend selection and experts)"
_MOE_MO = _MOE_WEIGHTS_WHY + " (ModelOpt NVFP4 checkpoints)"
_PW = ".process_weights_after_loading"
_FI = "FlashInferExperts."
# Every runtime patch target, in the order they are applied: (its name without "vllm-", a key of _makers; the target).
TARGETS: tuple[tuple[str, PatchSpec], ...] = (
    _target("flashinfer-scaled-fp4-mm-alias", LINEAR_FLASHINFER, "flashinfer_scaled_fp4_mm", _ALIAS_WHY, _is_callable),
    _target("modelopt-linear-weights-hook", MODELOPT, "ModelOptLinearMethod" + _PW, _WEIGHTS_WHY + _ONLY_NVFP4),
    _target("compressed-tensors-w4a4-nvfp4-weights-hook", CT, "CompressedTensorsW4A4Fp4" + _PW, _WEIGHTS_WHY + _CT),
    _target("flashinfer-cutlass-fused-moe-alias", FI_MOE, "flashinfer_cutlass_fused_moe", _MOE_ALIAS_WHY, _is_callable),
    _target(
        "flashinfer-moe-unquantized-inputs", FI_MOE, _FI + "expects_unquantized_inputs", _MOE_DEFER_WHY, _is_property
    ),
    _target("flashinfer-moe-output-shape", FI_MOE, _FI + "workspace_shapes", _MOE_SHAPES_WHY, _is_callable),
    _target("modelopt-nvfp4-moe-weights-hook", MODELOPT, MOE_KIND + _PW, _MOE_MO),
    _target("compressed-tensors-nvfp4-moe-weights-hook", CT_MOE, CT_MOE_KIND + _PW, _MOE_CT),
    _target("post-warmup-recheck", GPU_WORKER, "kernel_warmup", _WARMUP_WHY, _is_callable),
)


def _makers(w) -> dict[str, Callable]:
    """What replaces each target, calling into `w` (one install's wiring._Wired)."""

    def hook(before: Callable, after: Callable) -> Callable:
        return functools.partial(make_weights_hook, before=before, scope=w.weights_scope, after=after)

    def dense_hook(kind: str, check: Callable) -> Callable:
        return hook(functools.partial(w.before_dense, kind), lambda method, layer: w.verify(check(method, layer)))

    def moe_hook(kind: str) -> Callable:
        return hook(functools.partial(w.before_moe, kind), functools.partial(w.verify_moe, kind))

    return {
        "flashinfer-scaled-fp4-mm-alias": w.make_alias,
        "modelopt-linear-weights-hook": dense_hook("ModelOptLinearMethod (NVFP4)", modelopt_check),
        "compressed-tensors-w4a4-nvfp4-weights-hook": dense_hook("CompressedTensorsW4A4Fp4", compressed_tensors_check),
        "flashinfer-cutlass-fused-moe-alias": functools.partial(
            make_alias, make_front=functools.partial(w.router.make_moe_front, unknown=w.unmodeled_moe)
        ),
        "flashinfer-moe-unquantized-inputs": functools.partial(make_defer, served=w.moe_served),
        "flashinfer-moe-output-shape": make_shapes,
        "modelopt-nvfp4-moe-weights-hook": moe_hook(MOE_KIND),
        "compressed-tensors-nvfp4-moe-weights-hook": moe_hook(CT_MOE_KIND),
        # kernel_warmup(worker): once it returns, the re-check at its CUDA graphs' batch sizes
        "post-warmup-recheck": functools.partial(
            make_call_hook, after=lambda worker, *args: w.recheck(graph_sizes(worker))
        ),
    }


def specs(w) -> list[PatchSpec]:
    makers = _makers(w)
    return [replace(spec, make=makers[makes]) for makes, spec in TARGETS]


def doctor_rows() -> dict:
    """What ``sm120-fp4 doctor`` shows of vLLM (read without importing vLLM), every patch target included."""
    version = RELEASE.version()
    entry_points = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    plugins = [f"{e.name} -> {e.value}" for e in entry_points if e.value.startswith("sm120_fp4")]
    rows = RELEASE.doctor_rows(version, ledger_rows() + simulation.ledger_rows())
    found = {"engine": "vLLM", "version": version, "distribution": RELEASE.distribution(), **rows}
    return {**found, "plugin_entry_point": plugins or None}


def ledger_rows() -> list[PatchSpec]:
    return [spec for _, spec in TARGETS]
