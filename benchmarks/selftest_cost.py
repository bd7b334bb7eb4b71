"""Wall time of decide() (the start-up self-test) for the default shapes.

    .venv/bin/python benchmarks/selftest_cost.py      # CPU, simulated sm_120, emulated backend
    python3 benchmarks/selftest_cost.py                # on a GPU: emulated on CUDA

Target on the GPU: under 1 second per device (FlashInfer's first JIT compile excluded: it is a
one-off per machine and cached on disk).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _common import table, write  # noqa: E402
from sm120_fp4 import devices, selection, selftest  # noqa: E402
from sm120_fp4.config import Settings  # noqa: E402

TARGET_S = 1.0


def main() -> int:
    settings = Settings(simulate="12.0", backends="emulated")
    device = devices.list_devices(settings.simulated_capability)[0]
    runs = []
    for i in range(4):  # the first includes one-off costs (CUDA context, cuBLAS handles, caches)
        selection.clear()
        if device.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        decision = selection.decide(device, settings=settings)
        runs.append(time.perf_counter() - start)
    report = decision.reports[0]
    rows = [[f"{s.m}x{s.n}x{s.k}", s.duration_s * 1e3, s.rel_err] for s in report.shapes]
    print(f"decide() on {device.label()}: emulated backend, {len(report.shapes)} shapes\n")
    print(table(["shape MxNxK", "backend call ms", "rel err"], rows))
    steady = statistics.median(runs[1:])
    print(f"\nfirst decide(): {runs[0]:.3f} s (one-off warm-up included); steady: {steady:.3f} s; "
          f"target < {TARGET_S} s on a GPU: {'met' if steady < TARGET_S else 'NOT met'}")
    write("selftest_cost", {
        "device": device.label(), "shapes": [list(s) for s in selftest.DEFAULT_SHAPES], "runs_s": runs,
        "first_s": runs[0], "steady_s": steady, "target_s": TARGET_S, "met": steady < TARGET_S, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
