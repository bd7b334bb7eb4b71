"""Documentation that is generated from, or checked against, the code."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from sm120_fp4.config import settings_table

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_settings_table_is_generated_from_settings():
    block = re.search(r"<!-- settings-table:start -->\n(.*?)\n<!-- settings-table:end -->", README, re.S)
    assert block, "README lost its settings-table markers"
    assert block.group(1) == settings_table(), "regenerate: python -c 'from sm120_fp4.config import settings_table; print(settings_table())'"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert blocks[0] == "bash scripts/setup_env.sh && .venv/bin/python -m sm120_fp4 demo"
    assert blocks[1] == "bash scripts/setup_env.sh && .venv/bin/python -m pytest"
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert blocks[1] in ci.splitlines()


def readme_refusal() -> list[str]:
    block = re.search(r"\*\*The refusal\*\*.*?```\n(.*?)\n```", README, re.S)
    return block.group(1).splitlines()


def test_reliability_md_has_exactly_the_declared_cases():
    """RELIABILITY.md's rows are the @case declarations of the test files (refresh the outcomes with
    `python scripts/reliability_table.py`); a case added, changed or removed makes this fail."""
    from helpers.cases import AREAS, declared_cases

    def cell(text: str) -> str:  # as scripts/reliability_table.py writes a cell
        return text.replace("|", "\\|").replace("\n", " ")

    text = (Path(__file__).resolve().parents[1] / "RELIABILITY.md").read_text()
    rows = [re.split(r"(?<!\\) \| ", line[2:-2]) for line in text.splitlines() if line.startswith("| ") and not line.startswith("| area |")]
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    assert all(area.replace("\\|", "|") in AREAS for area, *_ in rows)
    in_file = Counter((area, case, expected) for area, case, expected, _ in rows)
    declared = Counter(tuple(cell(field) for field in fields) for fields in declared_cases())
    assert in_file == declared, (
        f"stale RELIABILITY.md: run python scripts/reliability_table.py\n"
        f"  declared, not in the file: {sorted(declared - in_file)}\n  in the file, not declared: {sorted(in_file - declared)}"
    )
    assert f"**{len(rows)} cases:" in text
