"""Which SGLang attribute to patch in which release, and why (the runtime patch targets).

Adding a release or a target is an edit in this package alone. The facts behind each entry were
read from every release's wheel (0.5.3 - 0.5.23, see docs/sglang-releases.md);
``patches/LEDGER.md`` is generated from :func:`ledger_rows` (``scripts/ledger.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass, replace
from typing import Callable

from ..backends.flashinfer import is_mm_fp4
from ..patching import Patcher, PatchSpec
from ..versions import version_in
from .autotune import RUNNER as AUTOTUNE_RUNNER
from .autotune import make_gate as make_autotune_gate
from .hooks import compressed_tensors_check, make_update_hook, make_warmup_hook, make_weights_hook, modelopt_check
from .idle import make_idle_hook
from .moe import MOE_RUNNER_PIN, MOE_RUNNER_PIN_LEGACY, SEAM_VERSIONS, make_config_hook, moe_check
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
    SCHEDULER,
    SCHEDULER_CHECKER,
    SUPPORTED,
    WEIGHT_UPDATER,
    sglang_version,
    supported,
)

__all__ = [
    "Wiring",
    "TARGETS",
    "specs",
    "idle_specs",
    "idle_spec",
    "pin_runner_backend",
    "apply_env_knobs",
    "ledger_rows",
    "ENUM_PIN",
    "LEGACY_KNOB_SPEC",
    "KNOWN_RUNNERS",
    "runner_backend_problem",
    "unknown_backend_problem",
    "unverified_argument_problem",
]

_LOG = logging.getLogger("sm120_fp4")
LEGACY_KNOB = "SGLANG_USE_CUTLASS_BACKEND_FOR_FP4_GEMM"

_ALIAS_WHY = (
    "SM120 FP4 GEMM through FlashInfer's mm_fp4: backend='auto' tried cuDNN first "
    "(CUDNN_STATUS_BAD_PARAM), cutlass without alpha raises 'Expected DLTensor* but got None', "
    "SGLang never passes out, and nothing checks the numbers; route to the backend verified on "
    "this GPU with alpha and a contiguous out"
)
_ALIAS_MISSING = (
    "SGLang binds it only when `from flashinfer import mm_fp4` succeeds: is FlashInfer installed and importable?"
)
_ALIAS_UPSTREAM = "flashinfer#2577 (all zeros), flashinfer#3398 (zeros at some M), sglang#20043 / PR 20047 (NaN rows)"
_ALIAS_REMOVE = (
    "when SGLang passes an explicit, verified backend with alpha and out on SM12x and checks the "
    "output at start-up (patches/sglang-*-sm120-fp4.patch upstreamed), or `sm120-fp4 patches check` says fixed"
)


@dataclass(frozen=True)
class Wiring:
    """What the patches call into (one install's routing and verification).

    `make_dispatch(original)`: the FP4 GEMM alias replacement; `before_dense(kind, method, layer)`: decide
    before a dense layer's weights are processed (and refuse a checkpoint whose scales cannot serve: a
    non-finite or non-positive one, or shards' own global scales that differ, which SGLang's processing
    reduces to one); `weights_scope()`: a context for that processing;
    `verify(check)`: verify one layer configuration (a LayerCheck, or None: nothing to verify);
    `recheck()`: re-run every verified configuration after warm-up; `make_moe_seam(original)`: the
    fused-MoE seam replacement; `before_moe(kind, method, layer)`: decide (and check the checkpoint and the
    layer's runner) before an NVFP4 MoE layer's weights are processed; `pin_moe_runner(model_path)`: after
    SGLang's MoE config is initialised, pin its 'auto' runner for an NVFP4 checkpoint on a served device;
    `weights_update_begin()` / `weights_update_end()`: around SGLang's weight-update calls (drop caches;
    verify the layers whose weights changed).
    """

    make_dispatch: Callable
    before_dense: Callable[[str, object, object], object]
    weights_scope: Callable
    verify: Callable[[object], None]
    recheck: Callable[[list[int]], object]
    make_moe_seam: Callable
    before_moe: Callable[[str, object, object], None]
    pin_moe_runner: Callable[[str | None], None]
    weights_update_begin: Callable[[], object] = lambda: None  # SGLang starts writing weights
    weights_update_end: Callable[[], object] = lambda: None  # ... and is done: verify what changed
    make_decline: Callable = lambda original: original  # SGLang's own FP4 GEMM fast path: None on a served device
    tuned_families: Callable[[], list[str]] = lambda: []  # served here with a backend FlashInfer's autotuner tunes


_MOE_WHY = (
    "decide the NVFP4 fused-MoE backend for the layer's device, refuse a checkpoint whose gate and up global "
    "scales differ (the cutlass path applies the gate's to both), then verify this layer's configuration "
    "(this rank's experts and I slice, top-k, activation, dtype, its own processed weights) through the "
    "fused-MoE seam as SGLang calls it, at every batch-size bucket and with >= 128 rows on one expert"
)
_WARMUP_WHY = (
    "after SGLang's warm-up and CUDA-graph capture (FlashInfer's autotuner has picked its tactics by "
    "then), re-run every verified layer configuration once, eagerly and outside capture; a kernel "
    "that goes wrong only after warm-up refuses to serve"
)
_WEIGHTS_WHY = (
    "run the self-test (decide) once per device at the first NVFP4 layer and pin the runner enum "
    "before the weight layout is chosen; refuse a fused layer whose shards' global scales differ (SGLang "
    "serves it with the largest: the other shards' rows come out scaled); then verify this layer's configuration (N, K, dtype, "
    "scale dtypes, its own weights) through SGLang's own apply at every batch-size bucket, "
    "before SGLang serves or captures CUDA graphs"
)
_UPDATE_WHY = (
    "SGLang writes weights in place (param.data, no version bump): drop the caches of dequantized weights "
    "first, and verify every layer whose weights changed (its light check, its configuration's sweep, a new "
    "fingerprint) before it serves again; without this the re-check would refuse the new weights as corrupted"
)
_KDA_WHY = (
    "0.5.20+: SGLang's fp4_gemm op first tries its own KDA NVFP4 GEMM (try_qwen3x_nvfp4_gemm: CuTe DSL, compute "
    "capability 12.0, fixed Qwen3.x shapes at M 1, 2, 4, 8 and one more) and returns its output without reaching the "
    "FP4 GEMM alias, so neither the route nor the layer check would see that kernel; on a device this library serves "
    "the gate returns None (the call goes on to the routed, verified alias), logged once; elsewhere SGLang's gate runs"
)
_AUTOTUNE_WHY = (
    "SGLang runs FlashInfer's autotune at warm-up only when the MoE runner server-argument string names a FlashInfer "
    "runner or the quantization is modelopt_fp4/modelopt_mixed: a compressed-tensors NVFP4 checkpoint's dense layers "
    "are never tuned, and its MoE layers are not either with the runner pinned from 'auto' through SGLang's flags (the "
    "string stays 'auto'); where SGLang's gate says no for that reason alone (asked again with the runner string "
    f"{AUTOTUNE_RUNNER}, so each of its other refusals stands) and this library serves NVFP4 layers on the device "
    "with a backend FlashInfer tunes (dense cutlass or b12x, MoE cutlass), say yes, as for an explicit "
    f"--moe-runner-backend {AUTOTUNE_RUNNER} ModelOpt configuration; otherwise SGLang's answer, unchanged"
)
_AUTOTUNE = dict(
    versions=">=0.5.15",
    upstream="no upstream issue; SGLang's gate reads the runner string and the quantization name only",
    remove_when="when SGLang's autotune gate asks the NVFP4 layers' resolved backends instead of the strings",
)
_MOE_REMOVE = "when SGLang verifies its fused-MoE output at start-up on SM12x"
_CAPTURE = dict(
    upstream="no upstream check exists",
    remove_when="when SGLang verifies FP4 GEMM output after CUDA-graph capture on SM12x",
)
_UPDATE = dict(
    upstream="no upstream check exists", remove_when="when SGLang verifies FP4 output after its weight updates on SM12x"
)


def _is_the_alias(original: object) -> str | None:
    """The alias targets' check: is what SGLang bound FlashInfer's mm_fp4 (looked up when it runs)."""
    return is_mm_fp4(original)


def _is_callable(original: object) -> str | None:
    """The fast-path gate's check: SGLang's gate is a function (its signature is the op's)."""
    return None if callable(original) else f"not a function: {type(original).__name__}"


def _target(makes: str, versions: str, **fields) -> tuple[str, PatchSpec]:
    """One declared target: `versions` says where it starts (and where it disappears, if it does);
    SUPPORTED caps the rest."""
    return makes, PatchSpec(distribution=DISTRIBUTION, versions=supported(versions), **fields)


# Every runtime patch target of every supported release, in the order they are applied: (what
# replaces it -- a key of _makers --, the target with its version guard and its ledger text).
TARGETS: tuple[tuple[str, PatchSpec], ...] = (
    _target(
        "dispatch",
        name="flashinfer-fp4-gemm-alias",
        module=MQ,
        attribute="flashinfer_fp4_gemm",
        check=_is_the_alias,
        when_missing=_ALIAS_MISSING,
        versions=">=0.5.8",
        why=_ALIAS_WHY,
        upstream=_ALIAS_UPSTREAM,
        remove_when=_ALIAS_REMOVE,
    ),
    _target(
        "dispatch",
        name="fp4-gemm-alias-legacy",
        module=MQ,
        attribute="fp4_gemm",
        check=_is_the_alias,
        when_missing=_ALIAS_MISSING,
        versions=">=0.5.3,<0.5.8",
        why=_ALIAS_WHY
        + " (0.5.3-0.5.7 name the alias fp4_gemm; apply() calls it, directly in 0.5.5, through the sglang::fp4_gemm op from 0.5.5.post3)",
        upstream=_ALIAS_UPSTREAM,
        remove_when=_ALIAS_REMOVE,
    ),
    _target(
        "decline",
        name="kda-nvfp4-gemm-fast-path-declined",
        module=KERNEL_OPS_GEMM,
        attribute="try_qwen3x_nvfp4_gemm",
        versions=">=0.5.20",
        check=_is_callable,
        why=_KDA_WHY,
        upstream="no upstream check of this kernel's output on the device exists",
        remove_when="when this kernel is a verified candidate of the dense family (self-test, layer checks)",
    ),
    _target(
        "autotune-gate",
        name="flashinfer-autotune-gate",
        module=AUTOTUNE,
        attribute="should_run_flashinfer_autotune",
        why=_AUTOTUNE_WHY + " (the module's function: the speculative draft's warm-up calls it through the module)",
        check=_is_callable,
        **_AUTOTUNE,
    ),
    _target(
        "autotune-gate",
        name="flashinfer-autotune-gate-base-runner",
        module=BASE_RUNNER,
        attribute="should_run_flashinfer_autotune",
        why=_AUTOTUNE_WHY + " (base_runner's own name for it: BaseRunner._warmup calls it, imported by name)",
        check=_is_callable,
        **_AUTOTUNE,
    ),
    _target(
        "modelopt-weights",
        name="modelopt-fp4-weights-hook",
        module=MQ,
        attribute="ModelOptFp4LinearMethod.process_weights_after_loading",
        versions=SUPPORTED,
        why=_WEIGHTS_WHY,
        upstream="no upstream start-up check exists (SGLang's warmup checks HTTP 200 only)",
        remove_when="when SGLang verifies FP4 GEMM output at start-up on SM12x",
    ),
    _target(
        "compressed-tensors-weights",
        name="compressed-tensors-w4a4-weights-hook",
        module=CT,
        attribute="CompressedTensorsW4A4Fp4.process_weights_after_loading",
        versions=">=0.5.7",
        why=_WEIGHTS_WHY + " (compressed-tensors W4A4 NVFP4 checkpoints)",
        upstream="no upstream start-up check exists",
        remove_when="when SGLang verifies FP4 GEMM output at start-up on SM12x",
    ),
    _target(
        "recheck",
        name="post-warmup-recheck",
        module=MODEL_RUNNER,
        attribute="ModelRunner.init_cuda_graphs",
        versions=">=0.5.14",
        why=_WARMUP_WHY,
        **_CAPTURE,
    ),
    _target(
        "recheck",
        name="post-warmup-recheck-legacy",
        module=MODEL_RUNNER,
        attribute="ModelRunner.init_device_graphs",
        versions=">=0.5.3,<0.5.14",
        why=_WARMUP_WHY + " (0.5.3-0.5.13 name the method init_device_graphs)",
        **_CAPTURE,
    ),
    _target(
        "moe-runner-config",
        name="moe-runner-config-hook",
        module=MOE_UTILS,
        attribute="initialize_moe_config",
        versions=SEAM_VERSIONS,
        why=(
            "after SGLang initialises its MoE config in each scheduler, pin the runner 'auto' to flashinfer_cutlass "
            "for an NVFP4 checkpoint on a served device (moe-runner-backend-pin): 'auto' would serve NVFP4 MoE "
            "with flashinfer_trtllm, which does not run on SM12x"
        ),
        upstream=MOE_RUNNER_PIN.upstream,
        remove_when=MOE_RUNNER_PIN.remove_when,
    ),
    _target(
        "moe-seam",
        name="fused-moe-kernel-seam",
        module=MOE_RUNNER_FC,
        attribute="_flashinfer_cutlass_fused_moe",
        versions=SEAM_VERSIONS,
        why=(
            "SGLang's NVFP4 MoE calls FlashInfer's cutlass_fused_moe through this lookup; route NVFP4 calls to the "
            "MoE backend verified on this GPU (bf16/fp8/MXFP4 calls go to FlashInfer unchanged)"
        ),
        upstream="flashinfer PR 3533 (rows 64-127 of a tile zeroed on SM120), flashinfer#2723 (grouped GEMM garbage), #5446",
        remove_when=_MOE_REMOVE,
    ),
    _target(
        "modelopt-moe-weights",
        name="modelopt-nvfp4-moe-weights-hook",
        module=MQ,
        attribute="ModelOptNvFp4FusedMoEMethod.process_weights_after_loading",
        versions=SUPPORTED,
        why=_MOE_WHY
        + f" (releases outside {SEAM_VERSIONS} have no seam: the layer is refused unless SELFTEST says otherwise)",
        upstream="no upstream start-up check exists",
        remove_when=_MOE_REMOVE,
    ),
    _target(
        "compressed-tensors-moe-weights",
        name="compressed-tensors-nvfp4-moe-weights-hook",
        module=CT_MOE,
        attribute="CompressedTensorsW4A4Nvfp4MoE.process_weights_after_loading",
        versions=">=0.5.9",
        why=_MOE_WHY + " (compressed-tensors W4A4 NVFP4 MoE checkpoints: one activation scale per expert)",
        upstream="no upstream start-up check exists",
        remove_when=_MOE_REMOVE,
    ),
    # The scheduler's capture calls, so that the draft model's graphs are re-checked too.
    _target(
        "recheck",
        name="post-capture-recheck-all-graphs",
        module=SCHEDULER,
        attribute="Scheduler.init_all_cuda_graphs",
        versions=">=0.5.14",
        why=_WARMUP_WHY + " (once, after the target's and the speculative draft model's graphs are all captured: the "
        "draft worker captures its own decode and draft-extend graphs after its model runner's)",
        **_CAPTURE,
    ),
    _target(
        "recheck",
        name="post-capture-recheck-model-workers",
        module=SCHEDULER,
        attribute="Scheduler.init_model_worker",
        versions=">=0.5.7,<0.5.14",
        why=_WARMUP_WHY + " (once, after the target and the speculative draft workers are built: 0.5.7-0.5.13 "
        "capture graphs while building them, the draft worker's own graphs in its constructor)",
        **_CAPTURE,
    ),
    # SGLang's weight-update calls: ModelRunner's up to 0.5.15, its WeightUpdater component from 0.5.16.
    *(
        _target(
            "weights-update",
            name=f"reverify-after-{method.replace('_', '-')}",
            module=MODEL_RUNNER,
            attribute=f"ModelRunner.{method}",
            versions=versions,
            why=_UPDATE_WHY,
            **_UPDATE,
        )
        for method, versions in (
            ("update_weights_from_disk", ">=0.5.3,<0.5.16"),
            ("update_weights_from_tensor", ">=0.5.3,<0.5.16"),
            ("update_weights_from_distributed", ">=0.5.3,<0.5.16"),
            ("update_weights_from_ipc", ">=0.5.4,<0.5.16"),
        )
    ),
    *(
        _target(
            "weights-update",
            name=f"reverify-after-{method.replace('_', '-')}-component",
            module=WEIGHT_UPDATER,
            attribute=f"WeightUpdater.{method}",
            versions=versions,
            why=_UPDATE_WHY,
            **_UPDATE,
        )
        for method, versions in (
            ("update_weights_from_disk", ">=0.5.16"),
            ("update_weights_from_tensor", ">=0.5.16"),
            ("update_weights_from_ipc", ">=0.5.16"),
            ("update_weights_from_distributed", ">=0.5.16,<0.5.21"),
            ("load_weights_from_distributed", ">=0.5.21"),
        )
    ),
    _target(
        "weights-update-begin",
        name="weight-update-session-begin",
        module=WEIGHT_UPDATER,
        attribute="WeightUpdater.begin_weight_update",
        versions=">=0.5.21",
        why=_UPDATE_WHY + " (a weight-update session: tensor and distributed loads run between begin and end)",
        **_UPDATE,
    ),
    _target(
        "weights-update-end",
        name="weight-update-session-end",
        module=WEIGHT_UPDATER,
        attribute="WeightUpdater.end_weight_update",
        versions=">=0.5.21",
        why=_UPDATE_WHY + " (the session's end, after SGLang post-processes the new weights)",
        **_UPDATE,
    ),
)


def _makers(w: Wiring) -> dict[str, Callable]:
    """What replaces each kind of target, wired to one install's routing and verification."""

    def dense_hook(kind: str, check: Callable) -> Callable:
        before = lambda method, layer: w.before_dense(kind, method, layer)  # noqa: E731
        after = lambda method, layer: w.verify(check(method, layer))  # noqa: E731
        return functools.partial(make_weights_hook, before=before, scope=w.weights_scope, after=after)

    def moe_hook(kind: str) -> Callable:
        before = lambda method, layer: w.before_moe(kind, method, layer)  # noqa: E731
        after = lambda method, layer: w.verify(moe_check(kind, layer))  # noqa: E731
        return functools.partial(make_weights_hook, before=before, scope=w.weights_scope, after=after)

    return {
        "dispatch": w.make_dispatch,
        "decline": w.make_decline,
        "autotune-gate": functools.partial(make_autotune_gate, served=w.tuned_families, said=set()),
        "modelopt-weights": dense_hook("ModelOptFp4LinearMethod", modelopt_check),
        "compressed-tensors-weights": dense_hook("CompressedTensorsW4A4Fp4", compressed_tensors_check),
        "recheck": functools.partial(make_warmup_hook, after=w.recheck),
        "moe-runner-config": functools.partial(make_config_hook, pin=w.pin_moe_runner),
        "moe-seam": w.make_moe_seam,
        "modelopt-moe-weights": moe_hook("ModelOptNvFp4FusedMoEMethod"),
        "compressed-tensors-moe-weights": moe_hook("CompressedTensorsW4A4Nvfp4MoE"),
        "weights-update": functools.partial(make_update_hook, begin=w.weights_update_begin, end=w.weights_update_end),
        "weights-update-begin": functools.partial(make_update_hook, begin=w.weights_update_begin, end=None),
        "weights-update-end": functools.partial(make_update_hook, begin=None, end=w.weights_update_end),
    }


def specs(w: Wiring) -> list[PatchSpec]:
    """The runtime patches for every supported release (TARGETS, each guarded by its own version
    range), each with what replaces it."""
    makers = _makers(w)
    return [replace(spec, make=makers[makes]) for makes, spec in TARGETS]


_IDLE_WHY = (
    "the serving canary (SM120_FP4_CANARY, opt-in; patched only when it is on) runs its bounded slices here: the "
    "scheduler loop calls this when it found no batch to run, between forward passes, on the scheduler thread, never "
    "inside graph capture; a refusal raised here stops the scheduler and SGLang kills its server"
)
_IDLE_UPSTREAM = "no upstream check exists (sglang --kv-canary checks the KV cache, not the GEMMs)"
_IDLE_REMOVE = "when SGLang re-verifies its FP4 GEMM and fused-MoE output while serving"


def idle_specs(run: Callable) -> list[PatchSpec]:
    """The scheduler loop's idle point in each release, wrapped to call `run(stream)` first (the canary)."""
    make = functools.partial(make_idle_hook, run=run)
    where = [
        ("scheduler-idle-canary", SCHEDULER, "Scheduler.on_idle", ">=0.5.13", ""),
        (
            "scheduler-idle-canary-mixin",
            SCHEDULER_CHECKER,
            "SchedulerRuntimeCheckerMixin.on_idle",
            ">=0.5.11,<0.5.13",
            " (0.5.11-0.5.12: on the runtime-checker mixin the Scheduler inherits it from)",
        ),
        (
            "scheduler-idle-canary-self-check",
            SCHEDULER_CHECKER,
            "SchedulerRuntimeCheckerMixin.self_check_during_idle",
            ">=0.5.4,<0.5.11",
            " (0.5.4-0.5.10 name it self_check_during_idle, on the runtime-checker mixin)",
        ),
        (
            "scheduler-idle-canary-legacy",
            SCHEDULER,
            "Scheduler.self_check_during_idle",
            ">=0.5.3,<0.5.4",
            " (0.5.3 names it self_check_during_idle, on the Scheduler)",
        ),
    ]
    return [
        PatchSpec(
            name=name,
            module=module,
            attribute=attribute,
            make=make,
            distribution=DISTRIBUTION,
            versions=supported(versions),
            why=_IDLE_WHY + note,
            upstream=_IDLE_UPSTREAM,
            remove_when=_IDLE_REMOVE,
        )
        for name, module, attribute, versions, note in where
    ]


def idle_spec(run: Callable, version: str | None = None) -> PatchSpec | None:
    """The idle point of SGLang `version` (default: the installed one); None where it has none."""
    version = version or sglang_version()
    return next((s for s in idle_specs(run) if version is not None and version_in(version, s.versions)), None)


ENUM_PIN = PatchSpec(
    name="fp4-runner-backend-pin",
    module=FP4_UTILS,
    attribute="FP4_GEMM_RUNNER_BACKEND",
    distribution=DISTRIBUTION,
    versions=supported(">=0.5.8"),
    why=(
        "the runner enum picks the weight layout at load time and the backend name passed to "
        "FlashInfer: AUTO reaches FlashInfer unresolved (0.5.8, and any process that never ran "
        "initialize_fp4_gemm_config), and AUTO resolves to FLASHINFER_CUDNN on SM120 in 0.5.10-0.5.12; "
        "pin only AUTO/FLASHINFER_CUDNN to FLASHINFER_CUTLASS (same 128x4 non-shuffled layout), "
        "never trtllm, marlin, cute-dsl or SGLang's own cutlass"
    ),
    upstream="sglang#20043 / PR 20047 (auto -> cudnn on SM120), flashinfer auto order changes 0.6.9+",
    remove_when="when SGLang resolves auto to a verified backend on SM12x itself",
)

LEGACY_KNOB_SPEC = PatchSpec(
    name="legacy-cutlass-env-knob",
    module=MQ,
    attribute="USE_CUTLASS_BACKEND_FOR_FP4_GEMM",
    distribution=DISTRIBUTION,
    versions=">=0.5.3,<0.5.5",
    why=f"0.5.3-0.5.4 read {LEGACY_KNOB} at import (default false in 0.5.3.x: FlashInfer's default, cuDNN, runs)",
    upstream="sglang 0.5.4 made the default true",
    remove_when="when 0.5.3.x is no longer supported",
)


# The runner enum's values this library knows (0.5.8-0.5.23): AUTO and FLASHINFER_CUDNN are pinned to
# FLASHINFER_CUTLASS, whose calls are routed and verified; TRTLLM (shuffled weights), CUTEDSL and MARLIN
# are the operator's choice of another layout or path, never changed. Any other value (a member added
# after this library, e.g. FLASHINFER_B12X) prepares a layout this library has never read: refused.
KNOWN_RUNNERS = frozenset(
    {"auto", "flashinfer_cudnn", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_cutedsl", "marlin"}
)
DENSE_FLAG = "--fp4-gemm-backend flashinfer_cutlass"


def runner_backend_problem() -> str | None:
    """Why the FP4 GEMM runner SGLang chose cannot be served verified: a runner enum member this library
    does not know (None: a known one, or no enum)."""
    module = sys.modules.get(FP4_UTILS)
    current = getattr(module, "FP4_GEMM_RUNNER_BACKEND", None)
    value = getattr(current, "value", None)
    if current is None or value in KNOWN_RUNNERS:
        return None
    try:
        flashinfer = current.get_flashinfer_backend()
    except Exception:
        flashinfer = "?"
    return (
        f"SGLang's FP4 GEMM runner backend is {current} ({value!r}, FlashInfer backend {flashinfer!r}), which this "
        "sm120_fp4 does not know: neither the weight layout SGLang prepares for it nor the kernel is verified on this "
        f"GPU. Start SGLang with {DENSE_FLAG} (routed to the backend verified here), or upgrade sm120_fp4"
    )


def unknown_backend_problem(index: int, backend: object) -> str:
    """Why a FlashInfer mm_fp4 call naming `backend` on served device `index` is not served: a backend
    name this library does not route, nor leave to SGLang on purpose."""
    return (
        f"SGLang called FlashInfer's mm_fp4 with backend={backend!r} on device {index}, a backend this sm120_fp4 "
        "does not know: neither the weight layout SGLang prepared for it nor the kernel is verified on this GPU. "
        f"Start SGLang with {DENSE_FLAG} (routed to the backend verified here), or upgrade sm120_fp4"
    )


def unverified_argument_problem(index: int, name: str, value: object) -> str:
    """Why a FlashInfer mm_fp4 call on served device `index` with argument `name`=`value` is not served: the
    backend routed there was verified for NVFP4 (block_size 16, the 128x4 scale layout) without that argument."""
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
        return  # 0.5.3-0.5.7 have no enum; or SGLang has not imported it
    enum = getattr(module, "Fp4GemmRunnerBackend", None)
    if enum is None or not all(hasattr(enum, m) for m in ("AUTO", "FLASHINFER_CUDNN", "FLASHINFER_CUTLASS")):
        patcher.note(ENUM_PIN, "skipped", "Fp4GemmRunnerBackend lacks AUTO/FLASHINFER_CUDNN/FLASHINFER_CUTLASS")
        return
    replaceable = (None, enum.AUTO, enum.FLASHINFER_CUDNN)
    patcher.pin(ENUM_PIN, module, enum.FLASHINFER_CUTLASS, lambda current: current in replaceable)


def apply_env_knobs(patcher: Patcher, environ: dict = os.environ) -> Callable[[], None]:
    """0.5.3-0.5.4: ask for cutlass through the env knob SGLang reads at import; returns the undo."""
    if not version_in(sglang_version(), LEGACY_KNOB_SPEC.versions):
        return lambda: None
    if LEGACY_KNOB in environ:
        patcher.note(LEGACY_KNOB_SPEC, "skipped", f"{LEGACY_KNOB} already set by the operator; left as is")
        return lambda: None
    environ[LEGACY_KNOB] = "1"
    state = "applied" if MQ not in sys.modules else "skipped"
    reason = None if state == "applied" else "modelopt_quant was imported before install(); the dispatch routes anyway"
    patcher.note(LEGACY_KNOB_SPEC, state, reason)
    return lambda: environ.pop(LEGACY_KNOB, None)


def ledger_rows() -> list[PatchSpec]:
    """Every runtime patch target, for the ledger and `doctor` (one source of truth)."""
    noop = lambda *args, **kwargs: None  # noqa: E731
    return (
        specs(Wiring(noop, noop, noop, noop, noop, noop, noop, noop))
        + [ENUM_PIN, LEGACY_KNOB_SPEC, MOE_RUNNER_PIN, MOE_RUNNER_PIN_LEGACY]
        + idle_specs(noop)
    )
