"""The engine protocol: what every engine home (``sglang/``, ``vllm/``) gives install(), status, doctor and the CLI.

The homes themselves are listed once, in :data:`sm120_fp4.api.ENGINES`; this module holds what they share: the
protocol (:class:`Engine`) and the one :class:`Release` type (the supported range and the guard outside it). Stdlib
only at import: the start-up hook names the SGLang home in every interpreter."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
import types
from typing import TYPE_CHECKING, Callable, Iterator

from . import locks
from .errors import say_once

if TYPE_CHECKING:
    from .config import Settings

OPT_OUT = "SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified"  # the operator's explicit opt-out (config.Settings)
OPT_OUT_SAYS = f"set {OPT_OUT} to serve NVFP4 layers unverified"


def starts(command: list[str], top: str) -> bool:
    """Return whether `command` runs the package `top`'s CLI (``top ...``) or a module of it (``python -m top...``)."""
    if command and os.path.basename(command[0]) == top:
        return True
    modules = [after for before, after in zip(command, command[1:]) if before == "-m"]
    return any(m == top or m.startswith(top + ".") for m in modules)


def tp_cpu_group(parallel_state: str) -> object:
    """Return the engine's tensor-parallel CPU (gloo) group from its module `parallel_state`, where SELECT=fastest's
    ranks share their decisions (KeyError/AssertionError where it is not up)."""
    return sys.modules[parallel_state].get_tp_group().cpu_group


def make_call_hook(original: Callable, before=None, after=None, end: Callable | None = None) -> Callable:
    """Wrap a call: `before(*args)` first, `after(*args)` once it has returned (not when it raised), `end()` always."""

    @functools.wraps(original)
    def hooked(*args, **kwargs):
        if before is not None:
            before(*args)
        try:
            result = original(*args, **kwargs)
        finally:
            if end is not None:
                end()
        if after is not None:
            after(*args)
        return result

    return hooked


class Release:
    """One engine's releases: its distributions, the one supported range, and what serves outside it."""

    def __init__(self, title: str, distributions: tuple[str, ...], supported: str, unchecked: str) -> None:
        self.title, self.distributions, self.supported = title, distributions, supported
        self.name = distributions[0]
        self.unchecked = unchecked  # outside the range: which of the engine's own calls serve, and what never runs

    def distribution(self) -> str:
        """Return the installed distribution that provides the engine (the first named where none is)."""
        from .versions import installed_version

        return next((d for d in self.distributions if installed_version(d) is not None), self.distributions[0])

    def version(self) -> str | None:
        """Return the installed engine's version, or None."""
        from .versions import installed_version

        return installed_version(self.distribution())

    def support(self, version: str | None = None) -> tuple[bool, str]:
        """Return whether `version` (default: the installed one) is a release this library can patch, and why."""
        from .versions import comparable, version_in

        version = version or self.version()
        if version is None:
            return False, f"{self.name} is not installed"
        if comparable(version) is not None:
            return False, f"{self.name} {version!r} is not a version this library can read"
        if version_in(version, self.supported):
            return True, f"{self.name} {version} is supported ({self.supported})"
        return False, f"{self.name} {version} is outside the supported range {self.supported}: left untouched"

    def unverified(self, version: str | None = None) -> tuple[str, str] | None:
        """Return (what it means, what makes it verified) for an installed release this library cannot patch."""
        from ._version import __version__
        from .versions import comparable, version_in

        version = version or self.version()
        if version is None or self.support(version)[0]:
            return None
        floor = next((bound[2:] for bound in self.supported.split(",") if bound.startswith(">=")), None)
        what = (
            f"{self.title} {version!r} is installed, a version sm120_fp4 cannot read"
            if comparable(version) is not None
            else f"{self.title} {version} is installed, outside the releases sm120_fp4 {__version__} supports "
            f"({self.supported})"
        )
        means = (
            f"{what}: sm120_fp4 patches nothing in it, so NVFP4 layers on a 12.x GPU are served UNVERIFIED "
            f"({self.unchecked})"
        )
        remedy = (
            f"upgrade sm120_fp4 to a release that supports {self.title} {version} (pip install -U sm120-fp4), or "
            f"install {self.title} in {self.supported}"
        )
        if floor is not None and version_in(version, f"<{floor}"):  # below the floor: no later sm120_fp4 serves it
            remedy = (
                f"install {self.title} in {self.supported}: sm120_fp4 {__version__} supports no release before {floor}"
            )
        return means, remedy

    def doctor_rows(self, version: str | None, targets: list) -> dict:
        """Return what doctor shows of the release and of each patch target (PatchSpec) at `version`."""
        from .versions import version_in

        ok, why = self.support(version)
        if version is not None and (unverified := self.unverified(version)) is not None:
            why = "; ".join(unverified)
        rows = [(t, f"{t.module}.{t.attribute}", ok and version_in(version, t.versions)) for t in targets]
        rows = [dict(name=t.name, target=target, versions=t.versions, applies=on) for t, target, on in rows]
        return {"supported": ok, "reason": why, "targets": rows}


