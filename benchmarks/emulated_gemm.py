"""The `emulated` backend against a bf16 torch.matmul of the same shape (H200: the fallback's cost).

    python3 benchmarks/emulated_gemm.py            # on a GPU: 7B/70B projections, decode and prefill
    .venv/bin/python benchmarks/emulated_gemm.py   # on a CPU: small shapes, to check the script

The emulation dequantizes both operands to bf16 (exact: an E2M1 x E4M3 value needs 5 significant
bits) and runs one bf16 GEMM with float32 output, so its cost is one bf16 GEMM plus the
dequantization of the weight, which dominates at decode sizes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _common import table, write

from sm120_fp4 import backends, nvfp4

GPU_SHAPES = {  # (N, K) of one projection
    "7B o_proj": (4096, 4096),
    "7B gate_up": (28672, 4096),
    "70B qkv": (10240, 8192),
    "70B down": (8192, 28672),
}
GPU_M = (1, 16, 64, 2048, 8192)
CPU_SHAPES = {"small": (512, 1024)}
CPU_M = (1, 64)


def time_ms(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type != "cuda":
        import time

        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def main() -> int:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    shapes, ms = (GPU_SHAPES, GPU_M) if gpu else (CPU_SHAPES, CPU_M)
    rows, results = [], []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        gw = nvfp4.global_scale(w)
        qw, sw = nvfp4.quantize(w, gw)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            gx = nvfp4.global_scale(x)
            qx, sx = nvfp4.quantize(x, gx)
            alpha = (1 / (gx * gw)).reshape(1)
            out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            reps = 20 if gpu else 3
            t_emul = time_ms(
                lambda: backends.emulated_mm_fp4(qx, qw.T, sx, sw.T, alpha, torch.bfloat16, out), device, reps
            )
            t_bf16 = time_ms(lambda: torch.matmul(x, w.T), device, reps)
            flops = 2 * m * n * k
            rows.append([name, m, n, k, t_emul, t_bf16, t_emul / t_bf16])
            results.append(
                {
                    "shape": name,
                    "m": m,
                    "n": n,
                    "k": k,
                    "emulated_ms": t_emul,
                    "bf16_matmul_ms": t_bf16,
                    "ratio": t_emul / t_bf16,
                    "emulated_tflops": flops / t_emul / 1e9,
                    "packed_weight_bytes": n * k // 2 + n * k // 16,
                }
            )
        w = qw = sw = None  # freed before the next shape (the timed lambdas read these names)
    print(f"emulated NVFP4 GEMM vs bf16 torch.matmul on {device} (median ms)\n")
    print(table(["projection", "M", "N", "K", "emulated ms", "bf16 ms", "ratio"], rows))
    write("emulated_gemm", {"device": str(device), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
