"""The engine protocol: what every engine home (``sglang/``, ``vllm/``) gives install(), status, doctor and the CLI.

The homes themselves are listed once, in :data:`sm120_fp4.api.ENGINES`; this module holds what they share: the
protocol and the one :class:`Release` type (the supported range and the guard outside it). Stdlib only."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ._version import __version__
from .versions import comparable, installed_version, version_in

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


class Release:
    """One engine's releases: its distributions, the one supported range, and what serves outside it."""

    def __init__(self, title: str, distributions: tuple[str, ...], supported: str, unchecked: str) -> None:
        self.title, self.distributions, self.supported = title, distributions, supported
        self.name = distributions[0]
        self.unchecked = unchecked  # outside the range: which of the engine's own calls serve, and what never runs

    def distribution(self) -> str:
        """Return the installed distribution that provides the engine (the first named where none is)."""
        return next((d for d in self.distributions if installed_version(d) is not None), self.distributions[0])

    def version(self) -> str | None:
        """Return the installed engine's version, or None."""
        return installed_version(self.distribution())

    def support(self, version: str | None = None) -> tuple[bool, str]:
        """Return whether `version` (default: the installed one) is a release this library can patch, and why."""
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
        version = version or self.version()
        if version is None or self.support(version)[0]:
            return None
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
        return means, remedy

    def doctor_rows(self, version: str | None, targets: list) -> dict:
        """Return what doctor shows of the release and of each patch target (PatchSpec) at `version`."""
        ok, why = self.support(version)
        if version is not None and (unverified := self.unverified(version)) is not None:
            why = "; ".join(unverified)
        rows = [(t, f"{t.module}.{t.attribute}", ok and version_in(version, t.versions)) for t in targets]
        rows = [dict(name=t.name, target=target, versions=t.versions, applies=on) for t, target, on in rows]
        return {"supported": ok, "reason": why, "targets": rows}


class Engine(Protocol):
    """An engine home. Each member loads its own modules on first use (naming the home imports nothing)."""

    name: str  # "sglang", "vllm": the --engine value, status().engines' key

    @property
    def release(self) -> Release: ...

    def attach(self, patcher, router, settings: Settings, canary) -> list[Callable[[], None]]:
        """Register this install's patches; return the undo steps that are not patches."""

    def carried_fix(self) -> str | None:
        """Return what the installed engine carries of a ``patches/`` diff, or None."""

    def idle_point_problem(self, settings: Settings) -> str | None:
        """Return why the canary asked for cannot run merely because this engine is installed (install()), or None."""

    def canary_problem(self, settings: Settings) -> str | None:
        """Return why the canary asked for cannot run in a process this engine serves (launch, its plugin), or None."""

    def doctor_rows(self) -> dict:
        """Return what ``sm120-fp4 doctor`` shows of this engine, read without importing it."""

    def launches(self, command: list[str]) -> bool:
        """Return whether `command` starts this engine's server."""

    def ranks(self) -> dict[str, Any]:
        """Return this process's place in the engine's parallelism (tp/ep/pp), as far as it is known."""
