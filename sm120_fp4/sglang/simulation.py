"""Every stand-in that lets SGLang's real FP4 linear path run without an SM120 GPU, in one place.

Inert unless ``SM120_FP4_SIMULATE`` is set. Each stand-in is recorded in the patch ledger and
undone by ``uninstall()``:

* the activation quantizer SGLang's linear path calls (FlashInfer's ``fp4_quantize``, SM100+ only,
  or sgl_kernel's ``scaled_fp4_quant``, CUDA only) -> :func:`nvfp4.quantize`. Which one is decided
  by the release's own code (the global names ``ModelOptFp4LinearMethod.apply`` loads), not by a
  version range; a stand-in that cannot take effect there is recorded as such;
* SGLang's platform facts (``override_platform``, 0.5.19+) report a Blackwell SM12x device;
* without CUDA: a CPU kernel for the CUDA-only custom op ``sglang::fp4_gemm`` (the op's own
  Python body, so the patched FlashInfer alias is still what runs), and, scoped to
  ``process_weights_after_loading`` only, ``Tensor.cuda()`` returning the tensor unchanged;
* without CUDA: an import-time stand-in for SGLang's CUDA-only kernel package ``sgl_kernel``
  when the real one cannot load (every release that brings it, 0.5.3-0.5.10.post1, may import it
  on the way to the FP4 module, e.g. ``moe_runner/deep_gemm.py``'s unguarded
  ``from sgl_kernel import silu_and_mul``; on a CPU it fails on ``libcuda.so.1``). Not tied to a
  version range: it takes effect when, and only when, an installed package fails to import. The
  real package is tried first; the stand-in's functions raise when called, so nothing can
  silently compute with it.

Everything is logged as simulated: nothing here may ever run on a real deployment.
"""

from __future__ import annotations

import contextlib
import dis
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch

from .. import locks
from ..backends.flashinfer import fp4_quantize_stand_in
from ..errors import say_once
from ..patching import Patcher, PatchSpec
from .cpu_engine import OPS as CPU_ENGINE_OPS
from .cpu_engine import cpu_engine_selected
from .release import CT, CT_CONFIG, FP4_UTILS, MQ, RUNTIME_CONTEXT, sglang_version, supported

_LOG = logging.getLogger("sm120_fp4")
_WHY = "simulation only (SM120_FP4_SIMULATE): lets SGLang's FP4 linear path run without an SM120 GPU"
_NEVER = "never used outside simulation"
_cuda_lock = locks.lock()
KERNEL_PACKAGE = "sgl_kernel"
OP_NAME = "sglang::fp4_gemm"
PLATFORM_FACTS = PatchSpec(
    "sim-platform-facts",
    RUNTIME_CONTEXT,
    "override_platform",
    f"{_WHY}; SGLang's platform facts (0.5.19+) report the simulated Blackwell SM12x device",
    "-",
    _NEVER,
)
FP4_GEMM_CPU_KERNEL = PatchSpec(
    "sim-fp4-gemm-cpu-kernel",
    MQ,
    "fp4_gemm",
    f"{_WHY}; without CUDA, SGLang's op sglang::fp4_gemm, when it has no CPU kernel (0.5.8+ register it for the GPU "
    "only, with register_custom_op), gets one: its own Python body, which calls the patched alias (0.5.5.post3-0.5.7 "
    "register it with torch.library.custom_op for every device and 0.5.3-0.5.5.post2 have no op: nothing to add)",
    "-",
    _NEVER,
    versions=supported(">=0.5.8"),
)
# The activation quantizer stand-ins. Each takes effect where the release's code calls its name:
# the global names that `caller` (a method of the module) loads, read from the imported module at
# import time, never a version range. `versions` (no `distribution`: not a guard) is where that
# code is, for the ledger; scripts/sglang_matrix.py checks it against every release's source.
QUANTIZER_CALLERS = {MQ: "ModelOptFp4LinearMethod.apply", CT: "CompressedTensorsW4A4Fp4.apply_weights"}
QUANTIZER = PatchSpec(
    "sim-activation-quantizer",
    MQ,
    "fp4_quantize",
    f"{_WHY}; ModelOptFp4LinearMethod.apply quantizes with fp4_quantize (FlashInfer's, SM100+ only; or sgl_kernel's "
    "scaled_fp4_quant under that name)",
    "-",
    _NEVER,
    make=fp4_quantize_stand_in,
    versions=supported(">=0.5.4.post2"),
)
QUANTIZER_CT = PatchSpec(
    "sim-activation-quantizer-ct",
    CT,
    "fp4_quantize",
    f"{_WHY}; CompressedTensorsW4A4Fp4.apply_weights quantizes with fp4_quantize, imported by name",
    "-",
    _NEVER,
    make=fp4_quantize_stand_in,
    versions=supported(">=0.5.7"),
)
LEGACY_QUANTIZER = PatchSpec(
    "sim-activation-quantizer-legacy",
    MQ,
    "scaled_fp4_quant",
    f"{_WHY}; ModelOptFp4LinearMethod.apply quantizes with sgl_kernel's scaled_fp4_quant, bound only with CUDA: "
    "bound (or replaced) by the oracle's quantizer, E4M3 scales in the 128x4 layout",
    "-",
    _NEVER,
    versions=">=0.5.3,<0.5.4.post2",
)
QUANTIZERS = (QUANTIZER, QUANTIZER_CT, LEGACY_QUANTIZER)
KERNEL_PACKAGE_STAND_IN = PatchSpec(
    "sim-kernel-package",
    KERNEL_PACKAGE,
    "*",
    f"{_WHY}; without CUDA, an installed {KERNEL_PACKAGE} that cannot load (the releases that bring it, "
    "0.5.3-0.5.10.post1, may import it on the way to the FP4 module) is replaced at import by a stand-in whose functions "
    "raise when called; with SGLang's CPU engine selected (SGLANG_USE_CPU_ENGINE=1) also a missing one, serving in pure "
    "PyTorch the one op a request calls (assign_req_to_token_pool_cpu)",
    "-",
    _NEVER,
)


