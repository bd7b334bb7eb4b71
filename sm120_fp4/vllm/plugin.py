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
    from .wiring import refuse_canary

    refuse_canary(load_settings())  # vLLM serves in this process: the canary asked for cannot run here
