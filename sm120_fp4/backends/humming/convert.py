"""Each served layer converted to Humming's layout once, at load, into SGLang's own storage (the first of each
configuration keeps its original bytes for the oracle); weights unseen at load converted next to SGLang's."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import nvfp4
from ...devices import CHECK_MEMORY_BYTES
from ...errors import InvalidArgument, SelfTestError
from .engine import K_ALIGN, N_ALIGN, Prepared, current_engine, lock

_LOG = logging.getLogger("sm120_fp4")
# Keyed by the packed weight's storage pointer and IN_PLACE for a served layer converted at load, or the
# activation dtype for a copy made on first use.
IN_PLACE = "in-place"
converted: dict[tuple[int, object], Converted] = {}
_memory: dict[str, dict] = {}


@dataclass
class Converted:
    """A weight of SGLang's whose storage now holds Humming's layout (or next to which it lives)."""

    prepared: Prepared
    in_place: bool
    extra_bytes: int  # GPU bytes beyond SGLang's own tensors (scales that did not fit; a cache copy)
    family: str = "dense"
    originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # storage -> (copy, target)
    written: set[int] = field(default_factory=set)  # storages of SGLang's that now hold Humming's bytes
    owner: Any = None  # weakref to the tensor whose storage is the key: a dead one means a stale record


def forget() -> None:
    """Forget every conversion record (converted storages stay converted)."""
    with lock:
        converted.clear()
        _memory.clear()


def memory() -> dict[str, dict]:
    """Return the memory of converted layers against their NVFP4 tensors, per configuration: converted in place,
    and (while their layers live) Humming's layouts held next to the checkpoint's bytes (SELECT=fastest)."""
    with lock:
        found = {k: dict(v) for k, v in _memory.items()}
        for (_, how), conv in converted.items():
            if how != IN_PLACE and conv.owner() is not None:
                fresh = {"layers": 0, "in_place": False, "extra_bytes": 0}
                entry = found.setdefault(f"{conv.family} {conv.prepared.label} next to the checkpoint's bytes", fresh)
                entry["layers"] += 1
                entry["extra_bytes"] += conv.extra_bytes
        return found


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _write_into(src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Copy `src`'s bytes to the start of `target`'s storage; return a view of them with src's shape/dtype."""
    flat = torch.empty(0, dtype=torch.uint8, device=target.device).set_(target.untyped_storage())
    flat[: src.nbytes].copy_(src.contiguous().view(-1).view(torch.uint8))
    return flat[: src.nbytes].view(src.dtype).view(src.shape)


def _unswizzle(sf: torch.Tensor, rows: int, k: int, experts: int | None) -> torch.Tensor:
    """Return linear (E?, rows, k/16) float8_e4m3fn scales from 128x4-swizzled ones (one layout per expert)."""
    sf = sf.view(torch.float8_e4m3fn) if sf.dtype == torch.uint8 else sf
    if experts is None:
        return nvfp4.unswizzle_scales(sf.contiguous(), rows, k)
    per = sf.reshape(experts, -1)
    return torch.stack([nvfp4.unswizzle_scales(per[e].contiguous(), rows, k) for e in range(experts)])


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _convert(weight, sf_swizzled, dtype, experts: int | None, family: str, in_place: bool, keep=False) -> Converted:
    """Convert one weight to Humming's layout: into SGLang's storage (`in_place`), or next to it."""
    rows, k = weight.shape[-2], weight.shape[-1] * 2
    in_place = in_place and not (rows % N_ALIGN or k % K_ALIGN)  # a padded layout does not fit SGLang's storage
    prepared = current_engine().prepare(weight.contiguous(), _unswizzle(sf_swizzled, rows, k, experts), dtype, experts)
    extra = 0 if in_place else sum(t.nbytes for t in prepared.tensors.values())
    conv = Converted(prepared, in_place, extra, family, owner=weakref.ref(_root(weight)))
    if not in_place:
        return conv
    # Written into SGLang's storage (`keep`: a device copy of what they overwrite).
    new = dict(prepared.tensors)
    for name, target in (("weight", weight), ("weight_scale", sf_swizzled)):
        src = new[name]
        # `src`'s bytes fit in `target`'s own storage (target a contiguous tensor starting it), or not
        fits = src.nbytes <= target.untyped_storage().nbytes() and src.is_contiguous()
        if not (fits and target.is_contiguous() and target.storage_offset() == 0):
            if name == "weight":
                raise SelfTestError(
                    f"sm120_fp4: Humming's layout of a {tuple(weight.shape)} weight does not fit SGLang's storage of it"
                )
            conv.extra_bytes += src.nbytes  # kept next to SGLang's (smaller) swizzled scales
            continue
        key = storage_key(target)
        if keep:  # the oracle reads it during the check: on the GPU below the check's memory bound, else the host's
            small = target.nbytes <= CHECK_MEMORY_BYTES // 4
            conv.originals[key] = (target.detach().clone() if small else _host_copy(target), target)
        new[name] = _write_into(src, target)
        conv.written.add(key)
    prepared.tensors = new
    return conv


def _prepare(weight, sf, dtype, experts: int | None, family: str, keep: bool, label: str) -> None:
    key = (storage_key(weight), IN_PLACE)
    with lock:
        if key in converted:
            return
        conv = converted[key] = _convert(weight, sf, dtype, experts, family, True, keep)
        converted.pop((key[0], dtype), None)  # a layout made next to it before (SELECT=fastest) is no longer read
        nvfp4_bytes = weight.nbytes + sf.nbytes
        fresh = {"layers": 0, "in_place": conv.in_place, "nvfp4_bytes": nvfp4_bytes, "extra_bytes": conv.extra_bytes}
        entry = _memory.setdefault(f"{label} {conv.prepared.label}", fresh)
        entry["layers"] += 1
        entry["ratio"] = round((nvfp4_bytes + conv.extra_bytes) / nvfp4_bytes, 4)


