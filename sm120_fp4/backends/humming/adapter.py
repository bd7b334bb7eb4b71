"""Everything this library knows about Humming (``humming-kernels``), in one place.

Humming is the vLLM project's JIT-compiled quantized GEMM library: NVFP4 weights with bf16/fp16
activations on SM80+, dense and grouped (MoE). This module makes it the last verified link of the
fallback chain (dense ``cutlass -> b12x -> humming``, MoE ``cutlass -> humming``):

* ``humming`` (dense, the FP4 GEMM alias's convention): SGLang has already quantized the
  activations to FP4 when the alias is called. The backend dequantizes them *exactly* to the
  activation dtype (an E2M1 code times an E4M3 scale needs 5 significant bits: bf16 and fp16 hold
  it), and runs Humming's bf16/fp16-activation kernel on the weight's FP4 codes and E4M3 block
  scales with ``alpha`` as the per-tensor scale: ``alpha * (A_unscaled @ W_unscaled^T)``, the
  very product the W4A4 oracle (``nvfp4.reference_mm_fp4``) defines. Mode :data:`DENSE_MODE`.
* ``humming`` (fused MoE, ``reference_moe_fp4``'s convention): the seam receives bf16/fp16 ``x``
  unquantized; the backend serves **W4A16** (activations never quantized, as SGLang's Marlin MoE
  fallback does), verified against the oracle's W4A16 mode. Mode :data:`MOE_MODE`.

Memory: a layer's weights are converted to Humming's layout once, at load
(:func:`prepare_dense` / :func:`prepare_moe`, called from the layer check), and the converted
bytes are written *into SGLang's own storage* (the packed weight, and the swizzled scale tensor
where Humming's scales fit in it): no second resident copy; the transient is one layer's
conversion. The first layer of each configuration keeps a host (CPU) copy of its original bytes
for the oracle (:func:`original`), so the layer check and the re-check after warm-up compare the
in-place-converted layer with what the checkpoint says. Weights the loader never showed us (the
self-test's, a layer outside the hooks) are converted on first use into a cache next to them
(outside CUDA-graph capture only; a clear error inside).

Start-up: Humming JIT-compiles each distinct kernel configuration at its first call (NVRTC or nvcc)
and keeps the cubins in ``HUMMING_CACHE_DIR`` (default ``~/.humming/cache``): a second start
compiles nothing. :func:`startup` records, per configuration, how long its first call took and how
many cubins the cache gained (status and the report show it).

Humming itself is imported only when a Humming backend is asked about. On a CPU (tests, CI,
simulation) Humming cannot run; :func:`use_engine` puts a stand-in engine in its place (tests
only: ``tests/helpers``), so that the wiring around the kernel is tested.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ... import nvfp4
from ...devices import Device
from ...errors import InvalidArgument, SelfTestError, not_accepted
from ...versions import installed_version, version_in

__all__ = [
    "DISTRIBUTION",
    "DENSE_MODE",
    "MOE_MODE",
    "version",
    "compiler",
    "cache_dir",
    "supported",
    "moe_supported",
    "mm_fp4",
    "fused_moe",
    "prepare_dense",
    "prepare_moe",
    "original",
    "restore",
    "converted_layers",
    "startup",
    "describe_backend",
    "doctor_info",
    "use_engine",
    "Engine",
    "Prepared",
    "clear",
    "prepared_for",
    "dequantize_activations",
]

_LOG = logging.getLogger("sm120_fp4")
DISTRIBUTION = "humming-kernels"
DENSE_MODE = (
    "W4A4: SGLang's FP4-quantized activations, dequantized exactly to bf16/fp16, through Humming's "
    "bf16/fp16-activation kernel on the FP4 weights (checked against the W4A4 oracle)"
)
MOE_MODE = (
    "W4A16: bf16/fp16 activations, not quantized, through Humming's grouped kernel on the FP4 experts "
    "(checked against the oracle's W4A16 mode, reference_moe_fp4(quantize_activations=False))"
)
# Releases that crash on GB10 (sm_121) at an NVML memory-clock query (vllm #49554).
_GB10_CRASH = ">=0.1.10,<0.1.12"
# The padding SGLang's own Humming methods ask for (some of Humming's per-M kernels tile N by 256
# and K by 128; the H200 run showed K=480/N=160 failing with less): a weight already aligned keeps
# its size and is converted in place; any other is padded by Humming and kept next to SGLang's.
_N_ALIGN, _K_ALIGN = 256, 128
_K_CALL = 32  # what a call needs of K (the FP4 GEMM's own alignment); Humming pads the rest


def version() -> str | None:
    """The installed humming-kernels version, without importing it."""
    return installed_version(DISTRIBUTION, "humming")


def cache_dir() -> str:
    """Where Humming keeps compiled kernels across restarts (its HUMMING_CACHE_DIR, else its default)."""
    return os.environ.get("HUMMING_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".humming", "cache")


def compiler() -> tuple[str | None, str]:
    """Which compiler Humming would JIT with here: ("nvrtc" | "nvcc" | None, how it was found)."""
    forced = os.environ.get("HUMMING_COMPILER", "").lower()
    nvcc = os.environ.get("CUDA_NVCC_PATH") or shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if nvcc is None and home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        nvcc = os.path.join(home, "bin", "nvcc")
    if nvcc is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    try:
        from cuda.bindings import nvrtc  # noqa: F401  (Humming's default compiler)

        has_nvrtc = True
    except Exception:
        has_nvrtc = False
    if forced == "nvcc":
        return ("nvcc", f"HUMMING_COMPILER=nvcc: {nvcc}") if nvcc else (None, "HUMMING_COMPILER=nvcc but no nvcc found")
    if forced == "nvrtc" or has_nvrtc:
        return (
            ("nvrtc", "cuda-bindings' NVRTC")
            if has_nvrtc
            else (None, "HUMMING_COMPILER=nvrtc but cuda-bindings' nvrtc does not import")
        )
    if nvcc:
        return "nvcc", nvcc
    return None, "neither NVRTC (cuda-bindings) nor nvcc (CUDA toolkit) is available"


# ---- the engine: what this module needs from Humming ------------------------------------------


@dataclass
class Prepared:
    """One weight (dense (N, K) or E experts) in the engine's layout.

    `tensors` are what a call reads ("weight", "weight_scale"; views into SGLang's storage once
    converted in place); `scale_2` the per-tensor (or per-expert) factor the conversion left, by
    which each call's alpha is multiplied (None: exactly 1, alpha is passed as is); `meta` the
    engine's own description (kernel configuration); `label` a name for reports.
    """

    tensors: dict[str, torch.Tensor]
    meta: Any
    label: str
    n: int
    k: int
    experts: int | None
    dtype: torch.dtype
    scale_2: torch.Tensor | None = None
    locks: torch.Tensor | None = None
    kernels: Any = None  # the engine's compiled kernel table (Humming: its configs tensor), made at the first call


class Engine:
    """The Humming calls this module makes; the real one imports Humming, a stand-in (tests) does not."""

    name = "humming"

    def unusable(self, device: Device) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def prepare(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, experts: int | None) -> Prepared:
        """`weight` (E?, N, K/2) uint8 packed E2M1 (element 2i in the low nibble), `scale` (E?, N,
        K/16) float8_e4m3fn, linear (not swizzled); returns them in the engine's layout."""
        raise NotImplementedError  # pragma: no cover

    def gemm(self, prepared: Prepared, x: torch.Tensor, scale_2: torch.Tensor, out: torch.Tensor) -> None:
        """out (M, N) = scale_2 * (x @ W_unscaled^T); x (M, K) in prepared.dtype."""
        raise NotImplementedError  # pragma: no cover

    def grouped_gemm(
        self, prepared: Prepared, x: torch.Tensor, scale_2: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Rows offsets[e]:offsets[e+1] of x (sorted by expert) times expert e, scaled by scale_2[e]."""
        raise NotImplementedError  # pragma: no cover


class _HummingEngine(Engine):
    """The real thing: humming-kernels' HummingLayer conversion and its GEMM launcher."""

    def unusable(self, device: Device) -> str | None:
        found = version()
        if found is None:
            return f"{DISTRIBUTION} is not installed (pip install {DISTRIBUTION})"
        if not device.is_cuda:
            return "Humming's kernels need a CUDA GPU; this device is the simulated CPU"
        if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
            return f"torch {torch.__version__} cannot use CUDA device {device.index} (no driver, or a CPU build)"
        real = torch.cuda.get_device_capability(device.index)
        if real < (8, 0):
            return f"Humming's bf16/fp16-activation kernels need sm_80+ (this GPU is sm_{real[0]}{real[1]})"
        if real[0] == 12 and real[1] == 1 and version_in(found, _GB10_CRASH):
            return f"{DISTRIBUTION} {found} crashes on GB10 at an NVML memory-clock query (vllm #49554); use >= 0.1.12"
        tool, why = compiler()
        if tool is None:
            return f"Humming JIT-compiles its kernels and cannot here: {why}"
        try:
            import humming.layer  # noqa: F401
        except Exception as exc:  # a broken install raising anything
            return f"{DISTRIBUTION} {found} does not import: {type(exc).__name__}: {exc}"
        return None

    def prepare(self, weight, scale, dtype, experts):
        # The calls SGLang's own Humming methods make (HummingLinearMethod / HummingMoEMethod), the same
        # in 0.1.12 (the release SGLang 0.5.23 pins) and the newest: convert the ModelOpt tensors,
        # describe the layer, transform the tensors into the kernel's layout.
        from humming.layer import HummingMethod
        from humming.schema import BaseWeightSchema

        n, k = weight.shape[-2], weight.shape[-1] * 2
        device = weight.device
        schema = BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "NVFP4"})
        with torch.cuda.device(device):
            ones = torch.ones(experts or 1, dtype=torch.float32, device=device)  # alpha comes with every call
            hschema, tensors = schema.convert_humming(
                tensors={"weight": weight, "weight_scale": scale, "weight_scale_2": ones},
                shape_n_stacks=[n],
                shape_k_stacks=[k],
                param_dtype=dtype,
                num_experts=experts,
            )
            holder = torch.nn.Module()
            for name, tensor in tensors.items():
                setattr(holder, name, torch.nn.Parameter(tensor, requires_grad=False))
            del tensors
            HummingMethod.prepare_layer_meta(
                layer=holder,
                shape_n=n,
                shape_k=k,
                weight_schema=hschema,
                num_experts=experts,
                pad_n_to_multiple=_N_ALIGN,
                pad_k_to_multiple=_K_ALIGN,
                has_bias=False,
                torch_dtype=dtype,
            )
            HummingMethod.transform_humming_layer(holder)
        meta = holder.humming_metas[""]
        out = {"weight": holder.weight.data, "weight_scale": holder.weight_scale.data}
        scale_2 = getattr(holder, "weight_scale_2", None)
        scale_2 = None if scale_2 is None else scale_2.data.float().reshape(-1)
        if scale_2 is not None and bool((scale_2 == 1).all()):  # at load, outside capture: a host read is fine
            scale_2 = None
        gemm_type = "grouped_contiguous" if experts else "dense"
        config = {
            "layer_config": meta.to_str(),
            "compute_config": json.dumps({"use_f16_accum": False, "gemm_type": gemm_type}),
        }
        label = f"N={n} K={k}" + (f" E={experts}" if experts else "") + f" {str(dtype).removeprefix('torch.')}"
        locks = torch.zeros(2048, dtype=torch.int32, device=device)  # stream-K state, one per layer
        return Prepared(out, config, label, n, k, experts, dtype, scale_2, locks)

    @staticmethod
    def _kernels(prepared):
        """The layer's kernel table (one compiled kernel per M range: Humming's own choice, or the
        measured one of `tuning_config`), resolved once at its first call (outside capture: the
        layer check makes it) instead of at every call: Humming's per-call path (ops.humming_gemm)
        re-serialises and looks up its three configuration strings each time."""
        if prepared.kernels is None:
            from humming.kernel.humming import HummingKernel

            with torch.cuda.device(prepared.tensors["weight"].device):
                prepared.kernels = HummingKernel.prepare_kernels(
                    prepared.meta["layer_config"], prepared.meta["compute_config"], prepared.meta.get("tuning_config")
                )
        return prepared.kernels

    @classmethod
    def _launch(cls, prepared, x, scale_2, out, **moe):
        from humming import ops

        ops.launch_kernel(
            configs=cls._kernels(prepared),
            inputs=x,
            weight=prepared.tensors["weight"],
            weight_scale=prepared.tensors["weight_scale"],
            weight_scale_2=scale_2,
            outputs=out,
            locks=prepared.locks,
            **moe,
        )

    def gemm(self, prepared, x, scale_2, out):
        self._launch(prepared, x, scale_2, out)

    def grouped_gemm(self, prepared, x, scale_2, offsets, out):
        self._launch(prepared, x, scale_2, out, expert_layout=offsets, valid_shape_m=x.shape[0])


