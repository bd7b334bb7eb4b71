"""The SGLang release matrix: skipped unless RUN_SGLANG_MATRIX=1 (it downloads every release's wheel).

    RUN_SGLANG_MATRIX=1 .venv/bin/python -m pytest tests/matrix -m matrix

(Not SM120_FP4_*: the library's settings loader rejects unknown variables with that prefix.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "matrix: the SGLang release matrix (RUN_SGLANG_MATRIX=1; downloads wheels)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RUN_SGLANG_MATRIX") == "1":
        return
    skip = pytest.mark.skip(
        reason="SGLang release matrix: set RUN_SGLANG_MATRIX=1 to run it (downloads ~400 MB of wheels once)"
    )
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
