"""Installed distribution versions and version ranges: the one place that reads and compares them."""

from __future__ import annotations

import importlib.metadata
import threading

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

# name -> version (None: not installed), as read by the lookup _read_with: each read parses METADATA
# (milliseconds) and guards ask thousands of times while a model loads; imported modules do not change
# with a later pip run. A different lookup function (a test's) starts afresh.
_read: dict[str, str | None] = {}
_read_with = None
_read_lock = threading.Lock()


def installed_version(*distributions: str) -> str | None:
    """Return the installed version of the first of `distributions` installed (read once per process)."""
    global _read_with
    lookup = importlib.metadata.version
    with _read_lock:
        if _read_with is not lookup:
            _read.clear()
            _read_with = lookup
    for name in distributions:
        if name in _read:
            found = _read[name]
        else:
            try:
                found = lookup(name)
            except importlib.metadata.PackageNotFoundError:
                found = None
            with _read_lock:
                if _read_with is lookup:  # not a lookup replaced meanwhile
                    _read[name] = found
        if found is not None:
            return found
    return None


def clear_cache() -> None:
    """Forget the versions read so far (a distribution installed or removed since)."""
    with _read_lock:
        _read.clear()


def comparable(version: str | None, specifier: str | None = None) -> str | None:
    """Return None when `version` (and `specifier`) can be read, else why not."""
    try:
        if version is not None:
            Version(version)
        if specifier is not None:
            SpecifierSet(specifier)
    except (InvalidVersion, InvalidSpecifier) as exc:
        return str(exc)
    return None


def version_in(version: str | None, specifier: str | None) -> bool:
    """Return whether `version` satisfies `specifier` (None: any); unreadable or absent versions never do."""
    if specifier is None:
        return True
    if version is None or comparable(version, specifier) is not None:
        return False
    return Version(version) in SpecifierSet(specifier)


def capped(versions: str, cap: str) -> str:
    """Return `versions` bounded above by `cap`'s upper bounds, unless it has an upper bound of its own."""
    own = SpecifierSet(versions)
    if any(s.operator in ("<", "<=") for s in own):
        return versions
    return ",".join([versions, *sorted(str(s) for s in SpecifierSet(cap) if s.operator in ("<", "<="))])