_engine: Engine = _HummingEngine()
_lock = threading.RLock()


def use_engine(engine: Engine | None) -> Engine:
    """Put `engine` in Humming's place (None: the real Humming); returns the previous one. Tests only:
    a stand-in computes what Humming would, so the wiring is tested where Humming cannot run."""
    global _engine
    with _lock:
        previous, _engine = _engine, engine or _HummingEngine()
        clear()
    return previous


def supported(device: Device) -> tuple[bool, str | None]:
    """Whether the dense Humming backend can run on `device`, and why not."""
    problem = _engine.unusable(device)
    return (problem is None), problem


moe_supported = supported


# ---- conversions and where they live ----------------------------------------------------------


@dataclass
class _Converted:
    """A weight of SGLang's whose storage now holds Humming's layout (or next to which it lives)."""

    prepared: Prepared
    in_place: bool
    extra_bytes: int  # GPU bytes beyond SGLang's own tensors (scales that did not fit; a cache copy)
    family: str = "dense"
    originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # storage ptr -> (kept copy, target)
    written: set[int] = field(default_factory=set)  # storages of SGLang's that now hold Humming's bytes
    owner: Any = None  # weakref to the tensor whose storage is the key: a dead one means a stale record


# Keyed by the packed weight's storage pointer (a dense b's, a MoE w13's or w2's) and IN_PLACE for
# SGLang's served layers converted at load, or the activation dtype for a copy made on first use.
IN_PLACE = "in-place"
_converted: dict[tuple[int, object], _Converted] = {}
_startup: dict[str, dict] = {}
_memory: dict[str, dict] = {}


