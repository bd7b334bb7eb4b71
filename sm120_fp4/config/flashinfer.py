"""FlashInfer's own NVFP4 environment knobs: set, they make FlashInfer's FP4 results unverifiable."""

from __future__ import annotations

import os

from ..errors import ConfigError, describe
from ..toggle import TOGGLE_VAR

# FlashInfer's fp4_quantize and cutlass_fused_moe read FLASHINFER_NVFP4_* knobs (4over6 block scales, scales
# clamped at 256) when called as SGLang calls them; the oracle models the standard recipe only, so any such
# name (a future one too) makes results unverifiable. The quantizer's launch knobs change how the same recipe
# runs, not the recipe, and every check runs with them set.
FLASHINFER_PREFIX = "FLASHINFER_NVFP4_"
FLASHINFER_LAUNCH_KNOBS = frozenset({"FLASHINFER_NVFP4_PER_TOKEN_THREADS", "FLASHINFER_NVFP4_QUANTIZE_USE_TMA"})
# The 4over6 switch is on only when exactly "1": FlashInfer reads it so in Python (`os.environ.get(name) == "1"`,
# quantization/nvfp4_quantization_utils.py) and in C++ (getBoolEnv: "1" and nothing after it, envUtils.cpp), so
# any other value -- "0", "", "false" -- leaves the standard recipe, the one the oracle models.
FOUR_OVER_SIX = "FLASHINFER_NVFP4_4OVER6"
FOUR_OVER_SIX_ON = "1"


def flashinfer_overrides() -> dict[str, str]:
    """Return every FLASHINFER_NVFP4_* variable set that may change FlashInfer's FP4 recipe, by name."""
    return {
        k: os.environ[k]
        for k in sorted(os.environ)
        if k.upper().startswith(FLASHINFER_PREFIX)
        and k.upper() not in FLASHINFER_LAUNCH_KNOBS
        and not (k == FOUR_OVER_SIX and os.environ[k] != FOUR_OVER_SIX_ON)
    }


def flashinfer_problem() -> str | None:
    """Return why FlashInfer's FP4 results cannot be verified in this environment, or None."""
    found = flashinfer_overrides()
    if not found:
        return None
    listed = ", ".join(f"{k}={describe(v, 60)}" for k, v in found.items())
    return (
        f"{listed} set: this changes FlashInfer's FP4 quantization recipe (fp4_quantize, the activation quantizer "
        f"SGLang calls, and cutlass_fused_moe read the {FLASHINFER_PREFIX}* variables: 4over6 block scales, block "
        "scales clamped at 256), which this library's oracle does not model, so no NVFP4 result could be verified; "
        f"unset {', '.join(found)} (or turn this library off: {TOGGLE_VAR}=0)"
    )


def check_flashinfer_env() -> None:
    """Raise ConfigError where FlashInfer's own NVFP4 knobs are set."""
    problem = flashinfer_problem()
    if problem is not None:
        raise ConfigError(f"sm120_fp4 cannot verify FlashInfer's FP4 results here: {problem}")