class Engine:
    """An engine home (``sglang/``, ``vllm/``): what install(), status, doctor and the CLI use of it.

    A home subclasses it in its package's ``__init__``, naming the engine and its package. Every home has the same
    modules, each loaded on first use, so naming a home imports nothing: ``release`` (:data:`RELEASE`, ``rank()``),
    ``wiring`` (``attach``), ``targets`` (``doctor_rows()``) and ``simulation`` (``cpu_tp_env()``). A home overrides
    what it has of its own (a carried fix, the canary's problems)."""

    name: str  # "sglang", "vllm": the --engine value, status().engines' key
    package: str  # the home's package, whose modules serve the members below

    def module(self, name: str):
        """Return the home's module `name` (imported on first use)."""
        return importlib.import_module(f"{self.package}.{name}")

    @property
    def release(self) -> Release:
        """Return the engine's :class:`Release`."""
        return self.module("release").RELEASE

    def wiring(self):
        """Return the home's wiring module: its ``attach(patcher, router, settings, canary)``."""
        return self.module("wiring")

    def attach(self, patcher, router, settings: Settings, canary) -> list[Callable[[], None]]:
        """Register this install's patches; return the undo steps that are not patches."""
        return self.wiring().attach(patcher, router, settings, canary)

    def doctor_rows(self) -> dict:
        """Return what ``sm120-fp4 doctor`` shows of this engine, read without importing it."""
        return self.module("targets").doctor_rows()

    def carried_fix(self) -> str | None:
        """Return what the installed engine carries of a ``patches/`` diff, or None."""
        return None

    def idle_point_problem(self, settings: Settings) -> str | None:
        """Return why the canary asked for cannot run merely because this engine is installed (install()), or None."""
        return None

    def canary_problem(self, settings: Settings) -> str | None:
        """Return why the canary asked for cannot run in a process this engine serves (launch, its plugin), or None."""
        return self.idle_point_problem(settings)

    def launches(self, command: list[str]) -> bool:
        """Return whether `command` starts this engine's server."""
        return starts(command, self.name)

    def rank(self) -> dict[str, int]:
        """Return this process's ranks in the engine's parallel groups (``tp_rank``, ``tp_size``, pp, ep), or {}."""
        return self.module("release").rank()

    def cpu_tp_env(self, command: list[str]) -> dict[str, str]:
        """Return the variables the engine's CPU ranks need for `command` in simulation (an operator's own kept)."""
        return self.module("simulation").cpu_tp_env(command)


class Simulation:
    """The scoped stand-ins of one install in simulation (either engine): kept in order, undone in reverse."""

    def __init__(self, capability: tuple[int, int], patcher) -> None:
        self.capability, self.patcher = capability, patcher
        self._undo: list[Callable[[], None]] = []
        self._lock = locks.lock()

    def keep(self, step: Callable[[], None]) -> None:
        """Keep `step`, run by :meth:`undo` (uninstall())."""
        with self._lock:
            self._undo.append(step)

    def undo(self) -> None:
        """Undo every stand-in, the last first; one that fails is logged once, the others are still undone."""
        with self._lock:
            steps, self._undo = self._undo, []
        for step in reversed(steps):
            try:
                step()
            except Exception as exc:
                say_once(
                    logging.WARNING,
                    "sm120_fp4: SIMULATION: undoing %s failed (%s: %s); the other stand-ins were undone",
                    getattr(step, "__qualname__", step),
                    type(exc).__name__,
                    exc,
                )


