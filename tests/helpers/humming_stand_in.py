"""A pure-PyTorch stand-in for Humming (tests only): it computes what Humming would, in a layout of
its own, so the wiring around the kernel (conversion in place, the kept originals, the backends'
conventions, mode W4A4/W4A16, JIT bookkeeping) is tested where Humming cannot run (a CPU).

The stand-in's layout is not ModelOpt's: the packed codes are stored with their rows reversed and
each byte's nibbles swapped, the scales transposed to (K/16, N), so a conversion in place visibly
changes SGLang's bytes and any reader of the old layout gets wrong numbers. `WrongScaleLayout`
wraps an engine (this one or the real Humming) and hands it SGLang's swizzled scale bytes as if they
were linear: the mistake every NVFP4 integration can make, which the self-test must refuse.
"""

from __future__ import annotations

import contextlib

import torch

from sm120_fp4 import nvfp4
from sm120_fp4.backends import humming


def _swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return ((packed & 0x0F) << 4) | (packed >> 4)


class StandInEngine(humming.Engine):
    """Humming's job, done by nvfp4's decode and a float32 matmul."""

    name = "stand-in"

    def __init__(self) -> None:
        self.prepared = 0
        self.calls = 0

    def unusable(self, device):
        return None

    def prepare(self, weight, scale, dtype, experts):
        self.prepared += 1
        n, k = weight.shape[-2], weight.shape[-1] * 2
        tensors = {
            "weight": _swap_nibbles(weight.flip(-2)).contiguous(),
            "weight_scale": scale.transpose(-1, -2).contiguous(),
        }
        label = f"N={n} K={k}" + (f" E={experts}" if experts else "") + f" {str(dtype).removeprefix('torch.')}"
        return humming.Prepared(tensors, {"stand-in": True}, label, n, k, experts, dtype)

    @staticmethod
    def _dense(tensors: dict, expert: int | None = None) -> torch.Tensor:
        packed, scale = tensors["weight"], tensors["weight_scale"]
        if expert is not None:
            packed, scale = packed[expert], scale[expert]
        codes = nvfp4.unpack_nibbles(_swap_nibbles(packed.flip(-2)))
        values = torch.tensor(nvfp4.E2M1_VALUES, device=codes.device)[codes.long()]
        return values * scale.transpose(-1, -2).float().repeat_interleave(nvfp4.BLOCK_SIZE, dim=-1)

    def gemm(self, prepared, x, scale_2, out):
        self.calls += 1
        out.copy_((x.float() @ self._dense(prepared.tensors).T) * scale_2.float().reshape(()))

    def grouped_gemm(self, prepared, x, scale_2, offsets, out):
        self.calls += 1
        bounds = offsets.tolist()  # a stand-in may synchronise; Humming's kernel reads offsets on the device
        for e in range(len(bounds) - 1):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                out[lo:hi] = ((x[lo:hi].float() @ self._dense(prepared.tensors, e).T) * scale_2[e].float()).to(
                    out.dtype
                )


class WrongScaleLayout(humming.Engine):
    """`inner` given the 128x4-swizzled scale bytes as if they were the linear (N, K/16) ones."""

    def __init__(self, inner: humming.Engine) -> None:
        self.inner = inner
        self.name = f"{inner.name} (wrong scale layout)"

    def unusable(self, device):
        return self.inner.unusable(device)

    def prepare(self, weight, scale, dtype, experts):
        rows, groups = scale.shape[-2], scale.shape[-1]
        if experts:
            wrong = torch.stack(
                [nvfp4.swizzle_scales(scale[e]).reshape(-1)[: rows * groups].view(rows, groups) for e in range(experts)]
            )
        else:
            wrong = nvfp4.swizzle_scales(scale).reshape(-1)[: rows * groups].view(rows, groups)
        return self.inner.prepare(weight, wrong.contiguous(), dtype, experts)

    def gemm(self, prepared, x, scale_2, out):
        self.inner.gemm(prepared, x, scale_2, out)

    def grouped_gemm(self, prepared, x, scale_2, offsets, out):
        self.inner.grouped_gemm(prepared, x, scale_2, offsets, out)


@contextlib.contextmanager
def engine(which: humming.Engine):
    """Use `which` in Humming's place for the block; the previous engine afterwards."""
    previous = humming.use_engine(which)
    try:
        yield which
    finally:
        humming.use_engine(previous)