def specs(capability: tuple[int, int] = (12, 0)) -> list[PatchSpec]:
    """Attribute stand-ins guarded by version: the compressed-tensors capability check (answered for the
    simulated `capability`) and the Blackwell check of releases older than SGLang's own override_platform
    seam. (The activation quantizers are decided by SGLang's code: QUANTIZERS.)"""
    return [
        PatchSpec(
            "sim-ct-capability-check",
            CT_CONFIG,
            "CompressedTensorsConfig._check_scheme_supported",
            f"{_WHY}; compressed-tensors asks torch.cuda.get_device_capability() directly when it picks a layer's "
            "scheme (no NVIDIA driver: the scheduler dies before any layer loads); answered from the simulated "
            "capability",
            "-",
            _NEVER,
            make=lambda original: _scheme_check_stand_in(original, capability),
            distribution="sglang",
            versions=supported(">=0.5.3"),
            check=_callable_check("_check_scheme_supported"),
        ),
        PatchSpec(
            "sim-blackwell-check",
            MQ,
            "is_blackwell_supported",
            f"{_WHY}; 0.5.13-0.5.18 check is_blackwell_supported() and have no override_platform",
            "-",
            _NEVER,
            make=lambda original: lambda *args, **kwargs: True,
            distribution="sglang",
            versions=">=0.5.13,<0.5.19",
            check=_callable_check("is_blackwell_supported"),
        ),
    ]


def ledger_rows() -> list[PatchSpec]:
    """Every simulation stand-in, attribute or not, for the ledger (patches/LEDGER.md, doctor)."""
    return (
        [QUANTIZER, QUANTIZER_CT]
        + specs()
        + [LEGACY_QUANTIZER, PLATFORM_FACTS, FP4_GEMM_CPU_KERNEL, KERNEL_PACKAGE_STAND_IN]
    )


