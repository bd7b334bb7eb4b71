"""A generic patch engine: post-import hooks, version guards, idempotent apply, exact undo, a ledger.

Knows nothing about SGLang (:mod:`sm120_fp4.sglang.targets` lists what to patch as :class:`PatchSpec`). A hook never
raises into the import that triggered it: a failure leaves the target untouched and is recorded ``skipped``."""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Literal

import wrapt
from pydantic import BaseModel

from . import locks
from .imports import AfterExec, find_spec_as_imported
from .versions import comparable, installed_version, version_in

_LOG = logging.getLogger("sm120_fp4")
MISSING = object()
State = Literal["pending", "applied", "skipped", "removed", "replaced"]


@dataclass(frozen=True)
class PatchSpec:
    """Replace `module`.`attribute` (dotted) with `make(original)`, unless `check(original)` gives a reason."""

    # `distribution`/`versions` guard the patch by installed version; `why`, `upstream`, `remove_when`: the ledger.

    name: str
    module: str
    attribute: str
    why: str
    upstream: str
    remove_when: str
    make: Callable[[object], object] | None = None
    distribution: str | None = None
    versions: str | None = None
    check: Callable[[object], str | None] | None = None
    when_missing: str | None = None  # the likely cause when the target is absent


class LedgerEntry(BaseModel):
    name: str
    module: str
    attribute: str
    state: State
    reason: str | None = None
    why: str
    upstream: str
    remove_when: str
    versions: str | None = None


@dataclass
class _Record:
    spec: PatchSpec
    state: State = "pending"
    reason: str | None = None
    owner: object = None
    original: object = MISSING
    replacement: object = MISSING


def _version_reason(spec: PatchSpec) -> str | None:
    if spec.distribution is None or spec.versions is None:
        return None
    found = installed_version(spec.distribution)
    if found is None:
        return f"{spec.distribution} is not installed"
    problem = comparable(found, spec.versions)
    if problem is not None:
        return f"cannot compare {spec.distribution} {found} with {spec.versions!r}: {problem}"
    if not version_in(found, spec.versions):
        return f"not needed in {spec.distribution} {found} (applies to {spec.versions})"
    return None


def _resolve_owner(module: ModuleType, dotted: str) -> tuple[object, str]:
    *path, leaf = dotted.split(".")
    owner: object = module
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf


def _get(owner: object, leaf: str, default: object) -> object:
    return owner.__dict__.get(leaf, default) if isinstance(owner, type) else getattr(owner, leaf, default)


def _target(module: ModuleType, dotted: str) -> tuple[object, str, object]:
    """Return (owner, leaf, current object) of `dotted` in `module`; AttributeError or KeyError if absent."""
    owner, leaf = _resolve_owner(module, dotted)
    return owner, leaf, owner.__dict__[leaf] if isinstance(owner, type) else getattr(owner, leaf)


def _replace(record: _Record, owner: object, leaf: str, original: object) -> None:
    """Set `owner`.`leaf` to the spec's replacement of `original`, tagged with the patch's name."""
    replacement = record.spec.make(original)
    try:
        replacement.__sm120_fp4_patch__ = record.spec.name
    except AttributeError:
        pass  # a builtin or slotted replacement: identity still guards the undo
    setattr(owner, leaf, replacement)
    record.owner, record.original, record.replacement = owner, original, replacement


def _skip(record: _Record, reason: str, again: bool = False) -> None:
    record.state, record.reason = "skipped", reason
    _LOG.warning("sm120_fp4: not patching %s%s: %s", record.spec.name, " again" if again else "", reason)


def dry_run(spec: PatchSpec) -> tuple[str, str | None]:
    """Return whether `spec` would apply here, importing its module but patching nothing: (state, reason)."""
    reason = _version_reason(spec)
    if reason is not None:
        return "not needed", reason
    try:
        module = importlib.import_module(spec.module)
    except Exception as exc:
        return "fails", f"cannot import {spec.module}: {type(exc).__name__}: {exc}"
    try:
        original = _target(module, spec.attribute)[2]
    except (AttributeError, KeyError):
        return "fails", f"{spec.module}.{spec.attribute} not found" + (
            f": {spec.when_missing}" if spec.when_missing else ""
        )
    patched = getattr(original, "__sm120_fp4_patch__", None)
    if patched is not None:  # SM120_FP4=1 here: this process's install() has patched it already
        return "applied", f"patched by this process's install of sm120_fp4 ({patched})"
    try:
        problem = spec.check(original) if spec.check else None
    except Exception as exc:
        problem = f"check raised {type(exc).__name__}: {exc}"
    if problem is None:
        return "applies", None
    # A check may say its patch is not needed here (a stand-in for another engine mode): not a failure.
    return ("not needed" if problem.startswith("not needed") else "fails"), problem


