"""The ``humming`` backends, the fallback chain's verified last link on 12.x: dense (W4A4: SGLang's FP4 activations
dequantized exactly) and fused MoE (W4A16: activations not quantized), with what status and doctor show of them."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from ... import nvfp4
from ...devices import Device
from ...errors import SelfTestError, not_accepted
from ..convention import check_mm_fp4_args, check_moe_args
from . import convert
from .convert import converted_layers, drop_originals, original, prepare_dense, prepare_moe, prepared_for, restore
from .cuda import launch as cuda_launch
from .cuda import load
from .engine import DISTRIBUTION, Engine, Prepared, cache_dir, compiler, current_engine, lock, swap_engine, version

__all__ = [
    "DENSE_MODE",
    "MOE_MODE",
    "Engine",
    "Prepared",
    "version",
    "compiler",
    "supported",
    "use_engine",
    "clear",
    "mm_fp4",
    "fused_moe",
    "dequantize_activations",
    "prepare_dense",
    "prepare_moe",
    "drop_originals",
    "original",
    "restore",
    "converted_layers",
    "prepared_for",
    "startup",
    "describe_backend",
    "doctor_info",
]

_LOG = logging.getLogger("sm120_fp4")
DENSE_MODE = (
    "W4A4: SGLang's FP4-quantized activations, dequantized exactly to bf16/fp16, through Humming's "
    "bf16/fp16-activation kernel on the FP4 weights (checked against the W4A4 oracle)"
)
MOE_MODE = (
    "W4A16: bf16/fp16 activations, not quantized, through Humming's grouped kernel on the FP4 experts "
    "(checked against the oracle's W4A16 mode, reference_moe_fp4(quantize_activations=False))"
)
_K_CALL = 32  # what a call needs of K (the FP4 GEMM's own alignment); Humming pads the rest
_startup: dict[str, dict] = {}  # per kernel configuration: its first call (JIT compile or cache load)
_dequant_engines: dict[int, tuple[str, Callable]] = {}  # device index -> (engine, launch)


def use_engine(new: Engine | None) -> Engine:
    """Put `new` in Humming's place (None: the real Humming; tests: a stand-in); return the previous one."""
    with lock:
        previous = swap_engine(new)
        clear()
    return previous


def supported(device: Device) -> tuple[bool, str | None]:
    """Return whether the Humming backends can run on `device`, and why not."""
    problem = current_engine().unusable(device)
    return (problem is None), problem


def clear() -> None:
    """Forget every conversion and first-call record (tests; an engine swap). Converted storages stay so."""
    with lock:
        convert.forget()
        _startup.clear()
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
    record = {"first_call_s": round(seconds, 3), "kernels_compiled": compiled, "from_cache": compiled == 0}
    with lock:
        _startup.setdefault(key, {**record, "engine": current_engine().name, "version": version()})
    message = "sm120_fp4: Humming %s: first call %.2f s (%d kernel(s) compiled, cache %s)"
    _LOG.info(message, key, seconds, compiled, cache_dir())


def mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out):
    """Run mm_fp4's convention: alpha * (A_unscaled @ W_unscaled^T), A dequantized exactly, W through Humming."""
    check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, out, align=(_K_CALL, 8))
    # A layer converted at load, found without making the .T views (b and b.T share the storage);
    # anything else goes through conversion(), which converts, raises or refuses as it must.
    conv = convert.converted.get((convert.storage_key(b), convert.IN_PLACE))
    if conv is None or conv.owner() is None or conv.prepared.dtype != out_dtype:
        conv = convert.conversion(b.T, b_descale.T, out_dtype, None, "dense")
    prepared = conv.prepared
    x = dequantize_activations(a, a_descale, out_dtype)
    scale = alpha if alpha.dim() == 1 else alpha.reshape(1)
    if prepared.scale_2 is not None:
        scale = scale * prepared.scale_2
    _first_call(prepared, "dense", lambda: current_engine().gemm(prepared, x, scale, out))
    return out


def _dequant_engine(device: torch.device) -> tuple[str, Callable]:
    """Return the activation-dequantization kernel for `device`, chosen at its first use (outside capture)."""
    # The CUDA C kernel (NVRTC, a driver launch: a few us of host time per call; humming-kernels requires
    # cuda-bindings, whose NVRTC Humming compiles with too), else torch's (the oracle's decode, a few launches).
    index = device.index
    found = _dequant_engines.get(index)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():  # chosen at load, by the layer check; only clear() forgets it
        raise SelfTestError(
            "sm120_fp4: Humming's activation dequantization kernel was never run on this GPU before "
            "CUDA-graph capture (it cannot be built inside capture); the layer check runs it at load"
        )
    reason = None
    try:
        load(device)
        found = ("cuda", cuda_launch)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        found = ("torch", _torch_launch)
        _LOG.info(
            "sm120_fp4: Humming's activation dequantization runs as torch operations on cuda:%s (%s)", index, reason
        )
    kind = "(CUDA C through NVRTC)" if found[0] == "cuda" else "(torch operations: NVRTC could not build it)"
    with lock:
        _dequant_engines[index] = found
        record = dict.fromkeys(("first_call_s", "kernels_compiled", "from_cache"))
        record.update(engine=found[0], version=f"the activation dequantization kernel {kind}", fallback_reason=reason)
        _startup.setdefault("dequant", record)
    return found


