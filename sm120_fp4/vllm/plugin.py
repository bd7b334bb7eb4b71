"""vLLM's plugin entry point (``vllm.general_plugins``), loaded in every vLLM process; stdlib only here."""

from __future__ import annotations

from ..toggle import enabled


def register() -> None:
    """Install the library in this vLLM process when the SM120_FP4 toggle is on; nothing otherwise."""
    if not enabled():
        return
    from .. import api

    if not api.installed():
        api.install()
    from ..config import load_settings
    from ..errors import ConfigError
    from .wiring import canary_problem

    problem = canary_problem(load_settings())
    if problem is not None:  # vLLM serves in this process: the canary asked for cannot run here
        raise ConfigError(f"invalid sm120_fp4 settings:\n  {problem}")
