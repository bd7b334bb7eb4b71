"""This process's serving state, with one owner (:data:`STATE`): what install() and serving build up, and what
uninstall() forgets (:meth:`State.reset`). Module-level constants and caches of pure functions live beside their code.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pydantic import BaseModel

from .. import graphs, locks
from .. import report as report_file
from ..config import Settings
from ..deciding import Refusal

_LOG = logging.getLogger("sm120_fp4")


class Unverified(BaseModel):
    """Something served UNVERIFIED (SM120_FP4_SELFTEST=warn): which layer or call, and why nothing verifies it."""

    what: str
    reason: str


class State:
    """Every store of this process's serving, and the one lock over them (:attr:`lock`)."""

    def __init__(self) -> None:
        self.lock = locks.lock()
        self.records: dict[tuple[str, int], Any] = {}  # (family, device index) -> its records.Record: the one store
        # CUDA ordinal (-1: CPU in simulation) -> the callable serving it (None: the original); read on every
        # forward pass, written by publish() alone, emptied (never replaced) by reset().
        self.route_tables: dict[str, dict[int, Callable | None]] = {"dense": {}, "moe": {}}
        self.report = report_file.Writer()  # this process's report sections and its one writer thread
        self._fresh()

    def _fresh(self) -> None:
        """Set every store but the lock, the records, the route tables and the report to its empty value (the one
        list of them: __init__ and reset() alike)."""
        self.refusals: list[Refusal] = []
        self.unverified: list[Unverified] = []  # what SM120_FP4_SELFTEST=warn serves unverified
        self.verifying: dict[object, str] = {}  # what it self-tests now (the report), by check
        self.groups: list[Callable[[], object]] = []  # each engine home's tensor-parallel CPU group (use_group)
        # (family, backend) -> why: the candidates this process was told crashed a preflight worker (its --crashed)
        self.crashes: dict[tuple[str, str], str] = {}
        self.canary: Any = None  # this process's canary.Canary (SM120_FP4_CANARY), else None
        self.updating = 0  # the engine's weight updates in progress (weights_update_begin / _end)
        self.updating_since: float | None = None  # time.monotonic() when the open weight updates began
        self.last_settings: Settings | None = None  # the settings of the last decide() / verify_layer() (watchdog)
        self.rank: Callable[[], dict[str, int]] = dict  # the engine's ranks of this process (api wires the homes')

    def publish(self, record: Any) -> None:
        """Make `record`'s route table entry say what the store says now (under :attr:`lock`)."""
        table = self.route_tables[record.family.name]
        current = self.records.get((record.family.name, record.index))
        if current is not None and current.routed:
            table[record.index] = current.fn
        else:
            table.pop(record.index, None)

    def served(self) -> list[Any]:
        """Return every record routed to a backend of ours, in the order made."""
        with self.lock:
            return [r for r in self.records.values() if r.serving is not None]

    def reset(self) -> None:
        """Forget every decision, route, refusal, check under way, crash told, canary and report section (uninstall),
        undoing what a backend converted at load where it can; the report writes asked before land first (bounded)."""
        self.report.flush()
        with self.lock:
            dropped = [r for r in self.records.values() if r.serving is not None]
            self.records.clear()
            for table in self.route_tables.values():
                table.clear()
            self._fresh()
        self.report.sections.clear()
        graphs.clear()  # the checks' graphs (their memory) go with the layers they checked
        for record in dropped:
            stuck = record.release(record.decision.backend)
            if stuck is not None:
                _LOG.warning("sm120_fp4: %s: %s", record.device.label(), stuck)


STATE = State()