def clear() -> None:
    """Forget every conversion record (tests; an engine swap). Converted storages stay converted."""
    with _lock:
        _converted.clear()
        _startup.clear()
        _memory.clear()
        _dequant_engines.clear()  # chosen again (and reported) at the next call; built kernels stay loaded


def _cubins() -> int:
    try:
        return sum(1 for _root, _dirs, files in os.walk(cache_dir()) for f in files if f == "kernel.cubin")
    except OSError:
        return 0


def _first_call(prepared: Prepared, family: str, call: Callable[[], None]) -> None:
    """Run `call`, timing it when it is the first of its kernel configuration (its JIT compile or cache load)."""
    key = f"{family} {prepared.label}"
    if key in _startup:
        call()
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SelfTestError(
            f"sm120_fp4: Humming's {key} kernels were never run before CUDA-graph capture "
            "(its JIT compile cannot run inside capture); the layer check runs them at load"
        )
    before, start = _cubins(), time.perf_counter()
    call()
    if prepared.tensors["weight"].is_cuda:
        torch.cuda.synchronize(prepared.tensors["weight"].device)
    seconds = time.perf_counter() - start
    compiled = max(0, _cubins() - before)
    with _lock:
        _startup.setdefault(
            key,
            {
                "first_call_s": round(seconds, 3),
                "kernels_compiled": compiled,
                "from_cache": compiled == 0,
                "engine": _engine.name,
                "version": version(),
            },
        )
    _LOG.info(
        "sm120_fp4: Humming %s: first call %.2f s (%d kernel(s) compiled, cache %s)",
        key,
        seconds,
        compiled,
        cache_dir(),
    )


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fits(src: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether `src`'s bytes fit in `target`'s own storage (target a contiguous tensor starting it)."""
    return (
        target.is_contiguous()
        and target.storage_offset() == 0
        and src.is_contiguous()
        and _bytes(src) <= target.untyped_storage().nbytes()
    )


def _write_into(src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Copy `src`'s bytes to the start of `target`'s storage; return a view of them with src's shape/dtype."""
    flat = torch.empty(0, dtype=torch.uint8, device=target.device).set_(target.untyped_storage())
    flat[: _bytes(src)].copy_(src.contiguous().view(-1).view(torch.uint8))
    return flat[: _bytes(src)].view(src.dtype).view(src.shape)


def _unswizzle(sf: torch.Tensor, rows: int, k: int, experts: int | None) -> torch.Tensor:
    """Linear (E?, rows, k/16) float8_e4m3fn scales from 128x4-swizzled ones (one layout per expert)."""
    sf = sf.view(torch.float8_e4m3fn) if sf.dtype == torch.uint8 else sf
    if experts is None:
        return nvfp4.unswizzle_scales(sf.contiguous(), rows, k)
    per = sf.reshape(experts, -1)
    return torch.stack([nvfp4.unswizzle_scales(per[e].contiguous(), rows, k) for e in range(experts)])


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _convert(
    weight: torch.Tensor,
    sf_swizzled: torch.Tensor,
    dtype: torch.dtype,
    experts: int | None,
    in_place: bool,
    keep_original: bool,
    family: str,
) -> _Converted:
    """Convert one weight (its packed codes and swizzled scales) to Humming's layout: into SGLang's
    storage (`in_place`, keeping a copy of the bytes overwritten when `keep_original`: on the device
    while the layer is checked, see drop_originals), or next to it."""
    rows, k = weight.shape[-2], weight.shape[-1] * 2
    if rows % _N_ALIGN or k % _K_ALIGN:
        in_place = False  # Humming pads such a weight: its layout does not fit SGLang's storage
    linear_sf = _unswizzle(sf_swizzled, rows, k, experts)
    prepared = _engine.prepare(weight.contiguous(), linear_sf, dtype, experts)
    del linear_sf
    conv = _Converted(
        prepared, in_place, sum(_bytes(t) for t in prepared.tensors.values()), family, owner=weakref.ref(_root(weight))
    )
    if not in_place:
        return conv
    conv.extra_bytes = 0
    new = dict(prepared.tensors)
    for name, target in (("weight", weight), ("weight_scale", sf_swizzled)):
        src = prepared.tensors[name]
        if not _fits(src, target):
            if name == "weight":
                raise SelfTestError(
                    f"sm120_fp4: Humming's layout of a {tuple(weight.shape)} weight does not fit SGLang's storage of it"
                )
            conv.extra_bytes += _bytes(src)  # kept next to SGLang's (smaller) swizzled scales
            continue
        key = _storage_key(target)
        if keep_original:
            conv.originals[key] = (target.detach().clone(), target)  # the oracle reads it during the check: no copy
        new[name] = _write_into(src, target)
        conv.written.add(key)
    prepared.tensors = new
    return conv


def _record_memory(label: str, conv: _Converted, nvfp4_bytes: int) -> None:
    with _lock:
        entry = _memory.setdefault(
            label, {"layers": 0, "in_place": conv.in_place, "nvfp4_bytes": nvfp4_bytes, "extra_bytes": conv.extra_bytes}
        )
        entry["layers"] += 1
        entry["ratio"] = round((nvfp4_bytes + conv.extra_bytes) / nvfp4_bytes, 4)


def prepare_dense(weight: torch.Tensor, weight_sf: torch.Tensor, dtype: torch.dtype, keep_original: bool) -> None:
    """Convert one served dense layer in place, at load (the weights hook's layer check).

    `weight` (N, K/2) uint8 and `weight_sf` (the swizzled (ceil128(N), ceil4(K/16)) scales) are
    SGLang's own tensors; `keep_original` keeps a copy of their bytes for the oracle while the layer
    is checked (and, in pinned host memory, for good for the first layer of each configuration: the
    one the re-checks and the canary compare)."""
    key = (_storage_key(weight), IN_PLACE)
    with _lock:
        if key in _converted:
            return
        conv = _convert(weight, weight_sf, dtype, None, in_place=True, keep_original=keep_original, family="dense")
        _converted[key] = conv
        _record_memory(f"dense {conv.prepared.label}", conv, _bytes(weight) + _bytes(weight_sf))


def prepare_moe(weights: dict, dtype: torch.dtype, keep_original: bool) -> None:
    """Convert one served MoE layer's w13 and w2 in place (reference_moe_fp4's names in `weights`)."""
    experts = weights["w13"].shape[0]
    with _lock:
        for w, sf in (("w13", "w13_sf"), ("w2", "w2_sf")):
            key = (_storage_key(weights[w]), IN_PLACE)
            if key in _converted:
                continue
            conv = _convert(
                weights[w], weights[sf], dtype, experts, in_place=True, keep_original=keep_original, family="moe"
            )
            _converted[key] = conv
            _record_memory(f"moe {w} {conv.prepared.label}", conv, _bytes(weights[w]) + _bytes(weights[sf]))


def original(t: torch.Tensor) -> torch.Tensor:
    """`t` as the checkpoint has it: a device copy of its original bytes where Humming converted its
    storage in place (the first layer of each configuration keeps them), else `t` itself. The oracle
    reads weights through this; a converted storage without a kept copy is an error, never a guess."""
    key = _storage_key(t)
    with _lock:
        for conv in _converted.values():
            kept = conv.originals.get(key)
            if kept is not None:
                copy, target = kept
                # On the device while checked (no copy); from pinned host memory for good (one copy,
                # ordered on the current stream before the oracle's reads).
                copy = copy.to(t.device, non_blocking=copy.is_pinned())
                if copy.dtype != t.dtype or tuple(copy.shape) != tuple(t.shape):
                    copy = copy.reshape(-1).view(torch.uint8)[: _bytes(t)].view(t.dtype).view(t.shape)
                return copy
            if conv.in_place and key in conv.written:
                raise SelfTestError(
                    "sm120_fp4: this weight was converted to Humming's layout in place and its "
                    "original bytes were not kept; the oracle cannot read it"
                )
    return t


def _layer_conversions(tensors: dict) -> list[_Converted]:
    """The in-place conversions of one layer's weights (`tensors`: a dense layer's "weight" or a MoE
    layer's "w13" and "w2"); the caller holds _lock."""
    found = []
    for name in ("weight", "w13", "w2"):
        t = tensors.get(name)
        conv = _converted.get((_storage_key(t), IN_PLACE)) if isinstance(t, torch.Tensor) else None
        if conv is not None:
            found.append(conv)
    return found


def drop_originals(tensors: dict, keep: bool = False) -> None:
    """One converted layer's check is over (`tensors`: a dense layer's "weight" or a MoE layer's
    "w13" and "w2"): forget the copy of its original bytes, kept on the device while it was checked
    (that layer then stays in Humming's layout, restore() reports it, and nothing is held per served
    layer); with `keep` (the first layer of its configuration, which the re-checks and the canary
    compare) move the copy to pinned host memory instead: no GPU memory held, and each later oracle
    read is one host-to-device copy at the link's full speed."""
    with _lock:
        for conv in _layer_conversions(tensors):
            if not keep:
                conv.originals.clear()
                continue
            for key, (copy, target) in list(conv.originals.items()):
                conv.originals[key] = (_pinned(copy), target)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory (a device tensor copied there; one already on the host stays)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)  # synchronous: the device copy is freed when this returns
    return host


