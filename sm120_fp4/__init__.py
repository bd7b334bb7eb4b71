"""sm120_fp4: verified NVFP4 GEMM routing for SGLang on SM120/SM121 GPUs.

``import sm120_fp4; sm120_fp4.install()`` routes SGLang's FP4 GEMMs -- the dense linear GEMM and
the NVFP4 fused MoE -- to backends verified on each GPU against the pure-PyTorch oracle (a
self-test, then every served layer through the call that serves it), and refuses to serve when
none passes. Importing this
package is cheap: torch, pydantic, FlashInfer and SGLang load only when an attribute needs them.
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
