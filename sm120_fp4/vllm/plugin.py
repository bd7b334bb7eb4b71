"""vLLM's plugin entry point: ``sm120_fp4 = sm120_fp4.vllm.plugin:register`` in the group ``vllm.general_plugins``
(pyproject.toml), which vLLM loads once in every process it starts (API server, engine core, each worker).

Inert unless the ``SM120_FP4`` toggle is on: then :func:`register` runs ``install()`` (idempotent: the user's own
``install()`` may have run). Importing this module imports nothing but the stdlib and the toggle. A failure of
``install()`` raises out of ``register()``: vLLM calls general plugins unguarded, so the process stops rather than
serve NVFP4 layers unpatched and unverified.
"""

from __future__ import annotations

from ..toggle import enabled

__all__ = ["register"]


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