def prepare_dense(weight: torch.Tensor, weight_sf: torch.Tensor, dtype: torch.dtype, keep_original: bool) -> None:
    """Convert one served dense layer in place, at load (`keep_original`: its bytes kept for the oracle)."""
    _prepare(weight, weight_sf, dtype, None, "dense", keep_original, "dense")


def prepare_moe(weights: dict, dtype: torch.dtype, keep_original: bool) -> None:
    """Convert one served MoE layer's w13 and w2 in place (reference_moe_fp4's names in `weights`)."""
    with lock:
        for w in ("w13", "w2"):
            _prepare(weights[w], weights[f"{w}_sf"], dtype, weights["w13"].shape[0], "moe", keep_original, f"moe {w}")


def original(t: torch.Tensor) -> torch.Tensor:
    """Return `t` as the checkpoint has it: its kept bytes where Humming converted it in place, else `t`."""
    key = storage_key(t)
    with lock:
        for conv in converted.values():
            kept = conv.originals.get(key)
            if kept is not None:
                # On the device while checked; from pinned host memory for good (ordered on the current stream).
                # A MoE layer's stays there: the oracle copies each expert it reads.
                host = conv.family == "moe" and not kept[0].is_cuda
                copy = kept[0] if host else kept[0].to(t.device, non_blocking=kept[0].is_pinned())
                if copy.dtype != t.dtype or tuple(copy.shape) != tuple(t.shape):
                    copy = copy.reshape(-1).view(torch.uint8)[: t.nbytes].view(t.dtype).view(t.shape)
                return copy
            if conv.in_place and key in conv.written:  # never a guess
                raise SelfTestError(
                    "sm120_fp4: this weight was converted to Humming's layout in place and its "
                    "original bytes were not kept; the oracle cannot read it"
                )
    return t


def drop_originals(tensors: dict, keep: bool = False) -> None:
    """End one converted layer's check: drop its kept bytes, or (`keep`) move them to pinned host memory."""
    # `keep`: the first layer of its configuration, which the re-checks and the canary compare; pinned
    # memory holds no GPU memory and each later oracle read is one host-to-device copy.
    with lock:
        weights = [tensors.get(name) for name in ("weight", "w13", "w2")]
        found = [converted.get((storage_key(t), IN_PLACE)) for t in weights if isinstance(t, torch.Tensor)]
        for conv in (c for c in found if c is not None):
            if not keep:
                conv.originals.clear()
                continue
            for key, (copy, target) in [(k, v) for k, v in conv.originals.items() if v[0].is_cuda]:
                conv.originals[key] = (_host_copy(copy), target)  # synchronous: the device copy is freed here


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """Return a copy of `t` in (pinned, where CUDA is) host memory."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t)


def kept_bytes(family: str) -> dict[str, int]:
    """Return the original bytes kept of `family`'s converted layers, on the GPU and in host memory."""
    with lock:
        kept = [c for conv in converted.values() if conv.family == family for c, _ in conv.originals.values()]
    return {"gpu": sum(c.nbytes for c in kept if c.is_cuda), "host": sum(c.nbytes for c in kept if not c.is_cuda)}


def converted_layers(family: str) -> int:
    """Return how many `family` weights this process converted in place (another backend cannot read them)."""
    with lock:
        return sum(1 for c in converted.values() if c.in_place and c.family == family)


def restore(family: str) -> bool:
    """Write the kept original bytes back wherever `family` was converted in place; True: every one was."""
    with lock:
        complete = True
        for key, conv in list(converted.items()):
            if conv.family != family:
                continue
            if conv.in_place and not conv.originals:
                complete = False  # no kept copy: it stays converted, only Humming can serve it
                continue
            for copy, target in conv.originals.values():
                _write_into(copy.to(target.device), target)
            del converted[key]
        return complete


def prepared_for(weight: torch.Tensor, dtype: torch.dtype) -> Prepared | None:
    """Return the conversion serving `weight` for `dtype` activations, or None (benchmarks, tests)."""
    key = storage_key(weight)
    conv = converted.get((key, IN_PLACE)) or converted.get((key, dtype))
    return None if conv is None else conv.prepared


def conversion(weight, sf_swizzled, dtype: torch.dtype, experts: int | None, family: str) -> Converted:
    """Return the conversion of `weight`: made in place at load, or now next to it (outside capture only)."""
    ptr = storage_key(weight)
    conv = converted.get((ptr, IN_PLACE))
    if conv is not None and conv.owner() is not None:
        if conv.prepared.dtype != dtype:
            raise InvalidArgument(
                f"humming: this layer was converted for {conv.prepared.dtype} activations at load; called with {dtype}"
            )
        return conv
    if conv is not None:
        with lock:  # the weight it was made for is gone; this is another tensor at the same address
            converted.pop((ptr, IN_PLACE), None)
    key = (ptr, dtype)
    conv = converted.get(key)
    if conv is not None and conv.owner() is not None:
        return conv
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SelfTestError(
            "sm120_fp4: a weight Humming never saw at load reached it inside CUDA-graph capture; "
            "converting it there is impossible (the layer check converts every served layer at load)"
        )
    with lock:
        conv = converted[key] = _convert(weight, sf_swizzled, dtype, experts, family, in_place=False)
        weakref.finalize(_root(weight), converted.pop, key, None)
    _LOG.debug("sm120_fp4: Humming converted a %s weight next to SGLang's on first use", conv.prepared.label)
    return conv
