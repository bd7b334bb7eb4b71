"""sm120_fp4: verified NVFP4 GEMM routing for SGLang and vLLM on SM120/SM121 GPUs.

``sm120_fp4.install()`` routes the FP4 GEMMs and NVFP4 fused MoE to backends verified on each GPU against
a pure-PyTorch oracle, and refuses to serve when none passes. Importing it is cheap (everything lazy).
"""

from __future__ import annotations

from importlib import import_module

from ._version import __version__
from .errors import CheckpointError, ConfigError, InvalidArgument, RefusedToServe, SelfTestError, Sm120Fp4Error

__all__ = ["__version__", "install", "uninstall", "status", "decide", "Settings"]
__all__ += ["Sm120Fp4Error", "InvalidArgument", "ConfigError", "CheckpointError", "RefusedToServe", "SelfTestError"]

_LAZY = dict.fromkeys(("install", "uninstall", "status", "decide"), "sm120_fp4.api") | {"Settings": "sm120_fp4.config"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sm120_fp4' has no attribute {name!r}")
