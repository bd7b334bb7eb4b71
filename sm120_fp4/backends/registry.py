"""The registries of backends, one per kernel family (dense FP4 GEMM, NVFP4 fused MoE), and their
built-ins: FlashInfer's (:mod:`.flashinfer`), ``emulated`` (:mod:`.emulated`), ``humming``; what
``register()`` / ``register_moe()`` and the entry-point groups add.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .. import locks
from ..devices import Device
from ..errors import ConfigError, InvalidArgument
from .emulated import emulated_cached_mm_fp4, emulated_mm_fp4, emulated_moe
from .flashinfer import (
    BACKENDS as FLASHINFER_BACKENDS,
)
from .flashinfer import (
    MOE_BACKENDS as _MOE_BACKENDS,
)
from .flashinfer import (
    mm_fp4_backend,
    moe_backend,
)
from .flashinfer import (
    moe_supported as _moe_supported,
)
from .flashinfer import (
    quantizer as _quantizer,
)
from .flashinfer import (
    supported as _supported,
)
from .flashinfer import (
    version as flashinfer_version,
)

__all__ = [
    "Backend",
    "Converter",
    "FLASHINFER_BACKENDS",
    "register",
    "unregister",
    "load_entry_points",
    "ENTRY_POINT_GROUPS",
    "FAMILY_LABELS",
    "get",
    "names",
    "is_supported",
    "resolve",
    "quantizer_for",
    "flashinfer_version",
    "register_moe",
    "unregister_moe",
    "moe_names",
    "get_moe",
    "is_moe_supported",
    "resolve_moe",
    "backend_of",
    "mode_of",
    "original",
    "HUMMING",
    "EMULATED",
    "EMULATED_CACHED",
    "GemmFn",
    "SupportFn",
]


GemmFn = Callable[..., object]
SupportFn = Callable[[Device], "tuple[bool, str | None]"]

EMULATED = "emulated"
EMULATED_CACHED = "emulated-cached"


@dataclass(frozen=True)
class Backend:
    """A named GEMM with its support check; `fn` is None until resolved (FlashInfer: lazily)."""

    name: str
    kind: str  # "flashinfer" | "emulated" | "humming" | "registered"
    fn: GemmFn | None
    supported: SupportFn
    # What it computes: "w4a4" (activations quantized to FP4, as the checkpoint says) or "w4a16"
    # (activations not quantized); a backend is verified against the oracle mode that matches.
    mode: str = "w4a4"
    # A backend that serves a converted copy of each layer's weights (humming) says how: None for the others.
    converter: Converter | None = None
    # What status shows of the backend now (humming: JIT times, converted layers' memory; b12x: its
    # workspaces' bytes); None for backends that say nothing.
    describe: Callable[[], dict] | None = None
    # A backend with limits on the layers it serves (b12x: bf16, I % 128): `accepts(experts, hidden,
    # inter, activation, dtype)` says why it cannot serve such a layer (None: it can); the generic
    # self-test runs its cases on the nearest sizes it accepts.
    accepts: Callable[..., "str | None"] | None = None


@dataclass(frozen=True)
class Converter:
    """How a backend that serves a converted copy of each layer's weights (humming) handles them.

    `convert(tensors, keep_original)` converts one served layer at load (keeping its original bytes
    while it is checked: the oracle reads them); `settle(tensors, keep)` ends one layer's check: drops
    what `convert` kept of it, or with `keep` (each configuration's first layer, the one the
    re-checks compare) keeps it for good its long-term way (humming: pinned host memory);
    `restore()` undoes every conversion it can (True: all undone, another backend can take over)."""

    convert: Callable[[dict, bool], None]
    settle: Callable[[dict, bool], None]
    restore: Callable[[], bool]


def _always(device: Device) -> tuple[bool, str | None]:
    return True, None


HUMMING = "humming"


def _humming_dense() -> Backend:
    """Humming's bf16/fp16-activation kernel on SGLang's FP4 activations, dequantized exactly (W4A4)."""
    from .humming import adapter as humming  # light: Humming itself is imported only when it is asked about

    return Backend(
        HUMMING,
        "humming",
        humming.mm_fp4,
        humming.supported,
        "w4a4",
        _humming_converter("dense"),
        describe=lambda: humming.describe_backend("dense"),
    )


def _humming_moe() -> Backend:
    """Humming's grouped kernel on unquantized activations (W4A16)."""
    from .humming import adapter as humming

    return Backend(
        HUMMING,
        "humming",
        humming.fused_moe,
        humming.moe_supported,
        "w4a16",
        _humming_converter("moe"),
        describe=lambda: humming.describe_backend("moe"),
    )