def converted_layers(family: str) -> int:
    """How many `family` weights this process converted in place (another backend cannot read them)."""
    with _lock:
        return sum(1 for c in _converted.values() if c.in_place and c.family == family)


def restore(family: str) -> bool:
    """Write the kept original bytes back wherever Humming converted a `family` ("dense", "moe")
    storage in place; True when every such weight was restored (another backend can then serve
    them), False when some had no kept copy (those stay converted: only Humming can serve them)."""
    with _lock:
        complete = True
        for key, conv in list(_converted.items()):
            if conv.family != family:
                continue
            if conv.in_place and not conv.originals:
                complete = False
                continue
            for copy, target in conv.originals.values():
                _write_into(copy.to(target.device), target)
            del _converted[key]
        return complete


def prepared_for(weight: torch.Tensor, dtype: torch.dtype) -> Prepared | None:
    """The conversion serving `weight` for `dtype` activations, or None (benchmarks, tests)."""
    key = _storage_key(weight)
    conv = _converted.get((key, IN_PLACE)) or _converted.get((key, dtype))
    return None if conv is None else conv.prepared


def _entry(
    weight: torch.Tensor, sf_swizzled: torch.Tensor, dtype: torch.dtype, experts: int | None, family: str
) -> _Converted:
    """The conversion of `weight`: made in place at load, or now next to it (outside capture only)."""
    ptr = _storage_key(weight)
    conv = _converted.get((ptr, IN_PLACE))
    if conv is not None:
        if conv.owner() is not None:
            if conv.prepared.dtype != dtype:
                raise InvalidArgument(
                    f"humming: this layer was converted for {conv.prepared.dtype} activations at load; "
                    f"called with {dtype}"
                )
            return conv
        with _lock:  # the weight it was made for is gone; this is another tensor at the same address
            _converted.pop((ptr, IN_PLACE), None)
    key = (ptr, dtype)
    conv = _converted.get(key)
    if conv is not None and conv.owner() is not None:
        return conv
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SelfTestError(
            "sm120_fp4: a weight Humming never saw at load reached it inside CUDA-graph capture; "
            "converting it there is impossible (the layer check converts every served layer at load)"
        )
    with _lock:
        conv = _convert(weight, sf_swizzled, dtype, experts, in_place=False, keep_original=False, family=family)
        _converted[key] = conv
        weakref.finalize(_root(weight), _converted.pop, key, None)
    _LOG.debug("sm120_fp4: Humming converted a %s weight next to SGLang's on first use", conv.prepared.label)
    return conv


