"""Documentation that is generated from, or checked against, the code."""

from __future__ import annotations

import re
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
