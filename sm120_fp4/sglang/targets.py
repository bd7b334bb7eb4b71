"""Which SGLang attribute to patch in which release, and why: the runtime patch targets, as one declared table.

Facts read from every release's wheel (docs/sglang-releases.md); ``patches/LEDGER.md`` is made from :func:`ledger_rows`.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from typing import Callable

from ..backends.flashinfer import is_mm_fp4
from ..engines import make_call_hook
from ..patching import Patcher, PatchSpec
from ..serving.policy import make_weights_hook
from ..versions import version_in
from .autotune import RUNNER as AUTOTUNE_RUNNER
from .autotune import make_gate as make_autotune_gate
from .hooks import compressed_tensors_check, make_warmup_hook, modelopt_check
from .idle import make_idle_hook
from .moe import MOE_RUNNER_PIN, MOE_RUNNER_PIN_LEGACY, SEAM_VERSIONS, model_path
from .release import (
    AUTOTUNE,
    BASE_RUNNER,
    CT,
    CT_MOE,
    DISTRIBUTION,
    FP4_UTILS,
    KERNEL_OPS_GEMM,
    MODEL_RUNNER,
    MOE_RUNNER_FC,
    MOE_UTILS,
    MQ,
    RELEASE,
    SCHEDULER,
    SCHEDULER_CHECKER,
    WEIGHT_UPDATER,
    sglang_version,
    supported,
)

DENSE_FLAG = "--fp4-gemm-backend flashinfer_cutlass"
# The runner enum's values this library knows (0.5.8-0.5.23): AUTO and FLASHINFER_CUDNN are pinned to
# FLASHINFER_CUTLASS; TRTLLM, CUTEDSL and MARLIN are the operator's choice, never changed. Any other value (a
# member added later, e.g. FLASHINFER_B12X) prepares a layout this library has never read: refused.
KNOWN_RUNNERS = frozenset(
    {"auto", "flashinfer_cudnn", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_cutedsl", "marlin"}
)


def _is_the_alias(original: object) -> str | None:
    return is_mm_fp4(original)  # looked up when it runs


def _is_callable(original: object) -> str | None:
    return None if callable(original) else f"not a function: {type(original).__name__}"


_NO_CHECK = "no upstream check exists"


def _ledger(why: str, upstream: str, remove_when: str, **guard) -> dict:
    return dict(why=why, upstream=upstream, remove_when=remove_when, **guard)


_WEIGHTS = _ledger(
    "decide the device's backend (self-test, runner enum pinned) at the first NVFP4 layer, before the weight "
    "layout is chosen; refuse a fused layer whose shards' global scales differ (SGLang serves the largest); then "
    "verify this layer's configuration with its own weights through SGLang's own apply at every batch-size "
    "bucket, before SGLang serves or captures CUDA graphs",
    "no upstream start-up check exists (SGLang's warmup checks HTTP 200 only)",
    "when SGLang verifies FP4 GEMM output at start-up on SM12x",
)
_MOE_WEIGHTS = _ledger(
    "decide the device's fused-MoE backend, refuse a checkpoint whose gate and up global scales differ, then "
    "verify this layer's configuration (this rank's experts, top-k, activation, dtype, its own weights) through "
    f"the fused-MoE seam at every batch-size bucket; outside {SEAM_VERSIONS} (no seam) the layer is refused",
    "no upstream start-up check exists",
    "when SGLang verifies its fused-MoE output at start-up on SM12x",
)
_W4A16 = _ledger(
    "SGLang serves NVFP4 weight-only (W4A16) layers with FP4 Marlin (or FlashInfer's mm_bf16_fp4) called directly, "
    "past every call this library routes and verifies: on a served device refuse the layer (SM120_FP4_SELFTEST="
    "strict), or serve it UNVERIFIED, said in the log and in status().unverified (warn)",
    "no upstream check of FP4 Marlin's output on the device exists",
    "when a W4A16 NVFP4 kernel is a verified candidate of this library",
)
# SGLang's W4A16 NVFP4 classes (compressed-tensors' from 0.5.22; ModelOpt's W4A16_NVFP4 linear method from 0.5.15).
CT_W4A16 = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a16_nvfp4"
CT_W4A16_MOE = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a16_nvfp4_moe"
W4A16_KINDS = ("ModelOptNvFp4A16LinearMethod", "CompressedTensorsW4A16Fp4", "CompressedTensorsW4A16Nvfp4MoE")
_CAPTURE = _ledger(
    "after warm-up and CUDA-graph capture (the draft model's included; FlashInfer's autotuner has picked its "
    "tactics by then), re-run every verified layer configuration eagerly: a kernel that goes wrong only after "
    "warm-up refuses to serve",
    _NO_CHECK,
    "when SGLang verifies FP4 GEMM output after CUDA-graph capture on SM12x",
)
_UPDATE = _ledger(
    "SGLang writes weights in place (no version bump): drop the caches of dequantized weights, and verify every "
    "layer whose weights changed before it serves again (else the re-check would refuse them as corrupted)",
    _NO_CHECK,
    "when SGLang verifies FP4 output after its weight updates on SM12x",
)
# The ledger text (and guard) of each kind of target, by what replaces it (a key of _makers; a weights hook: its class).
_LEDGER = {
    "dispatch": _ledger(
        "SM120 FP4 GEMM through FlashInfer's mm_fp4: backend='auto' tried cuDNN first (CUDNN_STATUS_BAD_PARAM), "
        "cutlass without alpha raises 'Expected DLTensor* but got None', SGLang never passes out, and nothing "
        "checks the numbers; route to the backend verified on this GPU with alpha and a contiguous out",
        "flashinfer#2577 (all zeros), flashinfer#3398 (zeros at some M), sglang#20043 / PR 20047 (NaN rows)",
        "when SGLang passes an explicit, verified backend with alpha and out on SM12x and checks the output at "
        "start-up (patches/sglang-*-sm120-fp4.patch upstreamed), or `scripts/upstream_patches.py check` says fixed",
        check=_is_the_alias,
        when_missing="SGLang binds it only when `from flashinfer import mm_fp4` succeeds: is FlashInfer importable?",
    ),
    "decline": _ledger(
        "SGLang's fp4_gemm op first tries its own KDA NVFP4 GEMM (fixed Qwen3.x shapes), unverified and past the "
        "FP4 GEMM alias; on a served device the gate returns None, so the call goes on to the routed, verified alias",
        "no upstream check of this kernel's output on the device exists",
        "when this kernel is a verified candidate of the dense family (self-test, layer checks)",
        check=_is_callable,
    ),
    "autotune-gate": _ledger(
        "SGLang tunes FlashInfer at warm-up only for a FlashInfer MoE runner string or a ModelOpt quantization; "
        f"where that alone makes its gate say no (asked again with the runner string {AUTOTUNE_RUNNER}, so its other "
        "refusals stand) and this library serves NVFP4 layers here with a backend FlashInfer tunes, say yes",
        "no upstream issue; SGLang's gate reads the runner string and the quantization name only",
        "when SGLang's autotune gate asks the NVFP4 layers' resolved backends instead of the strings",
        check=_is_callable,
    ),
    "ModelOptFp4LinearMethod": _WEIGHTS,
    "CompressedTensorsW4A4Fp4": _WEIGHTS,
    "recheck": _CAPTURE,
    "retime": _ledger(
        "SM120_FP4_SELECT=fastest: right after BaseRunner.warmup (FlashInfer's autotune has picked its tactics) "
        "and before CUDA-graph capture, time the verified candidates again and route each batch-size range to the "
        "fastest; nothing changes under the default SELECT=first",
        "no upstream issue: a choice among verified backends",
        "when SGLang routes NVFP4 layers to a measured, verified backend per batch size",
        check=_is_callable,
    ),
    "moe-runner-config": _ledger(
        "after SGLang initialises its MoE config, pin the runner 'auto' to flashinfer_cutlass for an NVFP4 "
        "checkpoint on a served device: 'auto' would pick flashinfer_trtllm, which does not run on SM12x",
        MOE_RUNNER_PIN.upstream,
        MOE_RUNNER_PIN.remove_when,
    ),
    "moe-seam": _ledger(
        "SGLang's NVFP4 MoE calls FlashInfer's cutlass_fused_moe through this lookup; route NVFP4 calls to the MoE "
        "backend verified on this GPU (bf16/fp8/MXFP4 calls go to FlashInfer unchanged)",
        "flashinfer PR 3533 (rows 64-127 of a tile zeroed on SM120), flashinfer#2723, #5446",
        _MOE_WEIGHTS["remove_when"],
    ),
    **dict.fromkeys(W4A16_KINDS, _W4A16),
    "ModelOptNvFp4FusedMoEMethod": _MOE_WEIGHTS,
    "CompressedTensorsW4A4Nvfp4MoE": _MOE_WEIGHTS,
    "weights-update": _UPDATE,
    "update-begin": _UPDATE,
    "update-end": _UPDATE,
    "idle": _ledger(
        "the serving canary (SM120_FP4_CANARY, opt-in) runs its bounded slices where the scheduler loop found no "
        "batch to run, on the scheduler thread, never inside graph capture; a refusal here stops the server",
        "no upstream check exists (sglang --kv-canary checks the KV cache, not the GEMMs)",
        "when SGLang re-verifies its FP4 GEMM and fused-MoE output while serving",
    ),
}


def _target(makes: str, name: str, module: str, attribute: str, versions: str) -> tuple[str, PatchSpec]:
    """Declare one target: `versions` is where it starts, and where it disappears if it does."""
    spec = PatchSpec(name, module, attribute, distribution=DISTRIBUTION, versions=supported(versions), **_LEDGER[makes])
    return makes, spec


def _weights(kind: str, name: str, module: str, versions: str) -> tuple[str, str, str, str, str]:
    return kind, name, module, f"{kind}.process_weights_after_loading", versions


_MIXIN = "SchedulerRuntimeCheckerMixin"
_GATE = "should_run_flashinfer_autotune"
# SGLang's weight-update calls: ModelRunner's up to 0.5.15, its WeightUpdater component's from 0.5.16.
_UPDATES = (
    (MODEL_RUNNER, "ModelRunner", "update_weights_from_disk", ">=0.5.8,<0.5.16"),
    (MODEL_RUNNER, "ModelRunner", "update_weights_from_tensor", ">=0.5.8,<0.5.16"),
    (MODEL_RUNNER, "ModelRunner", "update_weights_from_distributed", ">=0.5.8,<0.5.16"),
    (MODEL_RUNNER, "ModelRunner", "update_weights_from_ipc", ">=0.5.8,<0.5.16"),
    (WEIGHT_UPDATER, "WeightUpdater", "update_weights_from_disk", ">=0.5.16"),
    (WEIGHT_UPDATER, "WeightUpdater", "update_weights_from_tensor", ">=0.5.16"),
    (WEIGHT_UPDATER, "WeightUpdater", "update_weights_from_ipc", ">=0.5.16"),
    (WEIGHT_UPDATER, "WeightUpdater", "update_weights_from_distributed", ">=0.5.16,<0.5.21"),
    (WEIGHT_UPDATER, "WeightUpdater", "load_weights_from_distributed", ">=0.5.21"),
)


def _update(module: str, owner: str, method: str, versions: str) -> tuple[str, str, str, str, str]:
    component = "-component" if module == WEIGHT_UPDATER else ""
    name = f"reverify-after-{method.replace('_', '-')}{component}"
    return "weights-update", name, module, f"{owner}.{method}", versions


_ROWS = (
    ("dispatch", "flashinfer-fp4-gemm-alias", MQ, "flashinfer_fp4_gemm", ">=0.5.8"),
    ("decline", "kda-nvfp4-gemm-fast-path-declined", KERNEL_OPS_GEMM, "try_qwen3x_nvfp4_gemm", ">=0.5.20"),
    ("autotune-gate", "flashinfer-autotune-gate", AUTOTUNE, _GATE, ">=0.5.15"),
    # base_runner imports the gate by name (BaseRunner._warmup calls it); the speculative draft, through the module.
    ("autotune-gate", "flashinfer-autotune-gate-base-runner", BASE_RUNNER, _GATE, ">=0.5.15"),
    _weights("ModelOptFp4LinearMethod", "modelopt-fp4-weights-hook", MQ, ">=0.5.8"),
    _weights("CompressedTensorsW4A4Fp4", "compressed-tensors-w4a4-weights-hook", CT, ">=0.5.8"),
    ("retime", "post-autotune-retime", BASE_RUNNER, "BaseRunner.warmup", ">=0.5.15"),
    ("recheck", "post-warmup-recheck", MODEL_RUNNER, "ModelRunner.init_cuda_graphs", ">=0.5.14"),
    ("recheck", "post-warmup-recheck-legacy", MODEL_RUNNER, "ModelRunner.init_device_graphs", ">=0.5.8,<0.5.14"),
    ("moe-runner-config", "moe-runner-config-hook", MOE_UTILS, "initialize_moe_config", SEAM_VERSIONS),
    ("moe-seam", "fused-moe-kernel-seam", MOE_RUNNER_FC, "_flashinfer_cutlass_fused_moe", SEAM_VERSIONS),
    _weights("ModelOptNvFp4FusedMoEMethod", "modelopt-nvfp4-moe-weights-hook", MQ, ">=0.5.8"),
    _weights("CompressedTensorsW4A4Nvfp4MoE", "compressed-tensors-nvfp4-moe-weights-hook", CT_MOE, ">=0.5.9"),
    _weights("ModelOptNvFp4A16LinearMethod", "modelopt-nvfp4-w4a16-refused", MQ, ">=0.5.15"),
    _weights("CompressedTensorsW4A16Fp4", "compressed-tensors-w4a16-nvfp4-refused", CT_W4A16, ">=0.5.22"),
    _weights("CompressedTensorsW4A16Nvfp4MoE", "compressed-tensors-w4a16-nvfp4-moe-refused", CT_W4A16_MOE, ">=0.5.22"),
    # The scheduler's capture calls, so that the draft model's graphs are re-checked too.
    ("recheck", "post-capture-recheck-all-graphs", SCHEDULER, "Scheduler.init_all_cuda_graphs", ">=0.5.14"),
    ("recheck", "post-capture-recheck-model-workers", SCHEDULER, "Scheduler.init_model_worker", ">=0.5.8,<0.5.14"),
    *(_update(*row) for row in _UPDATES),
    ("update-begin", "weight-update-session-begin", WEIGHT_UPDATER, "WeightUpdater.begin_weight_update", ">=0.5.21"),
    ("update-end", "weight-update-session-end", WEIGHT_UPDATER, "WeightUpdater.end_weight_update", ">=0.5.21"),
)
# Every runtime patch target, in the order applied: (what replaces it, the target with its guard and ledger text).
TARGETS: tuple[tuple[str, PatchSpec], ...] = tuple(_target(*row) for row in _ROWS)


_DENSE_CHECKS = {"ModelOptFp4LinearMethod": modelopt_check, "CompressedTensorsW4A4Fp4": compressed_tensors_check}


def _makers(w) -> dict[str, Callable]:
    """Return what replaces each kind of target, wired to one install's routing and verification."""

    def weights_hook(kind: str, before: Callable, check: Callable) -> Callable:
        return functools.partial(
            make_weights_hook,
            before=lambda method, layer: before(kind, method, layer),
            scope=w.weights_scope,
            after=lambda method, layer: w.verify(check(method, layer)),
        )

    def moe_hook(kind: str) -> Callable:
        return weights_hook(kind, w.before_moe, lambda method, layer: w.moe_check(kind, layer))

    begin = functools.partial(make_call_hook, before=lambda *args: w.weights_update_begin())
    end = functools.partial(make_call_hook, end=w.weights_update_end)
    return {
        "dispatch": w.make_dispatch,
        "decline": w.make_decline,
        "autotune-gate": functools.partial(make_autotune_gate, served=w.tuned_families, said=set()),
        **{kind: weights_hook(kind, w.before_dense, check) for kind, check in _DENSE_CHECKS.items()},
        "retime": functools.partial(make_call_hook, after=lambda *args: w.retime()),
        "recheck": functools.partial(make_warmup_hook, after=w.recheck),
        "moe-runner-config": functools.partial(make_call_hook, after=lambda *args: w.pin_moe_runner(model_path(args))),
        "moe-seam": w.make_moe_seam,
        **{kind: moe_hook(kind) for kind in ("ModelOptNvFp4FusedMoEMethod", "CompressedTensorsW4A4Nvfp4MoE")},
        **{kind: weights_hook(kind, w.before_w4a16, lambda method, layer: None) for kind in W4A16_KINDS},
        "weights-update": functools.partial(begin, end=w.weights_update_end),
        "update-begin": begin,
        "update-end": end,
    }