# ---- the backends -----------------------------------------------------------------------------


def _check_dense(a, b, a_descale, b_descale, alpha, out_dtype, out) -> None:
    from ..flashinfer import check_mm_fp4_args

    check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, out, align=(_K_CALL, 8))


def mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out):
    """The dense ``humming`` backend (mm_fp4's convention): out = alpha * (A_unscaled @ W_unscaled^T),
    the activations dequantized exactly to `out_dtype`, the weight through Humming."""
    _check_dense(a, b, a_descale, b_descale, alpha, out_dtype, out)
    # A served layer converted at load, looked up without making the .T views (b and b.T share the
    # storage the key is); anything else (a dead record, another dtype, no record) goes through
    # _entry, which converts, raises or refuses as it must.
    conv = _converted.get((_storage_key(b), IN_PLACE))
    if conv is None or conv.owner() is None or conv.prepared.dtype != out_dtype:
        conv = _entry(b.T, b_descale.T, out_dtype, None, "dense")
    prepared = conv.prepared
    x = dequantize_activations(a, a_descale, out_dtype)
    scale = alpha if alpha.dim() == 1 else alpha.reshape(1)
    if prepared.scale_2 is not None:
        scale = scale * prepared.scale_2
    _first_call(prepared, "dense", lambda: _engine.gemm(prepared, x, scale, out))
    return out


