"""The backend registries, one per kernel family (dense FP4 GEMM, NVFP4 fused MoE): built-ins, what ``register()``
/ ``register_moe()`` add, and the entry-point groups' backends."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .. import locks
from ..devices import Device
from ..errors import ConfigError, InvalidArgument
from . import b12x_moe as b12x
from .emulated import emulated_mm_fp4, emulated_moe
from .flashinfer import BACKENDS as FLASHINFER_BACKENDS
from .flashinfer import MOE_BACKENDS, GemmFn, mm_fp4_backend, moe_backend, moe_supported, quantizer, supported
from .flashinfer import version as flashinfer_version  # noqa: F401  (re-exported: __all__)
from .humming import adapter as humming  # light: Humming itself is imported only when asked about

__all__ = (
    "Backend Converter FLASHINFER_BACKENDS register unregister load_entry_points ENTRY_POINT_GROUPS FAMILY_LABELS "
    "get names is_supported resolve quantizer_for flashinfer_version register_moe unregister_moe moe_names "
    "get_moe is_moe_supported resolve_moe backend_of mode_of original HUMMING EMULATED GemmFn "
    "SupportFn invalidate_caches emulated_mm_fp4 emulated_moe"
).split()

SupportFn = Callable[[Device], "tuple[bool, str | None]"]

EMULATED = "emulated"
HUMMING = "humming"
# The two kernel families ("dense", "moe"): what messages call them, and their entry-point groups.
FAMILY_LABELS = {"dense": "FP4 GEMM", "moe": "NVFP4 fused-MoE"}
ENTRY_POINT_GROUPS = {"dense": "sm120_fp4.backends", "moe": "sm120_fp4.moe_backends"}


@dataclass(frozen=True)
class Backend:
    """A named kernel with its support check; `fn` is None until resolved (FlashInfer: lazily)."""

    name: str
    kind: str  # "flashinfer" | "emulated" | "humming" | "registered"
    fn: GemmFn | None
    supported: SupportFn
    mode: str = "w4a4"  # or "w4a16" (activations not quantized): the oracle mode it is verified against
    converter: Converter | None = None  # how it prepares each served layer at load (humming, b12x)
    describe: Callable[[], dict] | None = None  # what status shows of it now
    # accepts(experts, hidden, inter, activation, dtype): why it cannot serve such a layer, or None (b12x);
    # the generic self-test runs its cases on the nearest sizes it accepts.
    accepts: Callable[..., "str | None"] | None = None


@dataclass(frozen=True)
class Converter:
    """How a backend prepares each served layer at load (humming: converts it in place; b12x: its workspace)."""

    # convert(tensors, keep_original): one served layer at load, its original bytes kept while checked;
    # settle(tensors, keep): the check is over, drop them (or, `keep`: a configuration's first layer,
    # keep them for good); restore(): undo or release what it can (True: another backend can take over).
    convert: Callable[[dict, bool], None]
    settle: Callable[[dict, bool], None]
    restore: Callable[[], bool]
    in_place: bool = True  # False: it keeps its own state per layer and leaves SGLang's weights as they are


def _always(device: Device) -> tuple[bool, str | None]:
    return True, None


def _humming(family: str) -> Backend:
    """Return Humming's backend of `family`: dense W4A4 (SGLang's FP4 activations dequantized), MoE W4A16."""
    dense = family == "dense"

    def convert(tensors: dict, keep_original: bool) -> None:
        if dense:
            humming.prepare_dense(tensors["weight"], tensors["weight_sf"], tensors["dtype"], keep_original)
        else:
            humming.prepare_moe(tensors, tensors["dtype"], keep_original)

    fn, mode = (humming.mm_fp4, "w4a4") if dense else (humming.fused_moe, "w4a16")
    restore, describe = (functools.partial(f, family) for f in (humming.restore, humming.describe_backend))
    converter = Converter(convert, humming.drop_originals, restore)
    return Backend(HUMMING, "humming", fn, humming.supported, mode, converter, describe)


class _Registry:
    """Named backends of one family (dense GEMM or fused MoE) and their built-ins."""

    def __init__(self, family: str, builtins: Callable[[], dict[str, Backend]], lazy: Callable[[str], Callable]):
        self.family = FAMILY_LABELS[family]  # for messages
        self.group = ENTRY_POINT_GROUPS[family]
        self._builtins = builtins
        self._lazy = lazy  # FlashInfer's kernel of a name whose fn is None
        self._lock = locks.lock()
        self._entries = builtins()
        self._looked_up: set[str] = set()

    def load_entry_points(self, wanted) -> None:
        """Register the entry points named in `wanted` not registered yet (each looked up once per process)."""
        from importlib.metadata import entry_points

        with self._lock:
            missing = [n for n in wanted if isinstance(n, str) and n not in self._entries and n not in self._looked_up]
            self._looked_up.update(missing)
        if not missing:
            return
        found = {ep.name: ep for ep in entry_points(group=self.group) if ep.name in missing}
        for name, ep in found.items():
            where = f"entry point {name!r} ({ep.value}) of group {self.group}"
            try:
                fn = ep.load()
            except Exception as exc:
                raise ConfigError(f"{where} failed to load: {type(exc).__name__}: {exc}") from exc
            try:
                self.register(name, fn, getattr(fn, "is_supported", None), False, where)
            except InvalidArgument as exc:
                if name not in self.names():
                    raise ConfigError(str(exc)) from exc

    def register(self, name: str, fn: Callable, is_supported: SupportFn | None, replace: bool, caller: str) -> None:
        if not isinstance(name, str) or not name or name != name.strip().lower() or "," in name:
            raise InvalidArgument(f"{caller}: name={name!r} is not accepted; expected a lower-case name without commas")
        if not callable(fn):
            raise InvalidArgument(f"{caller}: fn={fn!r} is not accepted; expected a callable")
        if is_supported is not None and not callable(is_supported):
            raise InvalidArgument(
                f"{caller}: is_supported={is_supported!r} is not accepted; expected a callable or None"
            )
        with self._lock:
            if name in self._entries and not replace:
                raise InvalidArgument(f"{caller}: name={name!r} is already registered; pass replace=True to replace it")
            self._entries[name] = Backend(name, "registered", fn, is_supported or _always)

    def unregister(self, name: str) -> None:
        """Remove a registered backend; a built-in is restored to its original definition."""
        with self._lock:
            self._entries.pop(name, None)
            builtin = self._builtins().get(name)
            if builtin is not None:
                self._entries[name] = builtin

    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._entries)

    def get(self, name: str) -> Backend:
        with self._lock:
            backend = self._entries.get(name)
        if backend is None:
            self.load_entry_points([name])
            with self._lock:
                backend = self._entries.get(name)
        if backend is None:
            raise ConfigError(f"unknown {self.family} backend {name!r}; known: {', '.join(self.names())}")
        return backend

    def is_supported(self, name: str, device: Device) -> tuple[bool, str | None]:
        """Return whether backend `name` can run on `device`, and why not."""
        backend = self.get(name)
        try:
            ok, reason = backend.supported(device)
        except Exception as exc:
            return False, f"support check raised {type(exc).__name__}: {exc}"
        return bool(ok), (None if ok else reason or "not supported")

    def resolve(self, name: str) -> Callable:
        """Return the callable to run for backend `name` (FlashInfer imported here, not before)."""
        backend = self.get(name)
        return backend.fn if backend.fn is not None else self._lazy(name)


def _dense_builtins() -> dict[str, Backend]:
    out = {name: Backend(name, "flashinfer", None, functools.partial(supported, name)) for name in FLASHINFER_BACKENDS}
    out[EMULATED] = Backend(EMULATED, "emulated", emulated_mm_fp4, _always)
    out[HUMMING] = _humming("dense")
    return out


def _moe_builtins() -> dict[str, Backend]:
    out = {name: Backend(name, "flashinfer", None, functools.partial(moe_supported, name)) for name in MOE_BACKENDS}
    # FlashInfer's b12x fused MoE on SGLang's cutlass tensors (its workspace made at load, released by restore).
    converter = Converter(b12x.prepare, lambda tensors, keep: None, b12x.reset, in_place=False)
    out[b12x.NAME] = Backend(
        b12x.NAME, "flashinfer", b12x.fused_moe, b12x.supported, "w4a4", converter, b12x.describe, b12x.layer_problem
    )
    out[EMULATED] = Backend(EMULATED, "emulated", emulated_moe, _always)
    out[HUMMING] = _humming("moe")
    return out


_dense = _Registry("dense", _dense_builtins, mm_fp4_backend)
_moe = _Registry("moe", _moe_builtins, moe_backend)
# The registries' own methods, per family: names(), get(name), is_supported(name, device), unregister(name),
# resolve(name): the callable to run (FlashInfer imported then, not before).
names = _dense.names
get = _dense.get
is_supported = _dense.is_supported
unregister = _dense.unregister
resolve = _dense.resolve
moe_names = _moe.names
get_moe = _moe.get
is_moe_supported = _moe.is_supported
unregister_moe = _moe.unregister
resolve_moe = _moe.resolve
_FAMILIES = {"dense": _dense, "moe": _moe}


def register(name: str, fn: GemmFn, is_supported: SupportFn | None = None, *, replace: bool = False) -> None:
    """Add backend `name`: `fn` follows mm_fp4's convention; `is_supported(device) -> (ok, reason)`."""
    _dense.register(name, fn, is_supported, replace, "register")


