"""Start-up activation for every new interpreter (spawned SGLang schedulers included).

The ``sm120_fp4.pth`` file installed into site-packages runs one line at interpreter start-up:
when ``SM120_FP4`` is set (to anything but ``0``/``off``) it calls :func:`activate`, once per
interpreter, otherwise it does nothing (no import
of this package, of torch or of pydantic). :func:`activate` only puts a one-shot finder on
``sys.meta_path`` (stdlib only); ``install()`` runs right after SGLang is imported, so plain
Python processes pay almost nothing. Nothing here raises at interpreter start-up. With the toggle on,
no failure of ours may leave a worker serving unpatched and unverified: an invalid setting or any
failure of ``install()`` makes ``import sglang`` raise (the worker stops, the last line of its
traceback says why), and a package that cannot even be imported makes the ``.pth`` line put a
stdlib finder on ``sys.meta_path`` that fails ``import sglang`` with a clear ImportError.
"""

from __future__ import annotations

import sys
import threading

from .imports import AfterExec, find_spec_as_imported

# SGLang's top-level package, the one name the start-up hook waits for (sm120_fp4.sglang.names:
# stdlib-only, and importing sm120_fp4.sglang itself loads nothing else).
from .sglang.names import TOP_LEVEL as SGLANG
from .toggle import TOGGLE_OFF, TOGGLE_ON, TOGGLE_VAR, enabled, parse_toggle  # noqa: F401 - re-exported

_activated = False


class ActivationFailed(ImportError):
    """install() failed while the toggle is on: ``import sglang`` fails rather than serve unverified."""


def _stop_message(exc: BaseException) -> str:
    return (
        f"sm120_fp4: activation failed with {TOGGLE_VAR} on ({type(exc).__name__}: {exc}); stopping rather than "
        f"letting SGLang serve unpatched and unverified. Fix the install, or turn this library off: {TOGGLE_VAR}=0"
    )


def _on_sglang(module) -> None:
    """install() after SGLang's import. Only reached with the toggle on (the .pth line, or
    activate()): any failure stops the import -- a bad setting as the ConfigError naming it,
    anything else as one ActivationFailed line."""
    try:
        from . import api

        if not api.installed():
            api.install()
    except Exception as exc:
        from .errors import ConfigError

        if isinstance(exc, ConfigError):
            raise  # the operator asked for the library with a bad setting: stop, naming it
        raise ActivationFailed(_stop_message(exc)) from exc


class _AfterSGLangImport:
    """A stdlib-only post-import hook for ``sglang`` (wrapt costs ~70 ms to import), on
    sys.meta_path until install() has run after SGLang's import.

    SGLang is looked up as the import system looks it up (every finder after this one), so an
    editable install is hooked too; a spec found whose loader cannot run a module (no exec_module)
    makes the import fail loudly rather than let SGLang run without install(). Where a finder put
    before this one found SGLang, install() runs at the import of SGLang's first submodule. An
    import of SGLang that fails (or an install() that fails) leaves the hook in place: the next
    attempt is hooked too."""

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


def _installed(module) -> None:
    """install() after SGLang's import; the hook leaves sys.meta_path only once that succeeded."""
    _on_sglang(module)
    _remove_finder()


_finder = _AfterSGLangImport()


def _remove_finder() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def activate() -> None:
    """Arrange for install() when SGLang is imported (idempotent). Raises only where SGLang is
    already imported and install() fails (then nothing may serve unverified); at interpreter
    start-up (SGLang not imported yet) it only inserts the finder."""
    global _activated
    if _activated:
        return
    _activated = True
    if SGLANG in sys.modules:
        _on_sglang(sys.modules[SGLANG])
    else:
        sys.meta_path.insert(0, _finder)


def load_plugin() -> None:
    """SGLang's plugin entry point (this package's entry point in SGLang's plugin group,
    sm120_fp4.sglang.release.PLUGIN_GROUP), which SGLang 0.5.11+ loads in every scheduler process: install the patches there when the SM120_FP4 toggle is on (the .pth
    line's job on earlier releases). Idempotent: the .pth hook or the user's install() may have run."""
    if enabled():
        from . import api

        if not api.installed():
            api.install()
