"""Shared by the benchmarks: machine facts, a table printer, and the JSON result writer."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except ImportError:
        pass
    return info


def label() -> str:
    info = machine()
    return "h200" if "H200" in info.get("gpu", "") else ("gpu" if "gpu" in info else "cpu")


def median_ns(fn, *, number: int, repeat: int) -> float:
    """Median over `repeat` runs of the mean time of `number` calls, in nanoseconds."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter_ns() - start) / number)
    return statistics.median(samples)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write(name: str, payload: dict) -> Path:
    out_dir = Path(os.environ.get("BENCH_OUT", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{label()}.json"
    payload = {"benchmark": name, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    return path