def _humming_converter(family: str) -> Converter:
    """Humming converts each served layer in place at load (its own layout, written into SGLang's storage)."""
    from .humming import adapter as humming

    def convert(tensors: dict, keep_original: bool) -> None:
        if family == "dense":
            humming.prepare_dense(tensors["weight"], tensors["weight_sf"], tensors["dtype"], keep_original)
        else:
            humming.prepare_moe(tensors, tensors["dtype"], keep_original)

    return Converter(convert, humming.drop_originals, lambda: humming.restore(family))


# The two kernel families, by the one identifier used everywhere ("dense", "moe"): what messages call
# them, and the entry-point group each family's backends are found in.
FAMILY_LABELS = {"dense": "FP4 GEMM", "moe": "NVFP4 fused-MoE"}
ENTRY_POINT_GROUPS = {"dense": "sm120_fp4.backends", "moe": "sm120_fp4.moe_backends"}


class _Registry:
    """Named backends of one family (dense GEMM or fused MoE) and their built-ins."""

    def __init__(self, family: str, builtins: Callable[[], dict[str, Backend]]) -> None:
        self.family = FAMILY_LABELS[family]  # for messages
        self.group = ENTRY_POINT_GROUPS[family]
        self._builtins = builtins
        self._lock = locks.lock()
        self._entries = builtins()
        self._looked_up: set[str] = set()

    def load_entry_points(self, wanted) -> None:
        """Register the entry points of this family's group named in `wanted` that no one has
        registered yet (each name looked up once per process); a broken one is a ConfigError."""
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
        backend = self.get(name)
        try:
            ok, reason = backend.supported(device)
        except Exception as exc:
            return False, f"support check raised {type(exc).__name__}: {exc}"
        return bool(ok), (None if ok else reason or "not supported")


def _dense_builtins() -> dict[str, Backend]:
    out = {name: Backend(name, "flashinfer", None, functools.partial(_supported, name)) for name in FLASHINFER_BACKENDS}
    out[EMULATED] = Backend(EMULATED, "emulated", emulated_mm_fp4, _always)
    out[EMULATED_CACHED] = Backend(EMULATED_CACHED, "emulated", emulated_cached_mm_fp4, _always)
    out[HUMMING] = _humming_dense()
    return out


def _b12x_moe() -> Backend:
    """FlashInfer's b12x fused MoE (B12xMoEWrapper) on SGLang's cutlass tensors, its scales derived here."""
    from .b12x_moe import NAME, describe, fused_moe, layer_problem, supported

    return Backend(NAME, "flashinfer", fused_moe, supported, "w4a4", describe=describe, accepts=layer_problem)


def _moe_builtins() -> dict[str, Backend]:
    out = {name: Backend(name, "flashinfer", None, functools.partial(_moe_supported, name)) for name in _MOE_BACKENDS}
    out["b12x"] = _b12x_moe()
    out[EMULATED] = Backend(EMULATED, "emulated", emulated_moe, _always)
    out[HUMMING] = _humming_moe()
    return out


_dense = _Registry("dense", _dense_builtins)
_moe = _Registry("moe", _moe_builtins)


