"""The engines ``selftest`` and ``launch`` verify for: each reached through ``api.ENGINES`` by name, a
release this library cannot patch refused under SELFTEST=strict or said to be unverified."""

from __future__ import annotations

import sys

from .common import EXIT_UNVERIFIED, EXIT_USAGE, _eprint

ENGINE_NAMES = ("sglang", "vllm")  # the NAMEs of api.ENGINES, listed here so that parsing imports no engine home


def _engine_home(name: str):
    """Return the engine home of api.ENGINES named `name`."""
    from ..api import ENGINES

    return next(home for home in ENGINES if home.NAME == name)


def _refuse_engine(command: str, settings, engine: tuple[str, str]) -> int | None:
    """Refuse to start under SELFTEST=strict unless opted out (exit 2, saying how to proceed); None: not refused."""
    if settings.selftest != "strict" or settings.unsupported_release != "refuse":
        return None
    from ..sglang import OPT_OUT_SAYS

    means, remedy = engine
    _eprint(f"sm120-fp4 {command}: refusing to start: {means}.\nTo proceed: {remedy}; or {OPT_OUT_SAYS}.")
    return EXIT_USAGE


def _say_unverified_engine(engine: tuple[str, str], what: str) -> int:
    """Say that the engine release is outside the supported range; return exit 3 (unverified)."""
    means, remedy = engine
    _eprint(f"sm120-fp4 selftest: {means}; {what}: exit {EXIT_UNVERIFIED}.\nTo verify them: {remedy}.")
    return EXIT_UNVERIFIED


def _model_engine_problem(name: str, settings) -> int | None:
    """The exit code when the engine `name` cannot build the checkpoint's layers verified here (None: it can)."""
    if _engine_home(name).engine_version() is None:
        _eprint(f"sm120-fp4 selftest: --engine {name}: {name} is not installed for {sys.executable}; run it there")
        return EXIT_USAGE
    engine = _engine_home(name).unverified_release()  # (what it means, what makes it verified), or None
    if engine is not None:  # the checkpoint's layers are built through the engine's: nothing of it is patched
        return _refuse_engine("selftest", settings, engine) or _say_unverified_engine(engine, "nothing was verified")
    return None
