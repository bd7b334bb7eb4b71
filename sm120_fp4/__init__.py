"""sm120_fp4: verified NVFP4 GEMM routing for SGLang and vLLM on SM120/SM121 GPUs.

``sm120_fp4.install()`` routes the FP4 GEMMs and NVFP4 fused MoE to backends verified on each GPU against
a pure-PyTorch oracle, and refuses to serve when none passes. Importing it is cheap (everything lazy).
"""

from __future__ import annotations

from importlib import import_module

from ._version import __version__
from .errors import CheckpointError, ConfigError, InvalidArgument, RefusedToServe, SelfTestError, Sm120Fp4Error

__all__ = [
    "__version__",
    "install",
    "uninstall",
    "status",
    "decide",
    "Settings",
    "Sm120Fp4Error",
    "InvalidArgument",
    "ConfigError",
    "CheckpointError",
    "RefusedToServe",
    "SelfTestError",
]

_LAZY = {
    "install": ("sm120_fp4.api", "install"),
    "uninstall": ("sm120_fp4.api", "uninstall"),
    "status": ("sm120_fp4.api", "status"),
    "decide": ("sm120_fp4.api", "decide"),
    "Settings": ("sm120_fp4.config", "Settings"),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sm120_fp4' has no attribute {name!r}")