class _ReloadWatch:
    """Has each live Patcher patch a module again after ``importlib.reload`` put its originals back."""

    def __init__(self) -> None:
        self.patchers: weakref.WeakSet[Patcher] = weakref.WeakSet()
        self._busy = threading.local()

    def watch(self, patcher: "Patcher") -> None:
        self.patchers.add(patcher)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def unwatch(self, patcher: "Patcher") -> None:
        self.patchers.discard(patcher)
        if not self.patchers and self in sys.meta_path:
            sys.meta_path.remove(self)  # nothing of ours left to patch again: off the import path

    def find_spec(self, name, path=None, target=None):
        # reload passes the module as `target` to every finder; post-import hooks would not fire again.
        if target is None or getattr(self._busy, "on", False):
            return None
        patchers = [p for p in list(self.patchers) if p.reloadable(name)]
        if not patchers:
            return None
        self._busy.on = True
        try:
            spec = find_spec_as_imported(name, path, target, skip=self)
        finally:
            self._busy.on = False
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec  # cannot run anything after it: the ledger reports the patches as replaced

        def again(module: ModuleType) -> None:
            for patcher in patchers:
                patcher.reapply(module)

        spec.loader = AfterExec(spec.loader, again)
        return spec


_reload_watch = _ReloadWatch()


