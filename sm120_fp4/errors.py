"""The library's exceptions: one root, so callers can catch everything of ours at once."""

from __future__ import annotations

import logging

# The exit code the self-test's watchdog ends a process with when a checked call outlives its bound.
EXIT_HUNG = 4


class Sm120Fp4Error(Exception):
    """Root of every error raised by sm120_fp4."""


class InvalidArgument(Sm120Fp4Error, ValueError):
    """A function was called with a value it does not accept; the message names it."""


class ConfigError(Sm120Fp4Error, ValueError):
    """A setting (keyword or SM120_FP4_* variable) has a value that is not accepted."""


class CheckpointError(Sm120Fp4Error, ValueError):
    """A checkpoint's files or NVFP4 tensors are not what its layers need (a fault of the checkpoint, not a kernel)."""


class SelfTestError(Sm120Fp4Error, RuntimeError):
    """A self-test could not be run at all (for example, asked for inside CUDA-graph capture)."""


class RefusedToServe(Sm120Fp4Error, RuntimeError):
    """No FP4 backend verified on this device, for this layer or while serving: serving would risk garbage."""


def describe(value: object, limit: int = 80) -> str:
    """Return a short repr for error messages: tensors by shape/dtype/device, the rest by repr cut at `limit` characters."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        device = getattr(value, "device", "?")
        return f"tensor(shape={tuple(shape)}, dtype={dtype}, device={device})"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def not_accepted(func: str, param: str, value: object, accepted: str) -> InvalidArgument:
    """Return the InvalidArgument naming the function, the parameter, the value and what is accepted."""
    return InvalidArgument(f"{func}: {param}={describe(value)} is not accepted; expected {accepted}")


def check_ranks(func: str, ep_size: int, ep_rank: int, tp_size: int, tp_rank: int) -> None:
    """Check expert- and tensor-parallel sizes (ints >= 1) and ranks (ints in [0, size))."""
    for size, rank, what in ((ep_size, ep_rank, "ep"), (tp_size, tp_rank, "tp")):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise not_accepted(func, f"{what}_size", size, "an int >= 1")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
            raise not_accepted(func, f"{what}_rank", rank, f"an int in [0, {what}_size={size})")


def capped(items, limit: int = 8) -> str:
    """Return a user-supplied list for a message: at most `limit` entries, then "and N more"."""
    items = list(items)
    shown = ", ".join(describe(i) for i in items[:limit])
    return f"[{shown}{f', and {len(items) - limit} more' if len(items) > limit else ''}]"


class DeviceMappingError(Sm120Fp4Error, LookupError):
    """Which physical GPU a CUDA ordinal is cannot be determined here; the message says why and the fix."""

    def __init__(self, message: str, candidates: list | None = None) -> None:
        super().__init__(message)
        self.candidates = list(candidates or [])  # every device that may be visible, unnumbered


_said: set[str] = set()


def say_once(level: int, message: str, *args: object) -> None:
    """Log `message % args` on the library's logger once per process (a worked-around failure)."""
    text = message % args if args else message
    if text in _said:
        return
    _said.add(text)
    logging.getLogger("sm120_fp4").log(level, "%s", text)
