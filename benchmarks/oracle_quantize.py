"""The oracle's NVFP4 quantizer (`nvfp4.quantize`) against its earlier CPU path, side by side in one run.

    .venv/bin/python benchmarks/oracle_quantize.py           # the CPU (simulation, demo, the suite)
    .venv/bin/python benchmarks/oracle_quantize.py --quick   # one small shape, to check the script

On the CPU a float32 is now encoded by one table lookup on its top 12 bits (and whether a lower
bit is set), and finiteness is checked on the block maxima; the earlier path counted the seven
rounding thresholds each value passes (`nvfp4.format._encode_by_comparison`, which other dtypes still
use) and checked every input value. Both give the same bytes (asserted here for every shape); the
table gives their ratio, measured in one process with one intra-op thread, as the test suite runs.
CUDA keeps its own encoding (two sorted searches), so this is a CPU benchmark.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _common import median_ns, table, write

from sm120_fp4 import nvfp4

SHAPES = ((1, 256), (8, 4096), (64, 512), (512, 1024), (2049, 512), (2048, 2048))  # (M, K): decode to prefill
QUICK = ((64, 512),)


def earlier(x: torch.Tensor, gsf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4.quantize as it was: every value checked for finiteness, every value's code counted by
    the seven threshold comparisons."""
    if not torch.isfinite(x).all():
        raise ValueError("non-finite")
    encode = nvfp4.format._encode
    nvfp4.format._encode = nvfp4.format._encode_by_comparison
    try:
        return nvfp4.quantize(x, gsf, check_finite=False)
    finally:
        nvfp4.format._encode = encode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few repeats (to check the script)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows, results = [], []
    for m, k in QUICK if args.quick else SHAPES:
        x = torch.randn(m, k) * 3
        gsf = nvfp4.global_scale(x)
        now, before = nvfp4.quantize(x, gsf), earlier(x, gsf)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(now, before)), (m, k)
        number = max(1, int(2e6 // (m * k))) if not args.quick else 1
        repeat = 3 if args.quick else 7
        t_now = median_ns(lambda: nvfp4.quantize(x, gsf), number=number, repeat=repeat) / 1e6
        t_before = median_ns(lambda: earlier(x, gsf), number=number, repeat=repeat) / 1e6
        rows.append([m, k, t_before, t_now, t_before / t_now])
        results.append({"m": m, "k": k, "earlier_ms": t_before, "now_ms": t_now, "speedup": t_before / t_now})
    print("nvfp4.quantize on the CPU, one thread: the earlier path against now (median ms, the same bytes)\n")
    print(table(["M", "K", "earlier ms", "now ms", "speedup"], rows))
    write("oracle_quantize", {"device": "cpu", "threads": 1, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
