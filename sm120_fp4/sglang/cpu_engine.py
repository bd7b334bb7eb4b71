"""The import-time stand-in for SGLang's CUDA-only kernel package ``sgl_kernel`` (simulation only).

With SGLang's CPU engine selected (``SGLANG_USE_CPU_ENGINE=1``) a missing package is stood in for too, serving
in pure PyTorch the one op a request calls (:data:`OPS`); its other names raise when called.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from typing import Callable

KERNEL_PACKAGE = "sgl_kernel"
ENGINE_FLAG = "SGLANG_USE_CPU_ENGINE"  # SGLang's own switch (srt/platforms: "1" selects the CPU engine)


def cpu_engine_selected(environ=os.environ) -> bool:
    """Return whether SGLang's CPU engine is selected in this process, as SGLang itself reads it."""
    return environ.get(ENGINE_FLAG, "0") == "1"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's run of ``out_cache_loc`` into its ``req_to_token`` row, as SGLang's Triton kernel."""
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(
            f"assign_req_to_token_pool_cpu: req_to_token {tuple(req_to_token.shape)} does not have "
            f"pool_len={pool_len} columns"
        )
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        if count < 0 or end > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: slots [{start}, {end}) outside 0..{pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + count].to(req_to_token.dtype)
        offset += count
    if offset != out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {out_cache_loc.numel()} cache locations for {offset} slots")


OPS = {"assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu}


def _is_kernel_module(name: str) -> bool:
    return name == KERNEL_PACKAGE or name.startswith(KERNEL_PACKAGE + ".")


def kernel_package_stand_in(
    used: Callable[[str], None] = lambda reason: None, serve: dict[str, Callable] | None = None
) -> Callable[[], None]:
    """Insert the import-time stand-in for an installed ``sgl_kernel`` that cannot load; return its undo."""
    # `used(reason)`: it replaced the real package; with `serve` (OPS) it stands in for a missing one too.
    finder = _KernelPackageFinder(used, serve)
    sys.meta_path.insert(0, finder)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if _is_kernel_module(n)]:
            if getattr(sys.modules[name], "__sm120_fp4_stand_in__", False):
                del sys.modules[name]

    return remove


class _KernelPackageFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Find ``sgl_kernel``: the real package when it loads, else a stand-in; a missing one stays missing unless `serve`."""

    def __init__(self, used: Callable[[str], None], serve: dict[str, Callable] | None = None) -> None:
        self._used = used
        self._serve = serve or {}
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if not _is_kernel_module(fullname):
            return None
        if getattr(self._busy, "on", False):
            return None  # the real import, looked up without this finder
        if fullname != KERNEL_PACKAGE:
            stand_in = getattr(sys.modules.get(KERNEL_PACKAGE), "__sm120_fp4_stand_in__", False)
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if stand_in else None
        self._busy.on = True
        try:
            installed = importlib.util.find_spec(KERNEL_PACKAGE) is not None
        except (ImportError, ValueError):
            installed = False
        finally:
            self._busy.on = False
        if not installed and not self._serve:
            return None  # not installed: SGLang sees the ImportError it expects
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        if spec.name == KERNEL_PACKAGE:
            real = self._try_real()
            if isinstance(real, types.ModuleType):
                return real
            self._used(real)
            return _stand_in_module(spec.name, self._serve)
        return _stand_in_module(spec.name)

    def exec_module(self, module) -> None:
        pass  # the real package ran its own code in _try_real; the stand-in has none

    def _try_real(self) -> types.ModuleType | str:
        """Return the real package, imported without this finder, or why it did not load."""
        before = set(sys.modules)
        self._busy.on = True
        try:
            return importlib.import_module(KERNEL_PACKAGE)
        except Exception as exc:
            for name in set(sys.modules) - before:
                if _is_kernel_module(name):
                    del sys.modules[name]  # half-loaded submodules of the real package
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]
        finally:
            self._busy.on = False


def _stand_in_module(name: str, serve: dict[str, Callable] | None = None) -> types.ModuleType:
    """Return a module whose attributes are `serve`'s functions, and for every other name an :class:`_Unavailable`."""
    module = types.ModuleType(name, f"sm120_fp4 simulation stand-in for the CUDA-only {name}")
    module.__sm120_fp4_stand_in__ = True
    module.__dict__.update(serve or {})
    module.__path__ = []  # a package: `from sgl_kernel.x import y` finds the stand-in submodule
    module.__getattr__ = _Unavailable(name).__getattr__  # module attributes are names of the stand-in
    return module


class _Unavailable:
    """Stand in for a name of the stand-in package: its attributes are more of the same; calling it raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, attr: str) -> "_Unavailable":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._qualname}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sm120_fp4 simulation: {self._qualname} is CUDA-only and has no stand-in; the simulated FP4 path "
            "must not call it (this is a bug in the simulation, never a result)"
        )

    def __repr__(self) -> str:
        return f"<sm120_fp4 simulation stand-in {self._qualname}>"
