"""Weight fingerprints: a few sums per tensor that any changed byte changes."""

from __future__ import annotations

import functools

import torch

__all__ = ["fingerprint"]


_FP_WIDTH = 4096  # words per row: the sums are kept per column of rows this wide


@functools.cache
def _fp_weighting(device: torch.device) -> torch.Tensor:
    """Return (2, _FP_WIDTH) int64 ones and a fixed odd pattern on `device`, made once."""
    gen = torch.Generator().manual_seed(0x5EED)
    pattern = torch.randint(0, 1 << 30, (_FP_WIDTH,), generator=gen, dtype=torch.int64) * 2 + 1
    return torch.stack((torch.ones_like(pattern), pattern)).to(device)


@functools.lru_cache(maxsize=4096)  # that one-element tensor made once: no launch per call
def _fp_size(device: torch.device, sizes: int) -> torch.Tensor:
    return torch.full((1,), sizes, dtype=torch.int64, device=device)


def fingerprint(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """Return a device tensor, made with no host sync, that changes when any byte of `tensors` changes."""
    # Each tensor's bytes as 64-bit words in rows of _FP_WIDTH, summed per column (int64, wrapping: exact in any
    # order, no widened copy: one pass at memory speed); per tensor the sum of those sums and their sum weighted
    # by a fixed odd pattern: a changed word changes its column, two swapped the weighted sum. The words past the
    # last full row and the last bytes as they are; one element for the sizes. Blind only to two
    # words swapped _FP_WIDTH words apart, no write a kernel makes by mistake.
    sums: list[torch.Tensor] = []
    tails: list[torch.Tensor] = []  # the bytes outside whole rows of words (all of a small tensor)
    sizes = 0
    device = None
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8)  # a copy only for a non-contiguous tensor
        if raw.storage_offset() % 8:
            raw = raw.clone()  # a view off 8-byte alignment (rare): its bytes, aligned
        device = raw.device
        words = raw[: raw.numel() // 8 * 8].view(torch.int64)
        full = words.numel() // _FP_WIDTH * _FP_WIDTH
        if full:
            sums.append(words[:full].view(-1, _FP_WIDTH).sum(0))
        tails += [words[full:], raw[words.numel() * 8 :].to(torch.int64)]
        sizes = (sizes * 1_000_003 + t.numel() + 1) % (1 << 62)
    if device is None:
        return torch.zeros(0, dtype=torch.int64)
    parts = [(torch.stack(sums).unsqueeze(1) * _fp_weighting(device)).sum(2).flatten()] if sums else []
    return torch.cat([*parts, *tails, _fp_size(device, sizes)])