_dequant_engines: dict[int, tuple[str, Callable]] = {}  # device index -> (engine, launch)


def _dequant_engine(device: torch.device) -> tuple[str, Callable]:
    """The activation-dequantization kernel for `device`, chosen at its first use (outside capture):
    the CUDA C kernel (NVRTC, a driver launch: a few us of host time per call), else the Triton
    kernel (about 30 us of host time per call on the H200), with the reason kept for the report."""
    index = device.index
    found = _dequant_engines.get(index)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        from .cuda import launch as cuda_launch
        from .cuda import loaded

        if loaded(device):  # built before (the records were cleared since): nothing to build now
            with _lock:
                return _dequant_engines.setdefault(index, ("cuda", cuda_launch))
        raise SelfTestError(
            "sm120_fp4: Humming's activation dequantization kernel was never run on this GPU before "
            "CUDA-graph capture (it cannot be built inside capture); the layer check runs it at load"
        )
    reason = None
    try:
        from .cuda import launch as cuda_launch
        from .cuda import load

        load(device)
        found = ("cuda", cuda_launch)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        from .dequant import launch as triton_launch

        def launch(a, sf, out, kp):
            triton_launch(a, sf.view(torch.uint8), out, kp)

        found = ("triton", launch)
        _LOG.info(
            "sm120_fp4: Humming's activation dequantization runs as a Triton kernel on cuda:%s (%s)", index, reason
        )
    with _lock:
        _dequant_engines[index] = found
        _startup.setdefault(
            "dequant",
            {
                "first_call_s": None,
                "kernels_compiled": None,
                "from_cache": None,
                "engine": found[0],
                "version": "the activation dequantization kernel "
                + ("(CUDA C through NVRTC)" if found[0] == "cuda" else "(Triton's own cache)"),
                "fallback_reason": reason,
            },
        )
    return found


