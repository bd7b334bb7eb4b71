"""What ``sm120-fp4 bench`` times (each backend's call, the bf16 yardstick) and the timer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import deciding, nvfp4, verify
from ..backends import flashinfer

REPEATS = 20  # samples on a GPU (3 on a CPU, where the times only show that the command works)


@dataclass(frozen=True)
class DenseShape:
    """One served dense layer configuration: out = x (M, K) @ W (N, K).T."""

    n: int
    k: int

    def label(self) -> str:
        return f"N={self.n} K={self.k}"

    def flops(self, m: int) -> float:
        return 2.0 * m * self.n * self.k


@dataclass(frozen=True)
class MoeShape:
    """One served MoE layer configuration: E experts, top-k routing, hidden H, intermediate I."""

    experts: int
    top_k: int
    hidden: int
    inter: int
    gated: bool = True  # gate and up projections (SwiGLU); False: one projection (ReLU^2)

    @property
    def activation(self) -> str:
        return "swiglu" if self.gated else "relu2"

    def label(self) -> str:
        return f"E={self.experts} top_k={self.top_k} H={self.hidden} I={self.inter} {self.activation}"

    def flops(self, m: int) -> float:
        fc1 = (2 if self.gated else 1) * self.inter * self.hidden
        return 2.0 * m * self.top_k * (fc1 + self.inter * self.hidden)


def dense_call(fn: Callable, weights: None, config: DenseShape, m: int, device: torch.device) -> Callable[[], object]:
    _, _, args = verify.quantized_inputs((m, config.n, config.k), device, seed=m)
    out = torch.empty((m, config.n), dtype=torch.bfloat16, device=device)
    return lambda: fn(*args, torch.bfloat16, out)


def dense_bf16(config: DenseShape, m: int, device: torch.device) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, config.k, generator=gen).to(torch.bfloat16).to(device)
    w = torch.randn(config.n, config.k, generator=gen).to(torch.bfloat16).to(device)
    out = torch.empty((m, config.n), dtype=torch.bfloat16, device=device)
    return lambda: torch.matmul(x, w.T, out=out)


def moe_call(fn: Callable, weights: nvfp4.MoeWeights, config: MoeShape, m: int, device) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(m)
    ids, topk_weights = verify.moe_routing(m, config.top_k, config.experts, "balanced", gen)
    x = verify.structured_activations(m, config.hidden, 4.0, gen).to(torch.bfloat16).to(device)
    ids, topk_weights, out = ids.to(device), topk_weights.to(device), torch.empty_like(x)
    return lambda: fn(x, ids, topk_weights, *weights, config.activation, x.dtype, out)


def moe_bf16(config: MoeShape, m: int, device: torch.device) -> Callable[[], object]:
    """Return the MoE yardstick: bf16 bmm FC1, activation, FC2 over the experts a balanced routing touches."""
    active = min(config.experts, m * config.top_k)
    rows = math.ceil(m * config.top_k / active)
    gen = torch.Generator().manual_seed(m)
    rows13 = (2 if config.gated else 1) * config.inter
    x = torch.randn(active, rows, config.hidden, generator=gen).to(torch.bfloat16).to(device)
    w13 = (torch.randn(active, config.hidden, rows13, generator=gen) * 0.05).to(torch.bfloat16).to(device)
    w2 = (torch.randn(active, config.inter, config.hidden, generator=gen) * 0.05).to(torch.bfloat16).to(device)
    h = torch.empty(active, rows, rows13, dtype=torch.bfloat16, device=device)
    out = torch.empty(active, rows, config.hidden, dtype=torch.bfloat16, device=device)

    def call():
        torch.bmm(x, w13, out=h)
        if config.gated:
            gate, up = h.chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
        else:
            act = torch.relu(h).square()
        return torch.bmm(act, w2, out=out)

    return call


def time_one(call: Callable[[], object], tune: bool, device: torch.device) -> tuple[float, str]:
    """Return (median seconds, how) of `call` by the library's one timer, after FlashInfer's autotune where `tune`."""
    if tune:
        with flashinfer.autotuning():
            call()  # FlashInfer profiles its tactics for this shape, as a server's warm-up does
    return deciding.timed(call, device, REPEATS if device.type == "cuda" else 3)