def specs(w) -> list[PatchSpec]:
    """Return the runtime patches for every supported release, each with what replaces it (`w`: wiring._Install)."""
    makers = _makers(w)
    return [replace(spec, make=makers[makes]) for makes, spec in TARGETS]


# The scheduler loop's idle point in each release (the serving canary's place).
_IDLE_POINTS = tuple(
    _target("idle", *row)
    for row in (
        ("scheduler-idle-canary", SCHEDULER, "Scheduler.on_idle", ">=0.5.13"),
        ("scheduler-idle-canary-mixin", SCHEDULER_CHECKER, f"{_MIXIN}.on_idle", ">=0.5.11,<0.5.13"),
        ("scheduler-idle-canary-self-check", SCHEDULER_CHECKER, f"{_MIXIN}.self_check_during_idle", ">=0.5.8,<0.5.11"),
    )
)


def idle_specs(run: Callable) -> list[PatchSpec]:
    """Return the scheduler loop's idle point in each release, wrapped to call `run(stream)` first (the canary)."""
    return [replace(spec, make=functools.partial(make_idle_hook, run=run)) for _, spec in _IDLE_POINTS]


def idle_spec(run: Callable, version: str | None = None) -> PatchSpec | None:
    """Return the idle point of SGLang `version` (default: the installed one); None where it has none."""
    version = version or sglang_version()
    return next((s for s in idle_specs(run) if version is not None and version_in(version, s.versions)), None)


