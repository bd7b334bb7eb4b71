"""Locks that a fork() child gets back unlocked (stdlib only).

A process may fork while another of its threads holds one of this library's locks -- a self-test
holds its device's decision lock for seconds to minutes. The child has only the forking thread, so
a lock copied locked would never be released there: the child's first decide(), status() or
install() would wait forever. Every lock of this library is made here, and the child re-initialises
them all (os.register_at_fork). What the lock guarded is then as the parent's other thread left it:
a decision half-made in the parent simply does not exist in the child, which makes its own.
"""

from __future__ import annotations

import os
import threading
import weakref

__all__ = ["lock", "rlock"]

_made: weakref.WeakSet = weakref.WeakSet()


def lock() -> threading.Lock:
    """A threading.Lock, unlocked again in a fork() child."""
    made = threading.Lock()
    _made.add(made)
    return made


def rlock() -> threading.RLock:
    """A threading.RLock, unlocked again in a fork() child."""
    made = threading.RLock()
    _made.add(made)
    return made


def _after_fork_in_child() -> None:
    for made in list(_made):
        made._at_fork_reinit()  # CPython's own at-fork re-initialisation (threading and logging use it)


os.register_at_fork(after_in_child=_after_fork_in_child)
