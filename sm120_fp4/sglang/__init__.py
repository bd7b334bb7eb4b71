"""Everything this library knows about SGLang, in one package.

* :mod:`.names`: SGLang's top-level import name (stdlib-only: the start-up hook reads it);
* :mod:`.release`: the installed release, the supported range, whether it already carries the fix;
* :mod:`.targets`: what to patch in which release (the ledger), the runner-enum pin, env knobs;
* :mod:`.wiring`: :func:`attach`, which wires one install into SGLang;
* :mod:`.simulation`: the stand-ins that let SGLang's real FP4 path run without an SM120 GPU;
* :mod:`.layers`, :mod:`.moe_layers`, :mod:`.model_check`: real layers for the demo and ``selftest --model``.

Importing this package imports nothing else (the start-up hook imports :mod:`.names` in every
interpreter with the toggle on); its functions load their module when first asked for.
"""

from __future__ import annotations

from importlib import import_module

__all__ = [
    "NAME",
    "engine_version",
    "attach",
    "idle_point_problem",
    "release_support",
    "carried_fix",
    "sglang_version",
    "unverified_release",
    "OPT_OUT",
    "OPT_OUT_SAYS",
]

NAME = "sglang"
_LAZY = {
    "engine_version": "release",
    "attach": "wiring",
    "idle_point_problem": "wiring",
    "release_support": "release",
    "carried_fix": "release",
    "sglang_version": "release",
    "unverified_release": "release",
    "OPT_OUT": "release",
    "OPT_OUT_SAYS": "release",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
