"""The one Markdown table renderer (status tables of the CLI, doctor, the README's settings table)."""

from __future__ import annotations

from typing import Iterable, Sequence


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """Return the lines of a Markdown table (a "|" or line break in a cell is escaped or flattened); every caller
    builds each row from the header's columns."""
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
