"""Weight fingerprints: a few sums per tensor that any changed byte changes."""

from __future__ import annotations

import functools

import torch

__all__ = ["fingerprint"]


_FP_WIDTH = 4096  # words per row: the sums are kept per column of rows this wide
_FP_CHUNK = 1 << 26  # words summed at a time: a layer's weights never need more temporary memory than this


@functools.cache
def _fp_weighting(device: torch.device) -> torch.Tensor:
    """Return (1, 2, _FP_WIDTH) int64 ones and a fixed odd pattern on `device`, made once."""
    gen = torch.Generator().manual_seed(0x5EED)
    pattern = torch.randint(0, 1 << 30, (_FP_WIDTH,), generator=gen, dtype=torch.int64) * 2 + 1
    return torch.stack((torch.ones_like(pattern), pattern)).unsqueeze(0).to(device)


@functools.lru_cache(maxsize=4096)  # that one-element tensor made once: no launch per call
def _fp_size(device: torch.device, sizes: int) -> torch.Tensor:
    return torch.full((1,), sizes, dtype=torch.int64, device=device)


def fingerprint(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """Return a device tensor, made with no host sync, that changes when any byte of `tensors` changes."""
    # Each tensor's 32-bit words in rows of _FP_WIDTH, summed per column in 64 bits; per chunk the sum of those
    # sums and their sum weighted by a fixed odd pattern (wrapping: exact in any order): a changed word changes
    # its column, two swapped the weighted sum. The words past the last full row as they are; one element for
    # the sizes. Blind only to two words swapped _FP_WIDTH words apart, no write a kernel makes by mistake.
    chunks: list[torch.Tensor] = []
    tails: list[torch.Tensor] = []  # the words past each tensor's last full row (all of a small tensor)
    sizes = 0
    device = None
    step = _FP_CHUNK // _FP_WIDTH * _FP_WIDTH
    for t in tensors:
        flat = t.reshape(-1)  # a copy only for a non-contiguous tensor
        if flat.element_size() != 4:
            flat = flat.view(torch.uint8)
        words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.to(torch.int32)
        device = words.device
        full = words.numel() // _FP_WIDTH * _FP_WIDTH
        chunks.extend(words[lo : min(lo + step, full)].view(-1, _FP_WIDTH) for lo in range(0, full, step))
        if full < words.numel():
            tails.append(words[full:] if full else words)
        sizes = (sizes * 1_000_003 + t.numel() + 1) % (1 << 62)
    if device is None:
        return torch.zeros(0, dtype=torch.int64)
    parts = []
    if chunks:
        sums = torch.empty((len(chunks), _FP_WIDTH), dtype=torch.int64, device=device)
        for row, chunk in zip(sums, chunks):
            torch.sum(chunk, 0, dtype=torch.int64, out=row)
        parts.append((sums.unsqueeze(1) * _fp_weighting(device)).sum(2).flatten())
    if tails:
        parts.append((torch.cat(tails) if len(tails) > 1 else tails[0]).to(torch.int64))
    parts.append(_fp_size(device, sizes))
    return torch.cat(parts)