def load_entry_points(wanted, family: str = "dense") -> None:
    """Register the named backends of `family`'s entry-point group not registered yet (ConfigError: one fails)."""
    _FAMILIES.get(family, _dense).load_entry_points(list(wanted))


def backend_of(family: str, name: str) -> Backend:
    """Return backend `name` of `family` ("dense" or "moe")."""
    return _FAMILIES.get(family, _dense).get(name)


def mode_of(family: str, name: str) -> str:
    """Return what backend `name` of `family` computes ("w4a4" for a name that is no backend: the original)."""
    registry = _FAMILIES.get(family, _dense)
    return registry.get(name).mode if name in registry.names() else "w4a4"


def original(t):
    """Return a weight as the checkpoint has it (humming's kept bytes where it converted it in place), for the oracle."""
    return humming.original(t)


def quantizer_for(name: str, device: Device) -> tuple[str, GemmFn] | None:
    """Return the activation quantizer serving alongside backend `name` where it can be checked on `device`."""
    return quantizer(device) if get(name).kind == "flashinfer" else None


def invalidate_caches() -> None:
    """Refresh what backends derived from weights (SGLang is about to write, or has written, them)."""
    b12x.refresh_scales()  # in place: CUDA graphs captured before the update read the same tensors


def register_moe(name: str, fn: Callable, is_supported: SupportFn | None = None, *, replace: bool = False) -> None:
    """Add NVFP4 fused-MoE backend `name`: `fn(*MoeArgs) -> out`, the convention of nvfp4.reference_moe_fp4."""
    # A -1 id is a slot not this rank's: it adds and costs nothing, whatever its weight. Calls come from
    # the serving thread and stream, and must not synchronise with the host (CUDA-graph capture).
    _moe.register(name, fn, is_supported, replace, "register_moe")
