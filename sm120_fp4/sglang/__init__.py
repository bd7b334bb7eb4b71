"""Everything this library knows about SGLang, in one package (ARCHITECTURE.md maps its modules).

Importing it imports nothing else (the start-up hook reads :mod:`.names`); its functions load their module lazily.
"""

from __future__ import annotations

from importlib import import_module

NAME = "sglang"
_RELEASE = "engine_version release_support carried_fix sglang_version unverified_release OPT_OUT rank".split()
_LAZY = {"attach": "wiring", "idle_point_problem": "wiring", "cpu_tp_env": "simulation"}
_LAZY |= dict.fromkeys([*_RELEASE, "OPT_OUT_SAYS"], "release")
__all__ = ["NAME", *_LAZY]


def __getattr__(name: str) -> object:
    """Return `name` from the module that holds it, loaded on first use."""
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
