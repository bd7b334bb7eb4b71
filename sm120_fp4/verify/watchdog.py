"""The checked call on the serving thread and the watchdog that only observes it."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable

import torch

from .. import locks
from ..errors import EXIT_HUNG

__all__ = ["EXIT_HUNG", "hang_grace", "calls_still_running", "hang_hooks"]

# A checked call runs on the thread and CUDA stream that will serve. One still running past its bound plus
# the grace holds that thread for good: the watchdog runs hang_hooks (the report) and exits with EXIT_HUNG.
hang_hooks: list[Callable[[str], None]] = []  # called with the message before the process ends


def hang_grace(timeout_s: float) -> float:
    """Return how long past its bound a running call is waited for before the process gives up."""
    return min(max(5.0, 0.1 * timeout_s), 60.0)


class _Watchdog:
    """Watches the checked calls in progress (one per thread); never runs one."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Start from a fresh state (also in a fork() child, whose parent's lock may be held)."""
        self._cond = threading.Condition(locks.lock())
        self._watches: dict[int, tuple[float, float, str]] = {}  # token -> (deadline, give up at, what)
        self._next = 0
        self._thread: threading.Thread | None = None

    def watch(self, deadline: float, give_up_at: float, what: str) -> int:
        with self._cond:
            self._next += 1
            self._watches[self._next] = (deadline, give_up_at, what)
            if self._thread is None or not self._thread.is_alive():
                _reset_in_fork_children()
                self._thread = threading.Thread(target=self._run, name="sm120_fp4-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def done(self, token: int) -> None:
        with self._cond:
            self._watches.pop(token, None)
            self._cond.notify()

    def overdue(self) -> int:
        now = time.perf_counter()
        with self._cond:
            return sum(1 for deadline, _, _ in self._watches.values() if now > deadline)

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._watches:
                    self._cond.wait()
                    continue
                token, (_, give_up_at, what) = min(self._watches.items(), key=lambda item: item[1][1])
                left = give_up_at - time.perf_counter()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._watches.pop(token)
                break
        _give_up(what)


def _give_up(what: str) -> None:
    message = (
        f"sm120_fp4: refusing to serve: {what} is still running past the self-test's time bound "
        "(SM120_FP4_SELFTEST_TIMEOUT): a hung kernel holds the thread that would serve, so this process "
        f"cannot continue; exiting with code {EXIT_HUNG}. Exclude that backend (SM120_FP4_BACKENDS / "
        "SM120_FP4_MOE_BACKENDS), or run `sm120-fp4 selftest`, which records it and re-runs without it."
    )
    for hook in list(hang_hooks):
        try:
            hook(message)
        except Exception:
            pass
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(EXIT_HUNG)


_WATCHDOG = _Watchdog()
_fork_reset: list[bool] = []  # whether the fork() reset is registered (once per process, at the first watch)


def _reset_in_fork_children() -> None:
    """Register, once, that a fork() child starts with a fresh watchdog (before any watch it is fresh)."""
    if not _fork_reset:
        _fork_reset.append(True)
        os.register_at_fork(after_in_child=_WATCHDOG._reset)


def calls_still_running() -> int:
    """Return how many checked calls are running past their bound (non-zero only during the grace)."""
    return _WATCHDOG.overdue()


def _call(fn: Callable[[], object], device: torch.device, deadline: float, give_up_at: float, what: str) -> object:
    """Return fn()'s value or Exception, run on this thread and stream and synchronised."""
    # A BaseException such as KeyboardInterrupt propagates: an interrupted check is never a result.
    token = _WATCHDOG.watch(deadline, give_up_at, what)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            value = fn()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the stream that serves, not the device
        return value
    except torch.OutOfMemoryError:
        raise  # the check could not get its memory: the caller's skip, not the kernel's finding
    except Exception as exc:
        return exc
    finally:
        _WATCHDOG.done(token)