def dequantize_activations(a: torch.Tensor, a_descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SGLang's FP4 activations (M, K/2) with their swizzled scales, dequantized exactly to `dtype`
    (e2m1(code) * float(scale): 5 significant bits, which bf16 and fp16 hold): one CUDA kernel
    (NVRTC; Triton's where NVRTC cannot build it) on CUDA, nvfp4's decode elsewhere (the stand-in's CPU)."""
    m, half_k = a.shape
    if not a.is_cuda:
        x = nvfp4.dequantize_unscaled(a, a_descale.reshape(-1), torch.float32)
        return x.to(dtype)
    out = torch.empty((m, 2 * half_k), dtype=dtype, device=a.device)
    if m:
        first = a.device.index not in _dequant_engines
        start = time.perf_counter()
        _engine_name, launch = _dequant_engine(a.device)
        # The scale bytes as they are (uint8 or float8_e4m3fn: the kernels read bytes); kp, the
        # swizzled layout's scale columns, is nvfp4.swizzled_scale_shape(m, K)[1]: ceil4(K / 16).
        launch(a, a_descale, out, (half_k // 8 + 3) // 4 * 4)
        entry = _startup.get("dequant") if first else None
        if entry is not None and entry["first_call_s"] is None:  # its build and first run, timed (never inside capture)
            torch.cuda.synchronize(a.device)
            with _lock:
                entry["first_call_s"] = round(time.perf_counter() - start, 3)
    return out


def _bad_moe(param: str, value: object, accepted: str) -> InvalidArgument:
    return not_accepted("humming fused MoE", param, value, accepted)


def fused_moe(
    x,
    topk_ids,
    topk_weights,
    w13,
    w13_sf,
    w13_alpha,
    w2,
    w2_sf,
    w2_alpha,
    a1_gscale,
    a2_gscale,
    activation,
    out_dtype,
    out,
):
    """The MoE ``humming`` backend (reference_moe_fp4's convention), W4A16: x is not quantized; each
    expert's weight factor is its alpha times the activation scale it was made for (w13_alpha *
    a1_gscale: 1 / the weight's global scale). Rows are grouped by expert (stable), both GEMMs run
    grouped, and each token's k rows are summed with its routing weights in float32."""
    from ..flashinfer import check_moe_args

    check_moe_args(
        x,
        topk_ids,
        topk_weights,
        w13,
        w13_sf,
        w13_alpha,
        w2,
        w2_sf,
        w2_alpha,
        a1_gscale,
        a2_gscale,
        activation,
        out_dtype,
        out,
    )
    if x.dtype != out_dtype:
        raise _bad_moe("out_dtype", out_dtype, f"x's dtype ({x.dtype}): the W4A16 kernel computes in it")
    experts = w13.shape[0]
    c13 = _entry(w13, w13_sf, x.dtype, experts, "moe")
    c2 = _entry(w2, w2_sf, x.dtype, experts, "moe")
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    # The convention's -1 (another rank's slot, or one SGLang dropped) adds nothing: such a slot rides
    # with expert 0 as a zero row (Humming's grouped layout has no row without an expert; no host
    # sync to count them), and its result is discarded below, so nothing of it, finite or not, is summed.
    valid = flat >= 0
    flat = torch.where(valid, flat, torch.zeros_like(flat))
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    rows = torch.where(
        valid[order].unsqueeze(1), x.index_select(0, order // top_k), torch.zeros((), dtype=x.dtype, device=x.device)
    )
    s13 = (w13_alpha * a1_gscale).float()
    s2 = (w2_alpha * a2_gscale).float()
    if c13.prepared.scale_2 is not None:
        s13 = s13 * c13.prepared.scale_2
    if c2.prepared.scale_2 is not None:
        s2 = s2 * c2.prepared.scale_2
    fc1 = torch.empty((rows.shape[0], w13.shape[1]), dtype=x.dtype, device=x.device)
    _first_call(c13.prepared, "moe", lambda: _engine.grouped_gemm(c13.prepared, rows, s13, offsets, fc1))
    if activation == "swiglu":
        inter = w13.shape[1] // 2
        up, gate = fc1[:, :inter].float(), fc1[:, inter:].float()
        act = (gate * torch.sigmoid(gate) * up).to(x.dtype)
    else:
        act = torch.relu(fc1.float()).square().to(x.dtype)
    fc2 = torch.empty((rows.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    _first_call(c2.prepared, "moe", lambda: _engine.grouped_gemm(c2.prepared, act, s2, offsets, fc2))
    routed = torch.empty_like(fc2).index_copy_(0, order, fc2).view(tokens, top_k, -1).float()
    routed = torch.where(valid.view(tokens, top_k, 1), routed, torch.zeros((), device=x.device))
    out.copy_((routed * topk_weights.unsqueeze(-1)).sum(dim=1))
    return out


# ---- what status, the report and doctor show --------------------------------------------------


def startup() -> dict:
    """Per distinct kernel configuration: the first call's seconds and whether it compiled or loaded
    from Humming's cache; the cache directory; the memory of converted layers against their NVFP4 tensors."""
    with _lock:
        return {
            "cache_dir": cache_dir(),
            "configurations": dict(_startup),
            "memory": {k: dict(v) for k, v in _memory.items()},
        }


def describe_backend(family: str) -> dict:
    """What status and the report say about the serving Humming backend of `family`: its mode, the
    first call (JIT compile or cache load) of each of its kernel configurations, the memory of the
    layers it converted, and how many it converted in place."""
    info = startup()
    prefix = "dense" if family == "dense" else "moe"
    return {
        "mode": DENSE_MODE if family == "dense" else MOE_MODE,
        "engine": _engine.name,
        "humming_version": version(),
        "cache_dir": info["cache_dir"],
        "converted_in_place": converted_layers(family),
        "configurations": {
            k: v
            for k, v in info["configurations"].items()
            if k.startswith(prefix) or (k == "dequant" and family == "dense")
        },
        "memory": {k: v for k, v in info["memory"].items() if k.startswith(prefix)},
    }


def doctor_info() -> dict:
    """The Humming version, its compiler here, its cache (for `sm120-fp4 doctor`); imports nothing heavy."""
    tool, how = compiler()
    return {
        "version": version(),
        "compiler": tool,
        "compiler_detail": how,
        "cache_dir": cache_dir(),
        "can_compile": tool is not None,
        "note": None if version() else f"the humming fallback needs `pip install {DISTRIBUTION}`",
    }
