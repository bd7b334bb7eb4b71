"""Render BENCHMARKS.md's tables from the JSON files in benchmarks/results/ (no measuring here).

python3 benchmarks/report.py > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(name: str, label: str) -> dict | None:
    path = RESULTS / f"{name}-{label}.json"
    return json.loads(path.read_text()) if path.exists() else None


def md(headers: list[str], rows: list[list]) -> str:
    fmt = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    return "\n".join(
        ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + ["| " + " | ".join(r) + " |" for r in fmt]
    )


def main() -> int:
    out = []
    for label in ("cpu", "h200"):
        d = load("dispatch_overhead", label)
        if d:
            m = d["machine"]
            out += [
                f"### Dispatch overhead, {label} ({m.get('gpu', m['platform'])}, torch {m.get('torch')})",
                "",
                md(["case", "ns/call", "added ns"], d["rows"]),
                "",
                f"Added by the patch as SGLang calls it: **{d['added_ns_as_sglang_calls']:.0f} ns**; with `out` given: "
                f"**{d['added_ns_out_given']:.0f} ns**. Target <= {d['target_ns']:.0f} ns on the SGLang call: "
                f"{'met' if d['met'] else 'NOT met'}."
                + (" No host sync: proven with `set_sync_debug_mode('error')`." if d.get("sync") else ""),
                "",
            ]
    for label in ("cpu", "h200"):
        d = load("startup", label)
        if d:
            rows = [[k, v["median_ms"], v["added_pct"], v["torch"]] for k, v in d["results"].items()]
            out += [
                f"### Interpreter start-up, {label}",
                "",
                md(["variant", "median ms", "added %", "torch imported"], rows),
                "",
            ]
    for label in ("cpu", "h200"):
        d = load("selftest_cost", label)
        if d:
            out += [
                f"### Self-test cost, {label} ({d['device']})",
                "",
                md(["shape MxNxK", "backend call ms", "rel err"], d["rows"]),
                "",
                f"decide(): first {d['first_s']:.3f} s, steady {d['steady_s']:.3f} s (target < {d['target_s']} s on a GPU).",
                "",
            ]
    d = load("canary_cost", "h200")
    if d:
        rows = [
            [
                r["label"],
                r["runs"],
                r["per_period_ms"],
                f"{r['share']:.3%}",
                r["longest_slice_ms"],
                sorted(r["steps"].values())[len(r["steps"]) // 2],
                f"{r['peak_extra_mib']:.0f}",
            ]
            for r in d["results"]
        ]
        out += [
            f"### The serving canary, h200 (`benchmarks/canary_cost.py`, period {d['period_s']:g} s, `emulated` on CUDA)",
            "",
            md(
                [
                    "model",
                    "runs",
                    "ms per period",
                    "share of the period",
                    "longest slice ms",
                    "median step ms",
                    "peak extra MiB",
                ],
                rows,
            ),
            "",
        ]
    d = load("emulated_gemm", "h200")
    if d:
        rows = [
            [
                r["shape"],
                r["m"],
                r["n"],
                r["k"],
                r["emulated_ms"],
                r["bf16_matmul_ms"],
                r["ratio"],
            ]
            for r in d["results"]
        ]
        out += [
            "### Emulated GEMM vs bf16 matmul, H200",
            "",
            md(["projection", "M", "N", "K", "emulated ms", "bf16 ms", "ratio"], rows),
            "",
        ]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
