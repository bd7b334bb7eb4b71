"""Which SGLang is installed, whether this library knows it, and whether it already carries the fix.

Read without importing SGLang: the distribution's metadata and the text of ``modelopt_quant.py``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from ..engines import Release
from ..versions import capped

DISTRIBUTION = "sglang"
# The one upper bound: raising the supported range is this line (and scripts/sglang_matrix.py's pins).
SUPPORTED = ">=0.5.8,<0.5.24"
MQ = "sglang.srt.layers.quantization.modelopt_quant"
FP4_UTILS = "sglang.srt.layers.quantization.fp4_utils"
CT = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4"
RUNTIME_CONTEXT = "sglang.srt.runtime_context"
SERVER_ARGS = "sglang.srt.server_args"  # get_global_server_args(): the scheduler's ServerArgs up to 0.5.22
ARG_OVERRIDES = "sglang.srt.arg_groups.overrides"  # resolution_result(): 0.5.23's resolved settings
WEIGHT_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
LAUNCH_SERVER = "sglang.launch_server"  # `python -m` it: SGLang's HTTP server
MOE_RUNNER_FC = "sglang.srt.layers.moe.moe_runner.flashinfer_cutlass"
CT_MOE = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4_moe"
CT_CONFIG = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors"
KERNEL_OPS_GEMM = "sglang.kernels.ops.gemm"  # 0.5.20+: SGLang's own kernels, try_qwen3x_nvfp4_gemm among them
AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"  # 0.5.15+: should_run_flashinfer_autotune
BASE_RUNNER = "sglang.srt.model_executor.runner.base_runner"  # imports that gate by name (its warm-up calls it)
MOE_UTILS = "sglang.srt.layers.moe.utils"  # the MoE runner backend: initialize_moe_config, get_moe_runner_backend
SCHEDULER = "sglang.srt.managers.scheduler"  # the scheduler loop (its idle point: the serving canary)
SCHEDULER_CHECKER = "sglang.srt.managers.scheduler_runtime_checker_mixin"  # up to 0.5.12: the idle point's home
PLUGIN_GROUP = "sglang.srt.plugins"  # the entry-point group SGLang's plugin loader reads
MQ_FILE = "sglang/srt/layers/quantization/modelopt_quant.py"
FP4_UTILS_FILE = "sglang/srt/layers/quantization/fp4_utils.py"
MARKER = re.compile(r"#\s*sm120-fp4:\s*(sglang-(\S+?)-sm120-fp4)\b")


def supported(versions: str) -> str:
    """Return a patch target's version range (where it starts, and ends if it disappears) capped by SUPPORTED."""
    return capped(versions, SUPPORTED)


def platform_facts(runtime_context: object, capability: tuple[int, int]) -> dict:
    """Return SGLang's platform facts for a device of `capability`, those this release's runtime context knows."""
    major, minor = capability
    facts = dict(is_blackwell=major in (10, 11, 12), is_sm120=major == 12, is_sm100=major == 10)
    facts |= dict(is_sm100_or_sm110=major in (10, 11), is_sm110=major == 11, device_capability=(major, minor))
    facts["device_sm"] = major * 10 + minor
    known = {*getattr(runtime_context, "_PLATFORM_PROBES", {}), *getattr(runtime_context, "_PLATFORM_VALUES", {})}
    return {k: v for k, v in facts.items() if not known or k in known}


RELEASE = Release(
    "SGLang",
    (DISTRIBUTION,),
    SUPPORTED,
    "SGLang's own FP4 GEMM and fused-MoE calls; no self-test, layer check, re-check or canary of sm120_fp4 runs there",
)


def sglang_version() -> str | None:
    """Return the installed SGLang's version, or None."""
    return RELEASE.version()


def installed_root() -> Path | None:
    """Return the site-packages directory of the importable sglang, found without importing it."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def fix_marker(root: Path) -> re.Match | None:
    """Return the marker of a ``patches/`` diff in `root`'s modelopt_quant.py (every line it adds has one), or None."""
    mq = root / MQ_FILE
    try:
        return MARKER.search(mq.read_text(errors="replace")) if mq.is_file() else None
    except OSError:
        return None


def carried_fix() -> str | None:
    """Return what the installed SGLang carries of a ``patches/`` diff (None: none, or no SGLang)."""
    # A diff fixes the dense routing and checks it once at start-up: install() still patches such a tree.
    root = installed_root()
    marker = fix_marker(root) if root is not None else None
    if marker is None:
        return None
    return (
        f"the installed SGLang at {root / 'sglang'} carries the patches/ diff {marker.group(1)} (the dense GEMM's "
        "routing and one start-up check); every runtime check stays on: layer checks, MoE, the re-check and the canary"
    )


PARALLEL_STATE = "sglang.srt.distributed.parallel_state"


def rank() -> dict[str, int]:
    """Return this process's ranks in SGLang's parallel groups (``tp_rank``, ``tp_size``, pp, ep), or {} before any."""
    from ..devices import parallel_rank

    return parallel_rank(PARALLEL_STATE, {"tp": "get_tp_group", "pp": "get_pp_group", "ep": "get_moe_ep_group"})
