"""Installed distribution versions and version ranges: the one place that reads and compares them."""

from __future__ import annotations

import functools
import importlib.metadata

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


# Cached: each read parses METADATA (milliseconds) and guards ask thousands of times while a model loads;
# imported modules do not change with a later pip run (clear_cache: they did).
@functools.cache
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_version(*distributions: str) -> str | None:
    """Return the installed version of the first of `distributions` installed (read once per process)."""
    return next((found for found in map(_version, distributions) if found is not None), None)


def clear_cache() -> None:
    """Forget the versions read so far (a distribution installed or removed since)."""
    _version.cache_clear()


# What decides which kernel runs besides flashinfer-python: FlashInfer's prebuilt kernels (the jit-cache and its
# per-architecture packages such as flashinfer-jit-cache-sm120f; the cubins) and the CuTe DSL b12x is built with.
JIT_CACHE, CUBIN = "flashinfer-jit-cache", "flashinfer-cubin"
KERNEL_DISTRIBUTIONS = (JIT_CACHE, CUBIN, "nvidia-cutlass-dsl")


def kernel_versions() -> dict[str, str]:
    """Return the installed version of each distribution that decides which kernel runs, by canonical (PEP 503) name."""
    # Read afresh each time (not cached as installed_version is): asked once per verdict key, not per layer.
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")  # PEP 503: lower case, runs of -_. as one -
        if name.startswith(KERNEL_DISTRIBUTIONS) and name not in found:  # the first on the path is the one imported
            found[name] = dist.version
    return dict(sorted(found.items()))


def kernel_mismatches(flashinfer: str | None, kernels: dict[str, str]) -> list[str]:
    """Return each of FlashInfer's kernel packages in `kernels` whose version does not match `flashinfer`'s."""
    # FlashInfer's own rule (jit/env.py): the cubins match exactly, the jit-cache may add a CUDA local version
    # (0.7.2+cu130), and each per-architecture package matches the jit-cache exactly. A mismatched one is ignored
    # (its kernels JIT-compiled instead) or, with FLASHINFER_DISABLE_VERSION_CHECK set, runs another release's code.
    shim = kernels.get(JIT_CACHE)
    problems = []
    for name, version in kernels.items():
        if name in (CUBIN, JIT_CACHE):
            what, wanted = "flashinfer-python", flashinfer
            ok = version == flashinfer or (name == JIT_CACHE and version.startswith(f"{flashinfer}+"))
        elif name.startswith(JIT_CACHE + "-"):
            what, wanted, ok = JIT_CACHE, shim, version == shim
        else:
            continue
        if wanted is None and what == JIT_CACHE:
            problems.append(f"{name} {version} is unused: FlashInfer finds it through {JIT_CACHE}, not installed")
        elif wanted is not None and not ok:
            problems.append(
                f"{name} {version} does not match {what} {wanted}: FlashInfer ignores its kernels (JIT-compiling "
                "them instead), or runs another release's with FLASHINFER_DISABLE_VERSION_CHECK set; install the "
                f"{name} of FlashInfer {flashinfer} (`flashinfer download-kernels`), or uninstall it"
            )
    return problems


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
