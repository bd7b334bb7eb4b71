"""Locks that a fork() child gets back unlocked (stdlib only).

A child of a fork() while another thread held a lock would wait forever on it: every lock of this library is made
here and re-initialised in the child (os.register_at_fork, at the first lock made)."""

from __future__ import annotations

import os
import threading
import weakref

_made: weakref.WeakSet = weakref.WeakSet()
_registered: list[bool] = []  # whether the fork() hook is registered: with the first lock, never at import


def _track(made):
    if not _registered:
        _registered.append(True)
        os.register_at_fork(after_in_child=_after_fork_in_child)
    _made.add(made)
    return made


def lock() -> threading.Lock:
    """Return a threading.Lock, unlocked again in a fork() child."""
    return _track(threading.Lock())


def rlock() -> threading.RLock:
    """Return a threading.RLock, unlocked again in a fork() child."""
    return _track(threading.RLock())


def _after_fork_in_child() -> None:
    for made in list(_made):
        made._at_fork_reinit()  # CPython's own at-fork re-initialisation (threading and logging use it)