def loaded_globals(module: Any, caller: str) -> set[str] | None:
    """The global names `caller` (``Class.method`` of `module`) loads, nested functions included;
    None when the module has no such method."""
    owner: Any = module
    for part in caller.split("."):
        owner = inspect.getattr_static(owner, part, None)
    code = getattr(inspect.unwrap(owner), "__code__", None) if callable(owner) else None
    if code is None:
        return None
    names, todo = set(), [code]
    while todo:
        code = todo.pop()
        names |= {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def quantizer_plan(module: Any) -> list[tuple[PatchSpec, str, str | None]]:
    """Which activation-quantizer stand-ins of `module` (modelopt_quant or the compressed-tensors
    scheme) take effect, by what its code calls: (spec, "applies" | "not needed" | "fails", reason).
    "fails": SGLang's linear path there calls no quantizer this simulation stands in for, so a
    simulated call would reach the real, CUDA-only one."""
    caller = QUANTIZER_CALLERS[module.__name__]
    mine = [spec for spec in QUANTIZERS if spec.module == module.__name__]
    called = loaded_globals(module, caller)
    known = sorted({spec.attribute for spec in mine})
    if called is None:
        why = f"cannot take effect: {module.__name__} has no {caller}, whose quantizer the simulation stands in for"
        return [(spec, "fails", why) for spec in mine]
    if not called & set(known):
        why = (
            f"cannot take effect: {caller} calls none of {', '.join(known)} (the quantizers this simulation stands "
            "in for): a simulated call would reach SGLang's real, CUDA-only quantizer"
        )
        return [(spec, "fails", why) for spec in mine]
    plan = []
    for spec in mine:
        if spec.attribute not in called:
            other = ", ".join(sorted(called & set(known)))
            plan.append((spec, "not needed", f"{caller} in this release calls {other}, not {spec.attribute}"))
        elif spec.make is not None and spec.attribute not in vars(module):
            plan.append(
                (
                    spec,
                    "fails",
                    f"cannot take effect: {caller} calls {spec.attribute}, but {module.__name__} "
                    "binds no such module global to replace",
                )
            )
        else:
            plan.append((spec, "applies", None))
    return plan


def quantizer_check() -> list[tuple[PatchSpec, str, str | None]]:
    """doctor: quantizer_plan() for every module of QUANTIZERS, imported here (nothing patched); a
    module this release does not have is "not needed"."""
    rows = []
    for name in QUANTIZER_CALLERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                rows += [
                    (spec, "not needed", f"this release has no {name}") for spec in QUANTIZERS if spec.module == name
                ]
                continue
            rows += [
                (spec, "fails", f"cannot import {name}: {type(exc).__name__}: {exc}")
                for spec in QUANTIZERS
                if spec.module == name
            ]
        except Exception as exc:
            rows += [
                (spec, "fails", f"cannot import {name}: {type(exc).__name__}: {exc}")
                for spec in QUANTIZERS
                if spec.module == name
            ]
        else:
            rows += quantizer_plan(module)
    return rows


def _scheme_check_stand_in(original: Callable, capability: tuple[int, int]) -> Callable:
    """CompressedTensorsConfig._check_scheme_supported, answered for the simulated capability."""

    def _check_scheme_supported(self, min_capability: int, error: bool = True) -> bool:
        current = capability[0] * 10 + capability[1]
        supported = current >= min_capability
        if error and not supported:
            raise RuntimeError(
                f"Quantization scheme is not supported for the current GPU. Min capability: "
                f"{min_capability}. Current capability: {current} (simulated)."
            )
        return supported

    _check_scheme_supported.__wrapped__ = original
    return _check_scheme_supported


def _callable_check(name: str):
    return lambda original: None if callable(original) else f"{name} is {original!r}, not callable"


class Simulation:
    """The non-attribute stand-ins of one install (platform facts, the CPU op kernel)."""

    def __init__(self, capability: tuple[int, int], patcher: Patcher) -> None:
        self.capability = capability
        self.patcher = patcher
        self._undo: list[Callable[[], None]] = []
        self._lock = locks.lock()

    def arm(self) -> None:
        """Run the non-attribute stand-ins when (or if) SGLang imports their modules."""
        self.arm_kernel_package()
        self.patcher.when_imported(RUNTIME_CONTEXT, self.on_runtime_context)
        self.patcher.when_imported(MQ, self.on_modelopt)
        self.patcher.when_imported(CT, self.activation_quantizers)

    def on_runtime_context(self, module: Any) -> None:
        """Make SGLang's platform checks see the simulated Blackwell SM12x device (0.5.19+)."""
        override = getattr(module, "override_platform", None)
        spec = PLATFORM_FACTS
        if override is None:
            self.patcher.note(spec, "skipped", "this SGLang release has no override_platform")
            return
        major, minor = self.capability
        facts = {
            "is_blackwell": major in (10, 11, 12),
            "is_sm120": major == 12,
            "is_sm100": major == 10,
            "is_sm100_or_sm110": major in (10, 11),
            "is_sm110": major == 11,
            "device_capability": (major, minor),
            "device_sm": major * 10 + minor,
        }
        known = set(getattr(module, "_PLATFORM_PROBES", {})) | set(getattr(module, "_PLATFORM_VALUES", {}))
        scope = override(**{k: v for k, v in facts.items() if not known or k in known})
        scope.install()
        with self._lock:
            self._undo.append(scope.restore)
        self.patcher.note(spec, "applied", None)
        _LOG.warning("sm120_fp4: SIMULATION: SGLang's platform facts now report sm_%d%d", major, minor)

    def on_modelopt(self, module: Any) -> None:
        self.activation_quantizers(module)
        self.fp4_gemm_cpu_kernel(module)

    def activation_quantizers(self, module: Any) -> None:
        """Stand in for the quantizer(s) `module`'s linear path calls (quantizer_plan); the others
        are in the ledger as not needed, and one that cannot take effect as such, with a warning."""
        for spec, state, reason in quantizer_plan(module):
            if state == "applies" and spec is LEGACY_QUANTIZER:
                self.legacy_quantizer(module)
            elif state == "applies":
                self.patcher.add([spec])  # the module is imported: applies now (or "imported already patched")
            else:
                self.patcher.note(spec, "skipped", reason if state == "fails" else f"not needed: {reason}")
                if state == "fails":
                    _LOG.warning("sm120_fp4: SIMULATION: %s %s (sglang %s)", spec.name, reason, sglang_version())

    def legacy_quantizer(self, module: Any) -> None:
        """``scaled_fp4_quant`` (sgl_kernel's, bound only when is_cuda()): bind (or replace) it with
        the oracle's quantizer in its convention (E4M3 scales)."""
        spec = LEGACY_QUANTIZER
        missing = object()
        original = module.__dict__.get("scaled_fp4_quant", missing)
        standin = _scaled_fp4_quant_stand_in(None if original is missing else original)
        module.scaled_fp4_quant = standin

        def undo() -> None:
            if module.__dict__.get("scaled_fp4_quant") is standin:
                if original is missing:
                    del module.scaled_fp4_quant
                else:
                    module.scaled_fp4_quant = original

        with self._lock:
            self._undo.append(undo)
        self.patcher.note(spec, "applied", None)

    def fp4_gemm_cpu_kernel(self, module: Any) -> None:
        """Without CUDA, give the op sglang::fp4_gemm a CPU kernel (its own Python body) when it has none.

        Decided by the op as SGLang registered it, not by a version: an op registered for every
        device (``torch.library.custom_op`` without device types) already runs its body on a CPU."""
        spec = FP4_GEMM_CPU_KERNEL
        if torch.cuda.is_available():
            self.patcher.note(spec, "skipped", "CUDA is available: the op's own CUDA kernel runs")
            return
        if not hasattr(torch.ops.sglang, "fp4_gemm"):
            self.patcher.note(spec, "skipped", "not needed: this release has no sglang::fp4_gemm custom op")
            return
        if _has_cpu_kernel(OP_NAME):
            self.patcher.note(
                spec,
                "skipped",
                f"not needed: SGLang registered {OP_NAME} for every device (no "
                "device-specific kernel), so its own Python body already runs on a CPU",
            )
            return
        body = _op_body(module)
        if body is None:
            reason = (
                f"cannot take effect: {OP_NAME} has no CPU kernel and {module.__name__} has no Python body for it "
                "(neither the op's function nor flashinfer_fp4_gemm): a simulated GEMM fails in the dispatcher"
            )
            self.patcher.note(spec, "skipped", reason)
            _LOG.warning("sm120_fp4: SIMULATION: %s %s (sglang %s)", spec.name, reason, sglang_version())
            return
        library = torch.library.Library("sglang", "IMPL")
        library.impl("fp4_gemm", body, "CPU")
        with self._lock:
            self._undo.append(library._destroy)
        self.patcher.note(spec, "applied", None)
        _LOG.warning("sm120_fp4: SIMULATION: registered a CPU kernel for sglang::fp4_gemm")

    def arm_kernel_package(self) -> None:
        """Without CUDA: `import sgl_kernel` loads the real package if it can, else the stand-in."""
        spec = KERNEL_PACKAGE_STAND_IN
        if torch.cuda.is_available():
            self.patcher.note(spec, "skipped", "CUDA is available: the real kernel package loads")
            return
        if KERNEL_PACKAGE in sys.modules:
            self.patcher.note(spec, "skipped", f"{KERNEL_PACKAGE} was imported before install()")
            return
        serve = CPU_ENGINE_OPS if cpu_engine_selected() else None
        remove = kernel_package_stand_in(lambda reason: self._kernel_stand_in_used(spec, reason, serve), serve)
        with self._lock:
            self._undo.append(remove)

    def _kernel_stand_in_used(self, spec: PatchSpec, reason: str, serve: dict | None) -> None:
        self.patcher.note(spec, "applied", None)
        served = f"; it serves the CPU engine's {', '.join(sorted(serve))} in pure PyTorch" if serve else ""
        _LOG.warning(
            "sm120_fp4: SIMULATION: %s cannot load here (%s); SGLang imports a stand-in whose "
            "other functions raise when called%s",
            KERNEL_PACKAGE,
            reason,
            served,
        )

    def undo(self) -> None:
        with self._lock:
            undo, self._undo = self._undo, []
        for step in reversed(undo):
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


def _has_cpu_kernel(name: str) -> bool:
    """Whether the dispatcher has a kernel for op `name` on CPU (a CompositeExplicitAutograd one included)."""
    try:
        return bool(torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CPU"))
    except (AttributeError, RuntimeError):  # a torch without that query, or no such op: register ours
        return False


def _op_body(module: Any) -> Callable | None:
    """The Python function behind sglang::fp4_gemm in `module` (several wrappers across releases)."""
    if not hasattr(torch.ops.sglang, "fp4_gemm"):
        return None
    handle = getattr(module, "fp4_gemm", None)
    seen = set()
    while handle is not None and id(handle) not in seen:
        seen.add(id(handle))
        code = getattr(handle, "__code__", None)
        if code is not None and "flashinfer_fp4_gemm" in code.co_names:
            return handle
        handle = (
            getattr(handle, "__wrapped__", None) or getattr(handle, "op_func", None) or getattr(handle, "func", None)
        )
    if hasattr(module, "flashinfer_fp4_gemm"):
        return _op_body_stand_in(module)
    return None


def _op_body_stand_in(module: Any) -> Callable:
    """0.5.8-0.5.22 keep only the op handle: the same body (w4a4), calling the module's alias."""

    def fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, out_features, quant_mode="w4a4"):
        if quant_mode != "w4a4":
            raise NotImplementedError(f"sm120_fp4 simulation: quant_mode {quant_mode!r} is not simulated")
        fp4_utils = sys.modules.get(FP4_UTILS)
        backend = fp4_utils.get_fp4_gemm_runner_backend().get_flashinfer_backend() if fp4_utils else "auto"
        return module.flashinfer_fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, backend=backend)

    return fp4_gemm


