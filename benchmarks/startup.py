"""Interpreter start-up cost of the ``sm120_fp4.pth`` bootstrap, measured side by side.

Each variant starts ``python -S`` and adds one site directory with ``site.addsitedir``: an empty
one (package not installed), one holding the ``.pth`` (and the package) with the toggle off, and
the same with ``SM120_FP4=1`` (no SGLang imported). Only the ``.pth`` differs between them.

    .venv/bin/python benchmarks/startup.py

Targets: toggle off adds < 2% to ``python -c pass``; torch is never imported at start-up.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import table, write

ROOT = Path(__file__).resolve().parents[1]
RUNS = 40


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM120_FP4")}
    env.update(extra)
    return env


def _cmd(site_dir: Path, body: str) -> list[str]:
    code = f"import site; site.addsitedir({str(site_dir)!r}); {body}"
    return [sys.executable, "-S", "-c", code]


def _time(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="sm120_fp4_startup_"))
    bare, with_pth = work / "bare", work / "with_pth"
    bare.mkdir()
    with_pth.mkdir()
    shutil.copy(ROOT / "sm120_fp4" / "_pth" / "sm120_fp4.pth", with_pth / "sm120_fp4.pth")
    (with_pth / "sm120_fp4").symlink_to(ROOT / "sm120_fp4")
    # wrapt (the toggle-on path imports it) comes from this interpreter's own site-packages.
    import wrapt

    (with_pth / "deps.pth").write_text(str(Path(wrapt.__file__).resolve().parents[1]) + "\n")
    (bare / "deps.pth").write_text(str(Path(wrapt.__file__).resolve().parents[1]) + "\n")
    variants = {
        "package not installed": (bare, {}),
        ".pth installed, toggle unset": (with_pth, {}),
        ".pth installed, SM120_FP4=0": (with_pth, {"SM120_FP4": "0"}),
        ".pth installed, SM120_FP4=1 (no SGLang import)": (with_pth, {"SM120_FP4": "1"}),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):  # warm the file cache
        for site_dir, extra in variants.values():
            _time(_cmd(site_dir, "pass"), _env(extra))
    for _ in range(RUNS):  # interleaved, so drift hits every variant alike
        for name, (site_dir, extra) in variants.items():
            samples[name].append(_time(_cmd(site_dir, "pass"), _env(extra)))
    probe = "import sys; print('torch' in sys.modules, 'pydantic' in sys.modules, 'sm120_fp4.bootstrap' in sys.modules)"
    imported = {}
    for name, (site_dir, extra) in variants.items():
        out = subprocess.run(
            _cmd(site_dir, probe), env=_env(extra), capture_output=True, text=True, check=True
        ).stdout.split()
        imported[name] = {"torch": out[0] == "True", "pydantic": out[1] == "True", "bootstrap": out[2] == "True"}
    # The subprocess medians carry ~1% of noise; the .pth line itself, executed in-process as site
    # executes it, measures the toggle-off cost precisely.
    line = (ROOT / "sm120_fp4" / "_pth" / "sm120_fp4.pth").read_text().strip()
    env_off = {k: v for k, v in os.environ.items() if k != "SM120_FP4"}
    saved = os.environ.copy()
    os.environ.clear()
    os.environ.update(env_off)
    try:
        code = compile(line, "sm120_fp4.pth", "exec")
        start = time.perf_counter()
        for _ in range(20000):
            exec(code, {})
        line_us = (time.perf_counter() - start) / 20000 * 1e6
    finally:
        os.environ.clear()
        os.environ.update(saved)
    base = statistics.median(samples["package not installed"])
    rows, results = [], {}
    for name, values in samples.items():
        med = statistics.median(values)
        results[name] = {"median_ms": med, "added_pct": 100 * (med - base) / base, **imported[name]}
        rows.append([name, med, results[name]["added_pct"], imported[name]["torch"], imported[name]["bootstrap"]])
    print(f"interpreter start-up, median of {RUNS} interleaved runs each\n")
    print(table(["variant", "ms", "added %", "torch imported", "bootstrap imported"], rows))
    off = max(results[".pth installed, toggle unset"]["added_pct"], results[".pth installed, SM120_FP4=0"]["added_pct"])
    line_pct = 100 * line_us / 1e3 / base
    met = line_pct < 2.0 and not any(v["torch"] for v in imported.values())
    print(f"\nthe .pth line with the toggle off: {line_us:.2f} us = {line_pct:.4f}% of start-up (measured in-process);")
    print(
        f"subprocess medians: toggle off {off:+.2f}% (noise of a few tenths of a ms); torch never imported: "
        f"{not any(v['torch'] for v in imported.values())}; target < 2%: {'met' if met else 'NOT met'}"
    )
    shutil.rmtree(work, ignore_errors=True)
    write(
        "startup",
        {
            "runs": RUNS,
            "results": results,
            "toggle_off_added_pct": off,
            "pth_line_us": line_us,
            "pth_line_pct": line_pct,
            "met": met,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
