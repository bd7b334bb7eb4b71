"""The one activation module: every engine entry point installs the library through it.

The installed ``sm120_fp4.pth`` line calls :func:`activate` when ``SM120_FP4`` is on; that only puts a stdlib
one-shot finder on ``sys.meta_path``, and ``install()`` runs right after SGLang is imported. With the toggle on, no
failure of ours leaves a worker serving unverified: ``import sglang`` raises. SGLang's plugin entry point
(:func:`load_plugin`) and vLLM's (:func:`load_vllm_plugin`) install the same way in every process they load in."""

from __future__ import annotations

import sys
import threading

from .imports import AfterExec, find_spec_as_imported

# SGLang's top-level name, from a stdlib-only module (importing sm120_fp4.sglang loads nothing else).
from .sglang.names import TOP_LEVEL as SGLANG
from .toggle import TOGGLE_OFF, TOGGLE_ON, TOGGLE_VAR, enabled, parse_toggle  # noqa: F401 - re-exported

_activated = False


class ActivationFailed(ImportError):
    """install() failed while the toggle is on: ``import sglang`` fails rather than serve unverified."""


def _install_once() -> None:
    from . import api

    if not api.installed():
        api.install()


def _installed(module) -> None:
    """Run install() after SGLang's import; any failure stops the import (ConfigError, else ActivationFailed). The
    hook leaves sys.meta_path only once install() succeeded."""
    try:
        _install_once()
    except Exception as exc:
        from .errors import ConfigError

        if isinstance(exc, ConfigError):
            raise  # the operator asked for the library with a bad setting: stop, naming it
        raise ActivationFailed(
            f"sm120_fp4: activation failed with {TOGGLE_VAR} on ({type(exc).__name__}: {exc}); stopping rather than "
            f"letting SGLang serve unpatched and unverified. Fix the install, or turn this library off: {TOGGLE_VAR}=0"
        ) from exc
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


class _AfterSGLangImport:
    """A stdlib-only post-import hook for ``sglang`` (wrapt costs ~70 ms), on sys.meta_path until install() ran."""

    # SGLang is found as the import system finds it (editable installs too); a loader without
    # exec_module fails the import loudly. Where an earlier finder found SGLang, install() runs at
    # its first submodule's import. A failed import or install() leaves the hook for the next try.

    def __init__(self) -> None:
        self._busy = threading.local()
        self.running = 0  # SGLang's own __init__ is running through this hook: its submodules are not a bypass

    def find_spec(self, name, path=None, target=None):
        if getattr(self._busy, "on", False):
            return None
        if name != SGLANG:
            if name.startswith(SGLANG + ".") and SGLANG in sys.modules and not self.running:
                # SGLang itself was imported past this finder (one placed before it on sys.meta_path
                # found it): install() now, before the first of its modules loads.
                _installed(sys.modules[SGLANG])
            return None
        self._busy.on = True  # a finder that imports sglang while it looks: not found twice through us
        try:
            spec = find_spec_as_imported(name, path, target, skip=self)
        finally:
            self._busy.on = False
        if spec is None:
            return None  # SGLang is not installed: the ImportError the caller expects
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            raise ActivationFailed(
                f"sm120_fp4: {TOGGLE_VAR} is on, but {SGLANG} was found by {type(loader).__name__ if loader else 'no loader'} "
                f"({spec.origin or spec.submodule_search_locations}), which cannot run a module after which install() could "
                f"run: stopping rather than letting SGLang serve unpatched and unverified; install SGLang normally (pip install), "
                f"or turn this library off: {TOGGLE_VAR}=0"
            )
        spec.loader = _HookedLoader(loader, _installed)
        return spec


class _HookedLoader(AfterExec):
    def exec_module(self, module) -> None:
        _finder.running += 1
        try:
            super().exec_module(module)
        finally:
            _finder.running -= 1


_finder = _AfterSGLangImport()


def activate() -> None:
    """Arrange for install() when SGLang is imported (idempotent; raises only if already imported and it fails)."""
    global _activated
    if _activated:
        return
    _activated = True
    if SGLANG in sys.modules:
        _installed(sys.modules[SGLANG])
    else:
        sys.meta_path.insert(0, _finder)


def _load(name: str) -> None:
    """Install when the toggle is on, in a process the engine `name` serves; refuse a canary it cannot run there."""
    if not enabled():
        return
    _install_once()
    from .api import engine
    from .config import load_settings
    from .errors import ConfigError

    problem = engine(name).canary_problem(load_settings())
    if problem is not None:  # asked for, and it cannot run where this engine serves: refused, never silently off
        raise ConfigError(f"invalid sm120_fp4 settings:\n  {problem}")


def load_plugin() -> None:
    """SGLang's plugin entry point (its plugin group, named in pyproject.toml; 0.5.11+ loads it in every scheduler)."""
    _load("sglang")


def load_vllm_plugin() -> None:
    """vLLM's plugin entry point (group ``vllm.general_plugins``), loaded in every vLLM process."""
    _load("vllm")
