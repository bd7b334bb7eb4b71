"""vLLM's own test environment: tests/engine_vllm/ (vLLM 0.33's real modules, in simulation) run in the
venv scripts/setup_vllm_env.sh makes (vLLM pins another torch, so it cannot share .venv). The README's
set-up makes it; here the full gate runs that suite in it, as a background job, and reads its summary."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.procs import REPO, Popen, background, clean_env, pythonpath

VENV = REPO / ".venv-vllm"
SUITE = "tests/engine_vllm"


def _suite(folder: Path) -> Popen:
    python = VENV / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(
            f"{python} is missing: run bash scripts/setup_vllm_env.sh (scripts/setup_env.sh runs it)"
        )
    return Popen(
        [str(python), "-m", "pytest", SUITE, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        clean_env(PYTHONPATH=pythonpath(REPO)),
        folder,
        cwd=REPO,
        merge=True,
        timeout=900,
    )


@background(_suite, heavy=True)
def test_the_vllm_suite_passes_in_vllms_own_venv(background):
    code, out, _ = background
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert code == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0 and "skipped" not in summary, summary  # vLLM is there: nothing skips