def register(name: str, fn: GemmFn, is_supported: SupportFn | None = None, *, replace: bool = False) -> None:
    """Add backend `name`: `fn` follows mm_fp4's convention; `is_supported(device) -> (ok, reason)`."""
    _dense.register(name, fn, is_supported, replace, "register")


def unregister(name: str) -> None:
    """Remove a registered backend; built-ins are restored to their original definition."""
    _dense.unregister(name)


def names() -> tuple[str, ...]:
    return _dense.names()


def load_entry_points(wanted, family: str = "dense") -> None:
    """Register the named backends of entry-point group sm120_fp4.backends (family "moe":
    sm120_fp4.moe_backends) that are not registered yet; ConfigError when one fails to load."""
    (_moe if family == "moe" else _dense).load_entry_points(list(wanted))


def get(name: str) -> Backend:
    return _dense.get(name)


def is_supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Whether backend `name` can run on `device`, and why not."""
    return _dense.is_supported(name, device)


def resolve(name: str) -> GemmFn:
    """The callable to run for backend `name` (FlashInfer imported here, not before)."""
    backend = get(name)
    return backend.fn if backend.fn is not None else mm_fp4_backend(name)


def backend_of(family: str, name: str) -> Backend:
    """Backend `name` of `family` ("dense" or "moe")."""
    return get_moe(name) if family == "moe" else get(name)


def mode_of(family: str, name: str) -> str:
    """What backend `name` of `family` computes: "w4a4" or "w4a16" (the oracle mode it is checked
    against); "w4a4" for a name that is no backend (the original kernel SGLang would call)."""
    registry = _moe if family == "moe" else _dense
    return registry.get(name).mode if name in registry.names() else "w4a4"


def original(t):
    """A weight tensor as the checkpoint has it, for the oracle: where a backend converted its storage
    in place (humming), a copy of the bytes it kept; otherwise the tensor itself."""
    from .humming import adapter as humming

    return humming.original(t)


def quantizer_for(name: str, device: Device) -> tuple[str, GemmFn] | None:
    """The activation quantizer that serves alongside backend `name` on `device`, where it can be
    checked there (FlashInfer's, for FlashInfer backends on sm_100+); None otherwise."""
    return _quantizer(device) if get(name).kind == "flashinfer" else None


def register_moe(name: str, fn: Callable, is_supported: SupportFn | None = None, *, replace: bool = False) -> None:
    """Add NVFP4 fused-MoE backend `name`. `fn(x, topk_ids, topk_weights, w13, w13_sf, w13_alpha, w2,
    w2_sf, w2_alpha, a1_gscale, a2_gscale, activation, out_dtype, out) -> out` follows
    nvfp4.reference_moe_fp4's conventions and writes into `out` (T, H), except that a `topk_ids`
    entry of -1 is a slot that is not this rank's (another expert-parallel rank's expert, or a slot
    SGLang dropped): it must add nothing and cost nothing, whatever its weight (FlashInfer's kernel
    skips such ids). `is_supported(device) -> (ok, reason)`. Every call comes from the thread, and on
    the CUDA stream, that will serve; it must not synchronise with the host (SGLang captures MoE
    layers in CUDA graphs)."""
    _moe.register(name, fn, is_supported, replace, "register_moe")


def unregister_moe(name: str) -> None:
    """Remove a registered MoE backend; built-ins are restored to their original definition."""
    _moe.unregister(name)


def moe_names() -> tuple[str, ...]:
    return _moe.names()


def get_moe(name: str) -> Backend:
    return _moe.get(name)


def is_moe_supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Whether MoE backend `name` can run on `device`, and why not."""
    return _moe.is_supported(name, device)


def resolve_moe(name: str) -> Callable:
    """The callable to run for MoE backend `name` (FlashInfer imported here, not before)."""
    backend = get_moe(name)
    return backend.fn if backend.fn is not None else moe_backend(name)