ENUM_PIN = PatchSpec(
    name="fp4-runner-backend-pin",
    module=FP4_UTILS,
    attribute="FP4_GEMM_RUNNER_BACKEND",
    distribution=DISTRIBUTION,
    versions=supported(">=0.5.8"),
    why=(
        "the runner enum picks the weight layout at load time and the backend name passed to FlashInfer: AUTO "
        "reaches FlashInfer unresolved (0.5.8, and any process that never ran initialize_fp4_gemm_config), and AUTO "
        "resolves to FLASHINFER_CUDNN on SM120 in 0.5.10-0.5.12; pin only AUTO/FLASHINFER_CUDNN to "
        "FLASHINFER_CUTLASS (same 128x4 non-shuffled layout), never trtllm, marlin, cute-dsl or SGLang's own cutlass"
    ),
    upstream="sglang#20043 / PR 20047 (auto -> cudnn on SM120), flashinfer auto order changes 0.6.9+",
    remove_when="when SGLang resolves auto to a verified backend on SM12x itself",
)
_UNKNOWN = (
    "which this sm120_fp4 does not know: neither the weight layout SGLang prepares for it nor the kernel is verified "
    f"on this GPU. Start SGLang with {DENSE_FLAG} (routed to the backend verified here), or upgrade sm120_fp4"
)


