"""The `humming` fallback against a bf16 torch.matmul and the `emulated` backend, side by side (H200).

    python3 benchmarks/humming_fallback.py                 # on a GPU with humming-kernels: everything
    python3 benchmarks/humming_fallback.py --part startup  # a second process: first calls from the cache
    python3 benchmarks/humming_fallback.py --quick         # fewer shapes (the release pinned by SGLang)

Dense: the 70B-class projections at TP1 and TP8 (qkv, o_proj, gate_up, down), M = 1-64 (decode,
timed as CUDA-graph replays, the way SGLang serves decode) and 1024-8192 (prefill, eager). The
fallback time is the served call: the routed backend convention ``humming.mm_fp4(a, b, a_sf, b_sf,
alpha, ...)`` from SGLang's FP4 activations (dequantized exactly, then Humming's kernel); SGLang's
own activation quantizer (FlashInfer's, SM100+) is not in it: it cannot run on the H200. Also
reported: Humming's GEMM alone on the dequantized activations (what the lever is), `emulated` on
the same inputs, and each layer's GPU memory after the in-place conversion against its NVFP4 tensors.

MoE: DeepSeek-class E=256 H=7168 I=2048 top-8, and its TP8 slice I=256, T = 1-64 (graphs) and 512
(eager), against `emulated` (the oracle: today's MoE emulation); verified at the layer's own
configuration against the oracle's W4A16 mode (the served mode).

Weights are random valid NVFP4 bytes (every byte is two E2M1 codes) with E4M3 block scales in
[2^-3, 2^3): no quantization of bf16 weights is needed to time a GEMM. Correctness rows use the same
bytes against nvfp4's oracle. Results: JSON under $BENCH_OUT (or benchmarks/results/), a plot of
speed against M where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _common import table, write

from sm120_fp4 import backends, nvfp4, verify
from sm120_fp4.backends import humming

DENSE = {  # (N, K): Llama-3-70B projections; TP8 slices N (column-parallel) or K (row-parallel)
    "70B qkv TP1": (10240, 8192),
    "70B o_proj TP1": (8192, 8192),
    "70B gate_up TP1": (57344, 8192),
    "70B down TP1": (8192, 28672),
    "70B qkv TP8": (1280, 8192),
    "70B o_proj TP8": (8192, 1024),
    "70B gate_up TP8": (7168, 8192),
    "70B down TP8": (8192, 3584),
}
QUICK_DENSE = ("70B o_proj TP1", "70B gate_up TP1", "70B qkv TP8", "70B down TP8")
DECODE_M = (1, 4, 16, 64)
PREFILL_M = (1024, 4096, 8192)
MOE = {
    "DeepSeek E=256 H=7168 I=256 top-8 (TP8)": (256, 7168, 256, 8),
    "DeepSeek E=256 H=7168 I=2048 top-8 (TP1)": (256, 7168, 2048, 8),
}
GRAPH_CALLS = 20  # decode calls per timed graph (per-call times: the graph's own launch amortised)
COLD_BYTES = 200 * 2**20  # the rotated copies of a layer exceed the H200's 60 MB L2 by this much
MOE_T_DECODE = (1, 8, 64)
MOE_T_PREFILL = (512,)
DEV = torch.device("cuda", 0)
BF16 = torch.bfloat16


def events_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
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


def graph_ms(fn, reps: int = 50) -> float:
    """Median ms of one replay of a CUDA graph holding `fn` (decode is served from graphs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return events_ms(graph.replay, reps)


def graph_calls_ms(fns: list, reps: int = 20) -> float:
    """Median ms per call of a CUDA graph holding the calls `fns`, in order, replayed."""
    return graph_ms(lambda: [f() for f in fns], reps) / len(fns)


def cycle(fns: list) -> list:
    """`fns` repeated to at least GRAPH_CALLS calls (every copy of a rotation equally often)."""
    return fns * max(1, math.ceil(GRAPH_CALLS / len(fns)))


def random_nvfp4(rows: int, k: int, experts: int | None = None, seed: int = 0):
    """Random valid packed codes (E?, rows, K/2) and SGLang's swizzled scales (E?, Mp, Kp)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lead = (experts,) if experts else ()
    packed = torch.randint(0, 256, (*lead, rows, k // 2), dtype=torch.uint8, device=DEV, generator=gen)
    exps = torch.randint(-3, 3, (*lead, rows, k // 16), device=DEV, generator=gen).float()
    mant = 1 + torch.randint(0, 8, (*lead, rows, k // 16), device=DEV, generator=gen).float() / 8
    linear = (torch.exp2(exps) * mant).to(torch.float8_e4m3fn)
    if experts:
        sf = torch.stack([nvfp4.swizzle_scales(linear[e]) for e in range(experts)])
    else:
        sf = nvfp4.swizzle_scales(linear)
    return packed, sf


def activations(m: int, k: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=gen).to(BF16)
    gx = nvfp4.global_scale(x)
    a, a_sf = nvfp4.quantize(x, gx)
    return x, gx, a, a_sf.view(torch.uint8)


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def dense_row(name: str, n: int, k: int, ms: tuple, emulated_ms: tuple) -> dict:
    w, sf = random_nvfp4(n, k, seed=hash(name) % 1000)
    orig_w, orig_sf = w.clone(), sf.clone()  # the oracle's copy (the served storage is converted in place)
    alpha = torch.tensor([1.0 / (2688.0 * 60.0)], device=DEV)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    humming.prepare_dense(w, sf, BF16, keep_original=False)
    torch.cuda.synchronize()
    convert_s = time.perf_counter() - t0
    nvfp4_bytes = w.numel() + sf.numel()
    resident = torch.cuda.memory_allocated() - base
    transient = torch.cuda.max_memory_allocated() - base
    row = {
        "shape": name,
        "n": n,
        "k": k,
        "convert_s": round(convert_s, 3),
        "memory_ratio": round((nvfp4_bytes + resident) / nvfp4_bytes, 4),
        "conversion_transient_ratio": round((nvfp4_bytes + transient) / nvfp4_bytes, 3),
        "m": {},
    }
    w_bf16 = torch.randn(n, k, device=DEV).to(BF16)  # the bf16 model's weight (speed only)
    # L2-cold decode: a model's layers evict each other's weights from the 60 MB L2, so decode is
    # also timed over copies of the layer (each converted in place like a served layer) rotated in
    # one graph, enough to exceed the L2 by COLD_BYTES; the same for the bf16 weight.
    copies_fp4 = max(1, min(32, math.ceil(COLD_BYTES / nvfp4_bytes)))
    copies_bf16 = max(1, min(32, math.ceil(COLD_BYTES / (2 * n * k))))
    cold = [(w, sf)]
    for _ in range(copies_fp4 - 1):
        cw, csf = orig_w.clone(), orig_sf.clone()
        humming.prepare_dense(cw, csf, BF16, keep_original=False)
        cold.append((cw, csf))
    cold_bf16 = [w_bf16] + [w_bf16.clone() for _ in range(copies_bf16 - 1)]
    row["cold_copies"] = {"fp4": copies_fp4, "bf16": copies_bf16}
    for m in ms:
        x, gx, a, a_sf = activations(m, k, seed=m)
        out = torch.empty(m, n, dtype=BF16, device=DEV)
        call = lambda: humming.mm_fp4(a, w.T, a_sf, sf.T, alpha, BF16, out)  # noqa: E731
        first = time.perf_counter()
        call()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - first
        cell: dict = {"first_call_s": round(first_s, 3)}
        if m in (1, 64, 1024, 8192) or m == ms[0]:
            ref = nvfp4.reference_mm_fp4(a, orig_w.T, a_sf, orig_sf.T, alpha, torch.float32)
            cell["rel_err_vs_w4a4_oracle"] = rel_err(out, ref)
            del ref
        decode = m <= 64
        timer = graph_ms if decode else (lambda f: events_ms(f, 20))
        bf16_fn = lambda: torch.matmul(x, w_bf16.T)  # noqa: E731
        cell["bf16_ms"] = timer(bf16_fn)
        cell["humming_ms"] = timer(call)
        xq = nvfp4.dequantize_unscaled(a, a_sf, BF16)
        prepared = humming.prepared_for(w, BF16)
        gemm_only = lambda: humming.engine.current_engine().gemm(prepared, xq, alpha, out)  # noqa: E731
        cell["humming_gemm_only_ms"] = timer(gemm_only)
        if m in emulated_ms:
            emu_out = torch.empty(m, n, dtype=BF16, device=DEV)
            emu = lambda: backends.emulated_mm_fp4(a, orig_w.T, a_sf, orig_sf.T, alpha, BF16, emu_out)  # noqa: E731
            cell["emulated_ms"] = graph_ms(emu, 10) if decode else events_ms(emu, 5, 1)
        cell["speedup_vs_bf16"] = cell["bf16_ms"] / cell["humming_ms"]
        if "emulated_ms" in cell:
            cell["speedup_vs_emulated"] = cell["emulated_ms"] / cell["humming_ms"]
        if decode:
            # Per call inside a graph of GRAPH_CALLS calls (a served decode step is one graph of
            # every layer: the graph's own launch, which the one-call replays above include for
            # both sides, is not paid per GEMM): L2-hot (one weight) and L2-cold (copies rotated).
            hot = graph_calls_ms([bf16_fn] * GRAPH_CALLS), graph_calls_ms([call] * GRAPH_CALLS)
            cell["bf16_hot_ms"], cell["humming_hot_ms"] = hot
            cell["humming_gemm_only_hot_ms"] = graph_calls_ms([gemm_only] * GRAPH_CALLS)
            cell["bf16_cold_ms"] = graph_calls_ms(cycle([(lambda wb=wb: torch.matmul(x, wb.T)) for wb in cold_bf16]))
            cell["humming_cold_ms"] = graph_calls_ms(
                cycle(
                    [
                        (lambda cw=cw, csf=csf: humming.mm_fp4(a, cw.T, a_sf, csf.T, alpha, BF16, out))
                        for cw, csf in cold
                    ]
                )
            )
            cell["speedup_vs_bf16_hot"] = cell["bf16_hot_ms"] / cell["humming_hot_ms"]
            cell["speedup_vs_bf16_cold"] = cell["bf16_cold_ms"] / cell["humming_cold_ms"]
            if "emulated_ms" in cell:
                cell["emulated_hot_ms"] = graph_calls_ms([emu] * 4, reps=10)
                cell["speedup_vs_emulated_hot"] = cell["emulated_hot_ms"] / cell["humming_hot_ms"]
        elif m == 1024:  # prefill's GPU time alone (eager, above, includes the host's launch cost)
            cell["bf16_graph_ms"] = graph_calls_ms([bf16_fn] * 4, reps=20)
            cell["humming_graph_ms"] = graph_calls_ms([call] * 4, reps=20)
            cell["speedup_vs_bf16_graph"] = cell["bf16_graph_ms"] / cell["humming_graph_ms"]
        row["m"][m] = cell
        x = a = a_sf = out = xq = None  # freed before the next shape (the timed lambdas read these names)
    w_bf16 = orig_w = orig_sf = cold = cold_bf16 = (
        None  # freed before the next shape (the timed lambdas read these names)
    )
    return row


def moe_weights(e, h, i, seed):
    w13, w13_sf = random_nvfp4(2 * i, h, e, seed)
    w2, w2_sf = random_nvfp4(h, i, e, seed + 1)
    a1 = torch.tensor([2688.0 / 4.0], device=DEV)
    a2 = torch.tensor([2688.0 / 2.0], device=DEV)
    w13_alpha = (1.0 / (a1 * 2688.0 * 8)).expand(e).contiguous() * (1 + torch.arange(e, device=DEV) % 3 / 10)
    w2_alpha = (1.0 / (a2 * 2688.0 * 30)).expand(e).contiguous()
    return nvfp4.MoeWeights(
        w13,
        w13_sf.view(torch.float8_e4m3fn),
        w13_alpha.float(),
        w2,
        w2_sf.view(torch.float8_e4m3fn),
        w2_alpha.float(),
        a1,
        a2,
    )


def moe_row(
    name: str, e: int, h: int, i: int, top_k: int, decode_t: tuple, prefill_t: tuple, emulated_t: tuple
) -> dict:
    weights = moe_weights(e, h, i, seed=7)
    originals = weights.map(torch.clone)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    humming.prepare_moe({**weights._asdict(), "dtype": BF16}, BF16, keep_original=False)
    torch.cuda.synchronize()
    nvfp4_bytes = sum(t.numel() for t in (weights.w13, weights.w13_sf, weights.w2, weights.w2_sf))
    row = {
        "config": name,
        "convert_s": round(time.perf_counter() - t0, 3),
        "memory_ratio": round((nvfp4_bytes + torch.cuda.memory_allocated() - base) / nvfp4_bytes, 4),
        "conversion_transient_ratio": round((nvfp4_bytes + torch.cuda.max_memory_allocated() - base) / nvfp4_bytes, 3),
        "t": {},
    }
    gen = torch.Generator().manual_seed(3)
    args_of = lambda x, ids, tw, wts: (x, ids, tw, *wts)  # noqa: E731
    for t in decode_t + prefill_t:
        ids, tw = verify.moe_routing(t, top_k, e, "random", gen)
        ids, tw = ids.to(DEV), tw.to(DEV)
        x = (torch.randn(t, h, device=DEV) * 1.5).clamp(-4, 4).to(BF16)
        out = torch.empty(t, h, dtype=BF16, device=DEV)
        call = lambda: humming.fused_moe(*args_of(x, ids, tw, weights), "swiglu", BF16, out)  # noqa: E731
        first = time.perf_counter()
        call()
        torch.cuda.synchronize()
        cell: dict = {"first_call_s": round(time.perf_counter() - first, 3)}
        cell["humming_ms"] = graph_ms(call, 30) if t in decode_t else events_ms(call, 10)
        if t in emulated_t:
            emu_out = torch.empty_like(out)
            emu = lambda: backends.emulated_moe(*args_of(x, ids, tw, originals), "swiglu", BF16, emu_out)  # noqa: E731
            cell["emulated_ms"] = events_ms(emu, 2, 1)
            cell["speedup_vs_emulated"] = cell["emulated_ms"] / cell["humming_ms"]
        row["t"][t] = cell
    # Verified at the layer's own configuration: the self-test's checks (NaN-poisoned out, every call,
    # two passes, per-row bounds) against the oracle's W4A16 mode, reading the original bytes.
    plans = []
    for t, routing in ((1, "random"), (7, "random"), (64, "random"), (160, "skewed")):
        ids, tw = verify.moe_routing(t, top_k, e, routing, gen)
        x = (torch.randn(t, h, generator=gen) * 1.5).clamp(-4, 4).to(BF16).to(DEV)
        plans.append((f"T={t} {routing}", x, ids.to(DEV), tw.to(DEV)))
    cases = verify.moe_cases(humming.fused_moe, weights, "swiglu", plans, mode="w4a16", reference_weights=originals)
    results = verify.sweep(cases, verify.Bounds(timeout_s=300), DEV)
    row["verified"] = {
        "passed": all(r.passed for r in results),
        "cases": [
            {
                "label": r.label,
                "passed": r.passed,
                "rel_err": r.rel_err,
                "max_row_rel_err": r.max_row_rel_err,
                "reason": r.reason,
            }
            for r in results
        ],
    }
    return row


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def plot(dense_rows: list, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in dense_rows:
        ms = sorted(row["m"])
        (line,) = ax.plot(ms, [row["m"][m]["speedup_vs_bf16"] for m in ms], marker="o", label=row["shape"])
        cold = [m for m in ms if "speedup_vs_bf16_cold" in row["m"][m]]
        if cold:
            ax.plot(
                cold, [row["m"][m]["speedup_vs_bf16_cold"] for m in cold], ls="--", marker=".", color=line.get_color()
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("bf16 torch.matmul time / humming time")
    ax.set_title(
        f"humming fallback vs bf16 (H200, humming {humming.version()}); dashed: decode in a graph, L2-cold", fontsize=9
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("all", "dense", "moe", "startup"), default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default="", help="comma-separated dense shape names (default: all)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU with humming-kernels; nothing to measure here")
        return 0
    tag = f"{humming.version()}" + ("-quick" if opts.quick else "")
    payload: dict = {"humming": humming.doctor_info(), "part": opts.part, "errors": []}
    if opts.part == "startup":
        # A second process over the same HUMMING_CACHE_DIR: the first call of each configuration again.
        names = ("70B o_proj TP1", "70B qkv TP8")
        payload["dense"] = [dense_row(n, *DENSE[n], (1,), ()) for n in names]
        name = list(MOE)[0]
        payload["moe"] = [moe_row(name, *MOE[name], (1,), (), ())]
        payload["startup"] = humming.startup()
        write(f"humming_startup-{tag}", payload)
        print(
            table(
                ["configuration", "first call s", "kernels compiled"],
                [
                    [k, v["first_call_s"], v["kernels_compiled"]]
                    for k, v in payload["startup"]["configurations"].items()
                ],
            )
        )
        return 0
    dense_rows, moe_rows = [], []
    payload["dense"], payload["moe"] = dense_rows, moe_rows

    def flush() -> None:  # after every row: a run stopped at its time limit keeps what it measured
        payload["startup"] = humming.startup()
        write(f"humming_fallback-{tag}", payload)

    shapes = tuple(opts.shapes.split(",")) if opts.shapes else QUICK_DENSE if opts.quick else tuple(DENSE)
    if opts.part in ("all", "dense"):
        for name in shapes:
            try:
                ms = DECODE_M + (PREFILL_M if not opts.quick else (1024,))
                dense_rows.append(dense_row(name, *DENSE[name], ms, (1, 16, 64, 1024)))
                print(f"dense {name}: done", flush=True)
                flush()
            except Exception as exc:
                payload["errors"].append(f"dense {name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                print(payload["errors"][-1], flush=True)
            torch.cuda.empty_cache()
    if opts.part in ("all", "moe"):
        for name, (e, h, i, k) in MOE.items():
            if opts.quick and i == 2048:
                continue
            try:
                moe_rows.append(moe_row(name, e, h, i, k, MOE_T_DECODE, MOE_T_PREFILL, (1, 8, 64)))
                print(f"moe {name}: done", flush=True)
                flush()
            except Exception as exc:
                payload["errors"].append(f"moe {name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                print(payload["errors"][-1], flush=True)
            torch.cuda.empty_cache()
    payload["startup"] = humming.startup()
    decode = [c["speedup_vs_bf16"] for r in dense_rows for m, c in r["m"].items() if m <= 64]
    prefill = [c["speedup_vs_bf16"] for r in dense_rows for m, c in r["m"].items() if m >= 1024]
    cold = [c["speedup_vs_bf16_cold"] for r in dense_rows for m, c in r["m"].items() if "speedup_vs_bf16_cold" in c]
    hot = [c["speedup_vs_bf16_hot"] for r in dense_rows for m, c in r["m"].items() if "speedup_vs_bf16_hot" in c]
    emu_hot = [
        c["speedup_vs_emulated_hot"] for r in dense_rows for m, c in r["m"].items() if "speedup_vs_emulated_hot" in c
    ]
    graph_prefill = [
        c["speedup_vs_bf16_graph"] for r in dense_rows for m, c in r["m"].items() if "speedup_vs_bf16_graph" in c
    ]
    gemm_only = {
        "decode": [c["bf16_ms"] / c["humming_gemm_only_ms"] for r in dense_rows for m, c in r["m"].items() if m <= 64],
        "prefill": [
            c["bf16_ms"] / c["humming_gemm_only_ms"] for r in dense_rows for m, c in r["m"].items() if m >= 1024
        ],
    }
    split = {
        f"{part} {tp}": geomean(
            [
                c["speedup_vs_bf16"]
                for r in dense_rows
                if r["shape"].endswith(tp)
                for m, c in r["m"].items()
                if (m <= 64) == (part == "decode")
            ]
        )
        for part in ("decode", "prefill")
        for tp in ("TP1", "TP8")
    }
    emu = [
        c["speedup_vs_emulated"]
        for r in dense_rows
        for m, c in r["m"].items()
        if m <= 64 and "speedup_vs_emulated" in c
    ]
    moe_emu = [c["speedup_vs_emulated"] for r in moe_rows for c in r["t"].values() if "speedup_vs_emulated" in c]
    payload["summary"] = {
        "dense_geomean_vs_bf16_decode_M1-64": geomean(decode),
        "dense_geomean_vs_bf16_prefill_M1024+": geomean(prefill),
        "dense_geomean_vs_bf16_decode_M1-64_in_graph_L2hot": geomean(hot),
        "dense_geomean_vs_bf16_decode_M1-64_in_graph_L2cold": geomean(cold),
        "dense_geomean_vs_bf16_prefill_M1024_in_graph": geomean(graph_prefill),
        "dense_min_vs_emulated_decode_in_graph": min(emu_hot) if emu_hot else None,
        "dense_cells_under_8x_emulated_decode_in_graph": sum(1 for v in emu_hot if v < 8),
        "dense_gemm_only_geomean_decode": geomean(gemm_only["decode"]),
        "dense_gemm_only_geomean_prefill": geomean(gemm_only["prefill"]),
        "dense_geomean_by_tp": split,
        "dense_min_vs_emulated_decode": min(emu) if emu else None,
        "dense_cells_under_8x_emulated_decode": sum(1 for v in emu if v < 8),
        "dense_cells_vs_emulated_decode": len(emu),
        "moe_min_vs_emulated_T1-64": min(moe_emu) if moe_emu else None,
    }
    out_dir = Path(os.environ.get("BENCH_OUT", Path(__file__).resolve().parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    payload["plot"] = plot(dense_rows, out_dir / f"humming_speed-{tag}.png") if dense_rows else None
    rows = [
        [
            r["shape"],
            m,
            c["bf16_ms"],
            c["humming_ms"],
            c["humming_gemm_only_ms"],
            c.get("emulated_ms", ""),
            c["speedup_vs_bf16"],
            c.get("speedup_vs_bf16_hot", c.get("speedup_vs_bf16_graph", "")),
            c.get("speedup_vs_bf16_cold", ""),
            c.get("rel_err_vs_w4a4_oracle", ""),
        ]
        for r in dense_rows
        for m, c in r["m"].items()
    ]
    print(
        table(
            [
                "shape",
                "M",
                "bf16 ms",
                "humming ms",
                "gemm only ms",
                "emulated ms",
                "bf16/humming",
                "in graph",
                "in graph L2-cold",
                "rel err",
            ],
            rows,
        )
    )
    rows = [
        [r["config"], t, c["humming_ms"], c.get("emulated_ms", ""), c.get("speedup_vs_emulated", "")]
        for r in moe_rows
        for t, c in r["t"].items()
    ]
    print(table(["MoE", "T", "humming ms", "emulated ms", "emulated/humming"], rows))
    print(payload["summary"])
    write(f"humming_fallback-{tag}", payload)
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
