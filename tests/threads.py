"""Run test code from many threads at once."""

from __future__ import annotations

import threading
from typing import Callable, Iterable


def run_concurrently(target: Callable, argument_tuples: Iterable[tuple]) -> None:
    """Start one thread per argument tuple, then wait for all of them."""
    threads = [threading.Thread(target=target, args=args) for args in argument_tuples]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
