"""Every SGLang release 0.5.8-0.5.23 against sm120_fp4's patch targets, from the release's source.

Runs scripts/sglang_matrix.py's per-release check (ast only, SGLang is not imported). The wheel
cache is SGLANG_MATRIX_CACHE or <repo>/.cache/sglang-wheels. Import-and-patch of the releases that
install on a CPU machine is `scripts/sglang_matrix.py --import-check VERSION` (builds a 6 GB venv).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sglang_matrix.py"
_spec = importlib.util.spec_from_file_location("sglang_matrix", _SCRIPT)
matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)

pytestmark = pytest.mark.matrix
CACHE = Path(os.environ.get("SGLANG_MATRIX_CACHE", matrix.DEFAULT_CACHE))


@pytest.mark.parametrize("version", matrix.RELEASES)
def test_release_targets(version):
    result = matrix.check_version(version, CACHE)
    failures = {column: reason for column, (state, reason) in result.items() if state == matrix.FAIL}
    assert not failures, f"sglang {version}: {failures}"


@pytest.mark.parametrize("version", matrix.OUTSIDE_PROBES)
def test_nothing_applies_outside_supported(version):
    assert matrix.check_outside(version) is None
