"""What every command shares: the exit codes (the package docstring says what each means), output helpers."""

from __future__ import annotations

import json
import sys
from typing import Any

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNVERIFIED = 0, 1, 2, 3


def _eprint(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def _where(index: int) -> str:
    """Return how progress lines name a device."""
    return "cpu (simulated)" if index < 0 else f"cuda:{index}"


def _emit(payload: dict) -> None:
    print(json.dumps(payload), flush=True)  # flushed: the parent reads it even if this process dies next
