"""Everything this library knows about vLLM (the second engine home); importing it imports nothing else."""

from __future__ import annotations

from importlib import import_module

NAME = "vllm"
_LAZY = {
    **dict.fromkeys("attach idle_point_problem canary_problem".split(), "wiring"),
    **dict.fromkeys("launches release_support carried_fix engine_version unverified_release rank".split(), "release"),
    **dict.fromkeys(("OPT_OUT", "OPT_OUT_SAYS"), "release"),
    "doctor_section": "targets",
    "cpu_tp_env": "simulation",
}
__all__ = ["NAME", *_LAZY]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