def _torch_launch(a: torch.Tensor, sf: torch.Tensor, out: torch.Tensor, kp: int) -> None:
    """Dequantize as the CUDA C kernel does, with torch operations (where NVRTC cannot build that kernel)."""
    out.copy_(nvfp4.dequantize_unscaled(a, sf.reshape(-1), torch.float32))


def dequantize_activations(a: torch.Tensor, a_descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return SGLang's FP4 activations (M, K/2) with their swizzled scales, dequantized exactly to `dtype`."""
    # e2m1(code) * float(scale) has 5 significant bits, which bf16 and fp16 hold: one kernel on CUDA.
    m, half_k = a.shape
    if not a.is_cuda:
        return nvfp4.dequantize_unscaled(a, a_descale.reshape(-1), torch.float32).to(dtype)
    out = torch.empty((m, 2 * half_k), dtype=dtype, device=a.device)
    if m:
        first = a.device.index not in _dequant_engines
        start = time.perf_counter()
        _, launch = _dequant_engine(a.device)
        launch(a, a_descale, out, (half_k // 8 + 3) // 4 * 4)  # kp: the swizzled layout's scale columns
        entry = _startup.get("dequant") if first else None
        if entry is not None and entry["first_call_s"] is None:  # its build and first run (never inside capture)
            torch.cuda.synchronize(a.device)
            with lock:
                entry["first_call_s"] = round(time.perf_counter() - start, 3)
    return out


def fused_moe(*args):
    """Run the MoE convention (MoeArgs) W4A16: x not quantized, rows grouped by expert, both GEMMs grouped."""
    c = check_moe_args(*args)
    x = c.x
    if x.dtype != c.out_dtype:
        why = f"x's dtype ({x.dtype}): the kernel computes in it"
        raise not_accepted("humming fused MoE", "out_dtype", c.out_dtype, why)
    experts = c.w13.shape[0]
    c13, c2 = (convert.conversion(w, sf, x.dtype, experts, "moe") for w, sf in ((c.w13, c.w13_sf), (c.w2, c.w2_sf)))
    tokens, top_k = c.topk_ids.shape
    flat = c.topk_ids.reshape(-1).long()
    # A -1 slot rides with expert 0 as a zero row (Humming's grouped layout has no row without an expert;
    # no host sync to count them) and its result is discarded: nothing of it, finite or not, is summed.
    valid = flat >= 0
    flat = torch.where(valid, flat, torch.zeros_like(flat))
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    rows = torch.where(valid[order].unsqueeze(1), x.index_select(0, order // top_k), zero)
    # Each expert's weight factor: its alpha times the activation scale it was made for (1 / its global scale).
    s13, s2 = (c.w13_alpha * c.a1_gscale).float(), (c.w2_alpha * c.a2_gscale).float()
    s13 = s13 if c13.prepared.scale_2 is None else s13 * c13.prepared.scale_2
    s2 = s2 if c2.prepared.scale_2 is None else s2 * c2.prepared.scale_2
    fc1 = torch.empty((rows.shape[0], c.w13.shape[1]), dtype=x.dtype, device=x.device)
    _first_call(c13.prepared, "moe", lambda: current_engine().grouped_gemm(c13.prepared, rows, s13, offsets, fc1))
    inter = c.w13.shape[1] // 2 if c.activation == "swiglu" else c.w13.shape[1]
    act = nvfp4.expert_activation(fc1.float(), c.activation, inter).to(x.dtype)
    fc2 = torch.empty((rows.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    _first_call(c2.prepared, "moe", lambda: current_engine().grouped_gemm(c2.prepared, act, s2, offsets, fc2))
    routed = torch.empty_like(fc2).index_copy_(0, order, fc2).view(tokens, top_k, -1).float()
    routed = torch.where(valid.view(tokens, top_k, 1), routed, torch.zeros((), device=x.device))
    c.out.copy_((routed * c.topk_weights.unsqueeze(-1)).sum(dim=1))
    return c.out


def startup() -> dict:
    """Return each kernel configuration's first call, the cache directory, and the converted layers' memory."""
    with lock:
        return {"cache_dir": cache_dir(), "configurations": dict(_startup), "memory": convert.memory()}


def describe_backend(family: str) -> dict:
    """Return what status and the report say about the Humming backend of `family` ("dense", "moe")."""
    info = startup()
    shown = (family, "dequant") if family == "dense" else (family,)  # keys: "<family> <label>", "dequant"
    engine = {"engine": current_engine().name, "humming_version": version(), "cache_dir": info["cache_dir"]}
    found = {"mode": DENSE_MODE if family == "dense" else MOE_MODE, **engine}
    configurations = {k: v for k, v in info["configurations"].items() if k.startswith(shown)}
    memory = {k: v for k, v in info["memory"].items() if k.startswith(family)}
    kept = {"kept_original_bytes": convert.kept_bytes(family)}  # the oracle's copies of converted layers
    return {
        **found,
        "converted_in_place": converted_layers(family),
        "configurations": configurations,
        "memory": memory,
        **kept,
    }


def doctor_info() -> dict:
    """Return the Humming version, its compiler here and its cache (for `sm120-fp4 doctor`)."""
    tool, how = compiler()
    found = {"version": version(), "compiler": tool, "compiler_detail": how, "cache_dir": cache_dir()}
    note = None if version() else f"the humming fallback needs `pip install {DISTRIBUTION}`"
    return {**found, "can_compile": tool is not None, "note": note}