class Patcher:
    """Holds the patches of one install: applied by import hooks (again after a reload), undone exactly, ledgered."""

    def __init__(self) -> None:
        self._lock = locks.rlock()
        self._records: dict[str, _Record] = {}
        self._generation = 0

    def reloadable(self, name: str) -> list[_Record]:
        """Return the patches of this Patcher in module `name` that a reload would undo."""
        with self._lock:
            return [r for r in self._records.values() if r.spec.module == name and r.state == "applied" and r.spec.make]

    def reapply(self, module: ModuleType) -> None:
        """Patch `module` again after a reload put its original objects back (never raises into it)."""
        try:
            with self._lock:
                again = [r.spec.name for r in self.reloadable(module.__name__) if self._apply(r, module, again=True)]
            if again:
                msg = "sm120_fp4: %s was reloaded, which put SGLang's originals back; patched again: %s"
                _LOG.warning(msg, module.__name__, ", ".join(again))
        except Exception as exc:
            _LOG.warning("sm120_fp4: patching %s again after its reload failed: %s", module.__name__, exc)

    def add(self, specs: list[PatchSpec]) -> None:
        """Register `specs`: each applies now if its module is imported, else when it is."""
        with self._lock:
            _reload_watch.watch(self)
            generation = self._generation
            for spec in specs:
                if spec.name in self._records and self._records[spec.name].state == "applied":
                    continue
                record = _Record(spec)
                self._records[spec.name] = record
                reason = _version_reason(spec)
                if reason is not None:
                    record.state, record.reason = "skipped", reason
                    _LOG.debug("sm120_fp4: not patching %s: %s", spec.name, reason)
                    continue
                apply = functools.partial(lambda name, module: self._apply(self._records[name], module), spec.name)
                self._on_import(spec.module, generation, apply, functools.partial(self._failed, spec.name))

    def _failed(self, name: str, exc: Exception) -> None:
        record = self._records.get(name)
        if record is not None:
            record.state, record.reason = "skipped", f"internal error: {type(exc).__name__}: {exc}"
        _LOG.warning("sm120_fp4: patch %s failed, SGLang left unpatched there: %s", name, exc)

    def _on_import(self, module: str, generation: int, fn: Callable, failed: Callable[[Exception], None]) -> None:
        def on_import(mod: ModuleType) -> None:
            # Runs inside the target's import: never let an exception escape into it.
            try:
                with self._lock:
                    if generation == self._generation:  # else remove_all came since it was registered
                        fn(mod)
            except Exception as exc:
                failed(exc)

        wrapt.register_post_import_hook(on_import, module)

    def when_imported(self, module: str, fn: Callable[[ModuleType], None]) -> None:
        """Run `fn(module)` once `module` is imported (now if it is), unless remove_all came first; never raise."""
        step = getattr(fn, "__name__", fn)
        failed = functools.partial(_LOG.warning, "sm120_fp4: step %s on import of %s failed: %s", step, module)
        self._on_import(module, self._generation, fn, failed)

    def _apply(self, record: _Record, module: ModuleType, again: bool = False) -> bool:
        """Patch `record`'s target in `module` (`again`: after a reload put the original back); return whether done."""
        spec = record.spec
        if record.state == "applied" and not again:
            return False
        after = f" after a reload of {spec.module}" if again else ""
        try:
            owner, leaf, original = _target(module, spec.attribute)
        except (AttributeError, KeyError):
            missing = f": {spec.when_missing}" if spec.when_missing else " in this release"
            _skip(record, f"{spec.module}.{spec.attribute} not found{after or missing}", again)
            return False
        if again and original is record.replacement:
            return False  # still ours (the name comes from another module)
        if not again and getattr(original, "__sm120_fp4_patch__", None) is not None:
            source = next(
                (r for r in self._records.values() if r.state == "applied" and r.replacement is original), None
            )
            if source is None:
                record.state, record.reason = "skipped", "already patched by another install of sm120_fp4"
                return False
            # This module imported the name from a module we had already patched: it holds our
            # replacement; remember the true original so uninstall restores it here too.
            record.owner, record.original, record.replacement = owner, source.original, original
            record.state, record.reason = "applied", f"imported already patched from {source.spec.module}"
            return True
        reason = spec.check(original) if spec.check else None
        if reason is not None:
            _skip(record, f"{after.strip()}: {reason}" if again else reason, again)
            return False
        _replace(record, owner, leaf, original)
        record.state, record.reason = "applied", f"patched again{after}" if again else None
        _LOG.info("sm120_fp4: patched %s.%s (%s)%s", spec.module, spec.attribute, spec.name, after)
        return True

    def remove_all(self) -> None:
        """Undo every applied patch (restoring the original objects) and disarm pending hooks."""
        with self._lock:
            _reload_watch.unwatch(self)
            self._generation += 1
            for record in reversed(list(self._records.values())):
                if record.state == "applied" and record.owner is not None and record.spec.module in sys.modules:
                    leaf = record.spec.attribute.rsplit(".", 1)[-1]
                    if _get(record.owner, leaf, None) is record.replacement:
                        setattr(record.owner, leaf, record.original)
                    else:
                        msg = "sm120_fp4: %s was replaced by someone else since we patched it; leaving it as is"
                        _LOG.warning(msg, record.spec.name)
                record.state = "removed"
            self._records.clear()

    def pin(self, spec: PatchSpec, owner: object, value: object, applies: Callable[[object], bool]) -> bool:
        """Set `owner`.`spec.attribute` to `value` when `applies(current)`; return whether it is pinned now."""
        # For values SGLang computes at run time (an enum it initialises late): called again whenever they may change.
        with self._lock:
            current = getattr(owner, spec.attribute)
            record = self._records.get(spec.name)
            if record is not None and record.state == "applied" and current is value:
                return True
            if not applies(current):
                return False
            setattr(owner, spec.attribute, value)
            if record is None or record.state != "applied":
                record = self._records[spec.name] = _Record(spec)
                record.original = current
            record.owner, record.replacement, record.state, record.reason = owner, value, "applied", None
            msg = "sm120_fp4: pinned %s.%s from %s to %s (%s)"
            _LOG.info(msg, spec.module, spec.attribute, current, value, spec.name)
            return True

    def note(self, spec: PatchSpec, state: State, reason: str | None) -> None:
        """Record a ledger entry for something not applied through this engine (e.g. an env knob)."""
        with self._lock:
            if spec.name not in self._records or self._records[spec.name].state != "applied":
                record = self._records[spec.name] = _Record(spec)
                record.state, record.reason = state, reason

    def _truth(self, record: _Record) -> tuple[State, str | None]:
        """Return a record's state as the target is now: an applied patch no longer in place is "replaced"."""
        if record.state != "applied" or record.owner is None or record.replacement is MISSING:
            return record.state, record.reason
        owner, leaf = record.owner, record.spec.attribute.rsplit(".", 1)[-1]
        if record.spec.make is not None and record.spec.module in sys.modules:
            try:  # the module object may have been replaced too (a reload without our finder)
                owner, leaf = _resolve_owner(sys.modules[record.spec.module], record.spec.attribute)
            except AttributeError:
                return "replaced", f"{record.spec.module}.{record.spec.attribute} is gone since it was patched"
        if _get(owner, leaf, MISSING) is record.replacement:
            return record.state, record.reason
        return "replaced", (
            f"{record.spec.module}.{record.spec.attribute} was replaced since it was patched (a reload that "
            "could not be patched again, or other code): SGLang calls that object, not this library's"
        )

    def ledger(self) -> list[LedgerEntry]:
        with self._lock:
            fields = [f for f in LedgerEntry.model_fields if f not in ("state", "reason")]
            return [
                LedgerEntry(**{f: getattr(r.spec, f) for f in fields}, **dict(zip(("state", "reason"), self._truth(r))))
                for r in self._records.values()
            ]
