"""The check data: structured and seeded activations, and quantized GEMM inputs."""

from __future__ import annotations

import threading

import torch

from .. import nvfp4
from ..devices import CHECK_MEMORY_BYTES

__all__ = ["Shape", "quantized_inputs", "structured_activations", "seeded_activations", "ROW_KINDS"]


Shape = tuple[int, int, int]  # (M, N, K)


def _row_ranges(rows: list[int], limit: int = 4) -> str:
    """Return sorted `rows` as ranges ("3, 5-9, ..."), the first `limit` of them."""
    spans: list[list[int]] = []
    for r in rows:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:limit])
    return text + (", ..." if len(spans) > limit else "")


ROW_KINDS = (
    "gaussian",
    "gaussian, an octave apart",
    "ReLU^2 (non-negative, half zero)",
    "sparse (90% zero)",
    "sign-structured (one sign per 16-block)",
    "outliers (1e3-1e4 x the rest)",
    "tiny (subnormal E4M3 block scales)",
    "half tiny, half normal blocks",
)


def structured_activations(
    rows: int, cols: int, amax: float, generator: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Return float32 activations (rows, cols) in [-amax, amax], row i of kind ROW_KINDS[i % 8], none all zero."""
    # What models feed a GEMM besides Gaussian noise. `generator` lives on `device` (no host copy).
    g = generator
    kind = torch.arange(rows, device=device).remainder(len(ROW_KINDS)).unsqueeze(1)
    base = torch.randn(rows, cols, generator=g, device=device)
    octave = torch.exp2(torch.randint(-2, 1, (rows, 1), generator=g, device=device).float())
    u = torch.rand(rows, cols, generator=g, device=device)
    block = torch.arange(cols, device=device).div(16, rounding_mode="floor").remainder(2).unsqueeze(0) * 2 - 1
    x = base * (amax / 4)
    x = torch.where(kind == 1, base * octave * (amax / 4), x)
    x = torch.where(kind == 2, torch.relu(base).square() * (amax / 16), x)
    x = torch.where(kind == 3, torch.where(u < 0.9, torch.zeros_like(base), base * (amax / 4)), x)
    x = torch.where(kind == 4, base.abs() * block * (amax / 4), x)
    outliers = torch.where(u < 1 / 64, torch.sign(base) * (amax / 2), base * (amax / 2) / (1e3 + 9e3 * u))
    x = torch.where(kind == 5, outliers, x)
    tiny = base * (amax * 4e-6)  # block amax ~1e-5 * amax: E4M3 scale ~0.005, below its smallest normal 2^-6
    x = torch.where(kind == 6, tiny, x)
    x = torch.where(kind == 7, torch.where(block > 0, tiny, base * (amax / 4)), x)
    x[:, 0] = torch.where(x[:, 0] == 0, torch.full_like(x[:, 0], amax / 8), x[:, 0])  # no all-zero row
    return x.clamp(-amax, amax)


_SEEDED_ELEMENTS = 1 << 22  # seeded activations kept per (device, shape, seed) up to this size (decode batch sizes)
_SEEDED_BUDGET = 1 << 24  # and this many in all (64 MB of float32 per process)
_seeded: dict[tuple, torch.Tensor] = {}
_seeded_lock = threading.Lock()


def seeded_activations(
    rows: int, cols: int, amax: float, seed: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Return structured_activations seeded with `seed` on `device`, scaled to [-amax, amax], as `dtype`."""
    # A decode batch's unscaled rows are kept per (device, shape, seed): every layer's check scales the same.
    key = (torch.device(device), rows, cols, seed)
    with _seeded_lock:
        unit = _seeded.pop(key, None)
        if unit is not None:
            _seeded[key] = unit  # most recently used last
    if unit is not None:
        return (unit * amax).to(dtype)
    # Made where it is used (no host copy), in slices of rows whose float32 temporaries (about eight) stay
    # within a quarter of the check's memory bound; each slice seeded on its own (the first with `seed`).
    step = max(8, CHECK_MEMORY_BYTES // 4 // (32 * max(cols, 1)) // 8 * 8)
    whole = torch.empty((rows, cols), dtype=dtype, device=device) if rows > step else None  # slices written in
    for i, lo in enumerate(range(0, rows, step)):
        gen = torch.Generator(device=device).manual_seed(seed + 7919 * i)
        unit = structured_activations(min(step, rows - lo), cols, 1.0, gen, device)
        if whole is not None:
            whole[lo : lo + step] = unit * amax
    if whole is not None:
        return whole
    if rows * cols <= _SEEDED_ELEMENTS:
        with _seeded_lock:
            _seeded[key] = unit
            while sum(t.numel() for t in _seeded.values()) > _SEEDED_BUDGET:
                _seeded.pop(next(iter(_seeded)))
    return (unit * amax).to(dtype)


def quantized_inputs(shape: Shape, device: torch.device, seed: int):
    """Return seeded bf16 activations and weights of `shape` quantized: (x, gsf_x, mm_fp4 args)."""
    # Activation scales as uint8 (SGLang's quantizer), the weight's as float8_e4m3fn (its storage): a kernel
    # must read both as E4M3 bytes. Weights with zeroed rows and rows small enough for subnormal E4M3 scales.
    m, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    x = structured_activations(m, k, 8.0, gen)
    w = torch.randn(n, k, generator=gen) * 0.02
    row = torch.arange(n).unsqueeze(1) % 13
    w = torch.where(row == 5, torch.zeros_like(w), torch.where(row == 9, w * 2e-5, w))
    x, w = x.to(torch.bfloat16).to(device), w.to(torch.bfloat16).to(device)
    gx, gw = nvfp4.global_scale(x), nvfp4.global_scale(w)
    qx, sx = nvfp4.quantize(x, gx)
    qw, sw = nvfp4.quantize(w, gw)
    alpha = (1.0 / (gx * gw)).reshape(1).to(torch.float32)
    return x, gx, (qx, qw.T, sx.view(torch.uint8), sw.T, alpha)