def runner_backend_problem() -> str | None:
    """Return why SGLang's FP4 GEMM runner enum member cannot be served verified (None: a known one, or no enum)."""
    current = getattr(sys.modules.get(FP4_UTILS), "FP4_GEMM_RUNNER_BACKEND", None)
    value = getattr(current, "value", None)
    if current is None or value in KNOWN_RUNNERS:
        return None
    try:
        flashinfer = current.get_flashinfer_backend()
    except Exception:
        flashinfer = "?"
    return f"SGLang's FP4 GEMM runner backend is {current} ({value!r}, FlashInfer backend {flashinfer!r}), {_UNKNOWN}"


def unknown_backend_problem(index: int, backend: object) -> str:
    """Return why an mm_fp4 call naming `backend` on served device `index` is not served."""
    return f"SGLang called FlashInfer's mm_fp4 with backend={backend!r} on device {index}, a backend {_UNKNOWN}"


def unverified_argument_problem(index: int, name: str, value: object) -> str:
    """Return why an mm_fp4 call on served device `index` with argument `name`=`value` is not served."""
    return (
        f"SGLang called FlashInfer's mm_fp4 with {name}={value!r} on device {index}: the FP4 GEMM backend verified "
        "on this GPU was verified for NVFP4 calls with block_size=16, the 128x4 scale layout and no such argument, "
        "so it would reach FlashInfer's own kernel unverified. Upgrade sm120_fp4 to a release that knows this argument, "
        "or set SM120_FP4_SELFTEST=warn to serve it unverified"
    )