_cuda_lock = locks.lock()


@contextlib.contextmanager
def cuda_moves_stay_on_cpu(active: bool) -> Iterator[None]:
    """Make ``Tensor.cuda()`` return the tensor itself in this scope (simulation without CUDA only: weights hooks)."""
    import torch

    if not active or torch.cuda.is_available():
        yield
        return
    with _cuda_lock:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.Tensor.cuda = original  # type: ignore[method-assign]


STAND_IN = "__sm120_fp4_stand_in__"  # set on every module a StandInFinder made


def stand_in_finder(
    roots: tuple[str, ...], used: Callable[[str, str], None], serve: dict | None = None, missing: bool = False
) -> Callable[[], None]:
    """Put a :class:`StandInFinder` for `roots` first on sys.meta_path (simulation only); return its removal."""
    finder = StandInFinder(roots, used, serve, missing)
    sys.meta_path.insert(0, finder)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for name in [
            n for n, m in list(sys.modules.items()) if getattr(m, STAND_IN, False) is True and m.__loader__ is finder
        ]:
            del sys.modules[name]

    return remove


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import an engine's CUDA-only module (one of `roots`) as it is where it loads, else as a stand-in.

    A stand-in's names are `serve`'s functions and, for every other name, an :class:`Unavailable` that raises when
    called; its submodules are stand-ins too. `used(name, why)` is told each one made. A root that is not installed
    stays missing (the ImportError the engine expects) unless `missing`.
    """

    def __init__(self, roots: tuple[str, ...], used: Callable[[str, str], None], serve=None, missing=False) -> None:
        self.roots, self.used, self.serve, self.missing = roots, used, serve or {}, missing
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if getattr(sys.modules.get(fullname.rpartition(".")[0]), STAND_IN, False) is True:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname not in self.roots or getattr(self._busy, "on", False):
            return None
        real = self._real(fullname)
        if isinstance(real, types.ModuleType):  # imported already: handed over as it is (never run twice)
            return importlib.machinery.ModuleSpec(
                fullname, self, origin=getattr(real, "__file__", None), loader_state=real
            )
        if isinstance(real, ModuleNotFoundError) and real.name == fullname and not self.missing:
            return None
        lines = [line.strip() for line in str(real).splitlines() if line.strip()]
        self.used(fullname, f"{type(real).__name__}: {lines[0] if lines else ''}"[:200])
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def _real(self, name: str) -> types.ModuleType | Exception:
        """Return the real module, imported without this finder, or why it did not load (its half-loaded parts dropped)."""
        before = set(sys.modules)
        self._busy.on = True
        try:
            return importlib.import_module(name)
        except Exception as exc:
            for half in [n for n in set(sys.modules) - before if n == name or n.startswith(name + ".")]:
                del sys.modules[half]
            return exc
        finally:
            self._busy.on = False

    def create_module(self, spec):
        if spec.loader_state is not None:
            return spec.loader_state
        module = types.ModuleType(spec.name, f"sm120_fp4 simulation stand-in for the CUDA-only {spec.name}")
        setattr(module, STAND_IN, True)
        module.__dict__.update(self.serve if spec.name in self.roots else {})
        module.__path__ = []  # a package: `from root.x import y` finds the stand-in submodule
        module.__getattr__ = Unavailable(spec.name).__getattr__  # module attributes are names of the stand-in
        return module

    def exec_module(self, module) -> None:
        pass  # the real module ran its own code in _real; a stand-in has none


class Unavailable:
    """Stand in for a name of a stand-in module: its attributes are more of the same; calling it raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, attr: str) -> "Unavailable":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._qualname}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sm120_fp4 simulation: {self._qualname} is CUDA-only and has no stand-in; the simulated path must not "
            "call it (this is a bug in the simulation, never a result)"
        )

    def __repr__(self) -> str:
        return f"<sm120_fp4 simulation stand-in {self._qualname}>"
