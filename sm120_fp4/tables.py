"""The one Markdown table renderer (status tables of the CLI, doctor, the README's settings table)."""

from __future__ import annotations

from typing import Iterable, Sequence


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """Return the lines of a Markdown table (a "|" or line break in a cell is escaped or flattened)."""
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a table row has {len(row)} cells, its header {len(header)}: {row!r}")
        lines.append("| " + " | ".join(map(_cell, row)) + " |")
    return lines