def pin_runner_backend(patcher: Patcher) -> None:
    """Pin fp4_utils.FP4_GEMM_RUNNER_BACKEND to FLASHINFER_CUTLASS when it is AUTO/FLASHINFER_CUDNN."""
    module = sys.modules.get(FP4_UTILS)
    if module is None:
        return  # SGLang has not imported it
    enum = getattr(module, "Fp4GemmRunnerBackend", None)
    if enum is None or not all(hasattr(enum, m) for m in ("AUTO", "FLASHINFER_CUDNN", "FLASHINFER_CUTLASS")):
        patcher.note(ENUM_PIN, "skipped", "Fp4GemmRunnerBackend lacks AUTO/FLASHINFER_CUDNN/FLASHINFER_CUTLASS")
        return
    replaceable = (None, enum.AUTO, enum.FLASHINFER_CUDNN)
    patcher.pin(ENUM_PIN, module, enum.FLASHINFER_CUTLASS, lambda current: current in replaceable)


def ledger_rows() -> list[PatchSpec]:
    """Return every runtime patch target, for the ledger and `doctor` (one source of truth)."""
    return specs(_Unwired()) + [ENUM_PIN, MOE_RUNNER_PIN, MOE_RUNNER_PIN_LEGACY] + idle_specs(_noop)


def _noop(*args, **kwargs) -> None:
    return None


class _Unwired:
    """Stand in for an install in the ledger's rows: each of its calls does nothing."""

    def __getattr__(self, name: str) -> Callable:
        return _noop


def doctor_rows() -> dict:
    """Return what ``sm120-fp4 doctor`` shows of SGLang (read without importing it), every patch target included."""
    version = sglang_version()
    return {"sglang": version, **RELEASE.doctor_rows(version, ledger_rows())}
