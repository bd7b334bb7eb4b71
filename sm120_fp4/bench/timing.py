"""What ``sm120-fp4 bench`` times (each backend's call, the bf16 yardstick) and the timer."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import nvfp4, verify
from ..backends import flashinfer

REPEATS = {"cuda": 20, "cpu": 3}
_FLUSH_MIN_BYTES = 256 << 20  # the L2 flush buffer: at least twice the largest L2 of these GPUs (128 MiB)


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


class Timer:
    """Median time of one call: a CUDA-graph replay per sample (else eager), L2 flushed; perf_counter on a CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats, self._flush = device, repeats, None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
            self._flush = torch.empty(max(_FLUSH_MIN_BYTES, 2 * l2), dtype=torch.uint8, device=device)

    def time(self, call: Callable[[], object], tune: bool) -> tuple[float, str]:
        """Return (median seconds, how: "graph", "eager: <why>" or "cpu")."""
        if self.device.type != "cuda":
            call()
            return statistics.median(_elapsed(call) for _ in range(self.repeats)), "cpu"
        with torch.cuda.device(self.device):
            if tune:
                with flashinfer.autotuning():
                    call()  # FlashInfer profiles its tactics for this shape, as a server's warm-up does
            call()
            torch.cuda.synchronize(self.device)
            step, how = self._captured(call)
            step()
            return statistics.median(self._sample(step) for _ in range(self.repeats)), how

    def _captured(self, call: Callable[[], object]) -> tuple[Callable[[], object], str]:
        """Return (a CUDA-graph replay of `call`, "graph"), or (`call`, "eager: <why>") where it cannot be captured."""
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                call()  # warm on the side stream, as torch's capture recipe asks
            torch.cuda.current_stream(self.device).wait_stream(stream)
            with torch.cuda.graph(graph):
                call()
            return graph.replay, "graph"
        except Exception as exc:
            torch.cuda.synchronize(self.device)
            return call, f"eager: {first_line(exc)}"[:120]

    def _sample(self, step: Callable[[], object]) -> float:
        self._flush.zero_()  # cold L2: the weights come from memory, as in a server's many layers
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def _elapsed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
