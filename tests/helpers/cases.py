"""The reliability cases behind RELIABILITY.md: ``@case(area, case, expected)`` on a test.

conftest.py records each case's three fields as JUnit properties of its test;
``scripts/reliability_table.py`` runs every test file that declares cases and renders the table from
the JUnit XML. :func:`declared_cases` lists the cases without running anything (the staleness check).
"""

from __future__ import annotations

import importlib
import itertools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# area -> the issue item it belongs to; the table lists areas in this order.
# The areas, in the order RELIABILITY.md lists them.
AREAS = (
    "configuration",
    "backend faults",
    "own failures",
    "concurrency",
    "properties",
    "reports",
    "devices",
    "files and trust",
    "interrupts",
)


def case(area: str, what: str, expected: str):
    """Describe a test for RELIABILITY.md; `{name}` fields are filled from the test's parameters."""
    if area not in AREAS:
        raise ValueError(f"unknown reliability area {area!r}; known: {list(AREAS)}")

    def mark(fn):
        fn.reliability_case = (area, what, expected)
        return fn

    return mark


def plain(value: object) -> str:
    """A parameter as the table shows it: bare when that is unambiguous, else its repr."""
    if isinstance(value, str) and value and value == value.strip() and value.isprintable():
        return value
    return repr(value) if not callable(value) else value.__name__


def fields(described: tuple[str, str, str], params: dict[str, object]) -> tuple[str, str, str]:
    shown = {k: plain(v) for k, v in params.items()}
    return tuple(text.format(**shown) if shown else text for text in described)  # type: ignore[return-value]


def case_files() -> list[Path]:
    """The test files that declare at least one case."""
    return sorted(p for p in TESTS.glob("test_*.py") if re.search(r"^@case\(", p.read_text(), re.M))


def _parameter_sets(fn) -> list[dict[str, object]]:
    """Every parameter combination pytest generates from `fn`'s parametrize marks (direct ones)."""
    axes = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        axis = []
        for value in values:
            # pytest.param(...) holds its values as a tuple whatever the number of names
            value = (
                value.values
                if hasattr(value, "values") and hasattr(value, "marks")
                else (value,)
                if len(names) == 1
                else value
            )
            axis.append(dict(zip(names, value)))
        axes.append(axis)
    return [dict(kv for part in combo for kv in part.items()) for combo in itertools.product(*axes)]


def declared_cases() -> list[tuple[str, str, str]]:
    """(area, case, expected) of every case in every test file, found by importing the files."""
    found = []
    for path in case_files():
        module = importlib.import_module(path.stem)  # the module pytest imported (tests/ is on sys.path)
        for name, fn in vars(module).items():
            described = getattr(fn, "reliability_case", None)
            if name.startswith("test_") and described is not None:
                found += [fields(described, params) for params in _parameter_sets(fn)]
    return found
