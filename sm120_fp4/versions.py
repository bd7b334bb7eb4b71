"""Installed distribution versions and version ranges: the one place that reads and compares them."""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["installed_version", "version_in", "comparable"]


def installed_version(*distributions: str) -> str | None:
    """The installed version of the first of `distributions` that is installed, without importing it."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def comparable(version: str | None, specifier: str | None = None) -> str | None:
    """None when `version` (and `specifier`) can be read, else why not."""
    try:
        if version is not None:
            Version(version)
        if specifier is not None:
            SpecifierSet(specifier)
    except (InvalidVersion, InvalidSpecifier) as exc:
        return str(exc)
    return None


def version_in(version: str | None, specifier: str | None) -> bool:
    """Whether `version` satisfies `specifier` (no specifier: any); unreadable or absent versions never do."""
    if specifier is None:
        return True
    if version is None or comparable(version, specifier) is not None:
        return False
    return Version(version) in SpecifierSet(specifier)