def _scaled_fp4_quant_stand_in(original: Callable | None) -> Callable:
    """sgl_kernel's ``scaled_fp4_quant(input, input_global_scale) -> (packed, E4M3 scales)``."""
    quantize = fp4_quantize_stand_in(None)

    def scaled_fp4_quant(input, input_global_scale):
        packed, scales = quantize(input, input_global_scale)
        return packed, scales.view(torch.float8_e4m3fn)

    scaled_fp4_quant.__wrapped__ = original
    return scaled_fp4_quant


@contextlib.contextmanager
def cuda_moves_stay_on_cpu(active: bool) -> Iterator[None]:
    """Scoped: ``Tensor.cuda()`` returns the tensor itself (simulation without CUDA only)."""
    if not active or torch.cuda.is_available():
        yield
        return
    with _cuda_lock:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        try:
            yield
        finally:
            torch.Tensor.cuda = original


def _is_kernel_module(name: str) -> bool:
    return name == KERNEL_PACKAGE or name.startswith(KERNEL_PACKAGE + ".")


def kernel_package_stand_in(
    used: Callable[[str], None] = lambda reason: None, serve: dict[str, Callable] | None = None
) -> Callable[[], None]:
    """Insert the import-time stand-in for an installed ``sgl_kernel`` that cannot load; returns its undo.

    Also for a test session that imports SGLang's modules on a CPU before any install() (the
    release matrix runs the SGLang test files on 0.5.3-0.5.10, whose pinned kernel package
    cannot load there). `used(reason)` is called when the stand-in replaces the real package.
    With `serve` (SGLang's CPU engine selected: :data:`sm120_fp4.sglang.cpu_engine.OPS`), the stand-in also stands in for
    a package that is not installed at all, and those names compute in pure PyTorch."""
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
    """Finds an installed ``sgl_kernel`` first: the real package when it loads, else a stand-in.

    A package that is not installed stays not installed (SGLang's guarded imports see their
    ImportError, as without this library), unless the CPU engine needs it (`serve`)."""

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
        """The real package, imported without this finder, or why it did not load."""
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
    """A module whose public attributes are `serve`'s functions and, for every other name, an
    :class:`_Unavailable` (raises when called)."""
    module = types.ModuleType(name, f"sm120_fp4 simulation stand-in for the CUDA-only {name}")
    module.__sm120_fp4_stand_in__ = True
    module.__dict__.update(serve or {})
    module.__path__ = []  # a package: `from sgl_kernel.x import y` finds the stand-in submodule
    module.__getattr__ = _Unavailable(name).__getattr__  # module attributes are names of the stand-in
    return module


class _Unavailable:
    """A name from the stand-in package: its attributes are more of the same (``scalar_types.uint4b8``
    at import), and calling it raises: nothing can compute with it."""

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
