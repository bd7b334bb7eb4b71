"""Humming's kernel configurations for the dense `humming` fallback, measured on this GPU (H200).

    python3 benchmarks/humming_tune.py [--budget-s 300] [--shapes "70B qkv TP8,..."]

What `humming_fallback.py` showed: Humming's own kernel choice (its sm90 heuristics) is 0.75-1.0x
of cuBLAS bf16 at decode on the small TP8 projections and 0.55-1.0x at prefill. This sweeps, per
shape, Humming's choice and a fixed set of candidate configurations (families of tile, pipeline
depth, CTAs per SM, stream-K, MMA or warp-specialised WGMMA) that Humming's own candidate analysis
calls legal, at decode (M = 1, 4, 16, 32, 64: CUDA-graph replays, L2-hot over one weight and
L2-cold over copies rotated so that they exceed the L2) and prefill (M = 1024, 4096, 8192, eager).
Every candidate's output at every M is checked against the W4A4 oracle (NaN-poisoned output,
rel. error <= 0.01, finite) before it is timed; a wrong one is reported, never ranked.

Also measured: the served activation dequantization kernel (CUDA C) against its memory floor (and bit for bit
against nvfp4's decode), and the served call's host time by part. The JSON (under $BENCH_OUT)
holds every number; the summary ranks the candidate families by their geometric mean over the
shapes, per M bucket, which is how sm120_fp4/backends/humming/'s tuning table was chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _common import table, write
from humming_fallback import BF16, DENSE, DEV, activations, events_ms, graph_ms, random_nvfp4, rel_err

from sm120_fp4 import nvfp4
from sm120_fp4.backends import humming
from sm120_fp4.backends.convention import check_mm_fp4_args

HOLDOUT = {"8B qkv TP1": (6144, 4096), "8B down TP1": (4096, 14336)}  # shapes no choice was made on
DECODE_M = (1, 4, 16, 32, 64)
PREFILL_M = (1024, 4096, 8192)
COLD_BYTES = 200 * 2**20  # rotated copies exceed the H200's 60 MB L2 by this much


def bucket_m(m: int) -> int:
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64


def decode_families(bm: int) -> dict[str, dict]:
    out = {}
    for (bn, bk, wn, wk), stages, ctas, sk in itertools.product(
        ((128, 128, 64, 32), (128, 256, 64, 64), (64, 256, 32, 64)), (4, 6), (1, 2), (True, False)
    ):
        out[f"mma {bn}x{bk} s{stages} c{ctas}{'' if sk else ' nosk'}"] = {
            "mma_type": "mma",
            "block_shape": (bm, bn, bk),
            "warp_shape": (bm, wn, wk),
            "num_stages": stages,
            "num_ctas_per_sm": ctas,
            "use_stream_k": sk,
            "use_tma": False,
            "use_warp_spec": False,
        }
    for stages, ctas in itertools.product((4, 8), (1, 2)):
        out[f"wgmma-ws 128x64 s{stages} c{ctas}"] = {
            "mma_type": "wgmma",
            "block_shape": (bm, 128, 64),
            "warp_shape": (bm, 32, 64),
            "num_stages": stages,
            "num_ctas_per_sm": ctas,
            "use_stream_k": True,
            "use_tma": True,
            "use_warp_spec": True,
        }
    return out


# The decode families timed (a subset: the compile time of each is seconds); all of
# decode_families() are checked for legality.
DECODE_TIMED = (
    "mma 128x128 s4 c1",
    "mma 128x128 s4 c2",
    "mma 128x128 s6 c1",
    "mma 128x128 s4 c1 nosk",
    "mma 128x256 s4 c1",
    "mma 128x256 s4 c2",
    "mma 64x256 s4 c2",
    "mma 64x256 s6 c1",
    "wgmma-ws 128x64 s8 c1",
    "wgmma-ws 128x64 s4 c2",
)


def prefill_families() -> dict[str, dict]:
    base = {"mma_type": "wgmma", "use_tma": True, "use_warp_spec": True, "num_ctas_per_sm": 1}
    out = {}
    for bm, bn, wn, stages, mc, sk in (
        (128, 256, 32, 4, 2, True),
        (128, 256, 32, 4, 1, True),
        (176, 256, 32, 4, 2, False),
        (176, 256, 32, 5, 2, True),
        (256, 128, 32, 4, 2, True),
        (128, 128, 32, 6, 1, True),
    ):
        out[f"wgmma-ws {bm}x{bn} s{stages} mc{mc}{'' if sk else ' nosk'}"] = {
            **base,
            "block_shape": (bm, bn, 64),
            "warp_shape": (bm, wn, 64),
            "num_stages": stages,
            "multi_cast_size_a": mc,
            "use_stream_k": sk,
        }
    return out


def _legal(layer_config, m: int, config: dict) -> tuple[bool, str]:
    from humming.config import GemmType
    from humming.tune.candidate import ScheduleCandidate, analyze_candidate
    from humming.tune.sm90 import Sm90Heuristics

    try:
        problem = Sm90Heuristics._make_problem(layer_config, m, False, False, GemmType.DENSE, include_grid_size=True)
        analysis = analyze_candidate(problem, ScheduleCandidate.from_config("c", config))
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return analysis.legal, "; ".join(analysis.rejection_reasons)


def _finish(layer_config, config: dict) -> dict:
    """What Humming's own kernel choice does to a chosen configuration (tile fitting, raster order)."""
    from humming.config import GemmType
    from humming.tune import _apply_raster_group_m
    from humming.tune.sm90_policies import fit_sm90_tile

    config = fit_sm90_tile(layer_config, dict(config), False, gemm_type=GemmType.DENSE)
    _apply_raster_group_m(config, layer_config, GemmType.DENSE)
    return {k: (v.value if hasattr(v, "value") else v) for k, v in config.items()}


def _compile(layer_config_str: str, compute_config_str: str, configs: list[dict]) -> list:
    """One kernel table row per configuration (Humming compiles them in parallel); a configuration
    that fails to compile gets None (and the others are compiled one by one)."""
    from humming.kernel.humming import HummingKernel

    if not configs:
        return []
    try:
        table_ = HummingKernel.prepare_kernels(
            layer_config_str, compute_config_str, [[i, i + 1, c] for i, c in enumerate(configs)]
        )
        rows = table_.view(-1, 4)
        return [torch.tensor([0, 1 << 30, int(r[2]), int(r[3])], dtype=torch.int64) for r in rows]
    except Exception:
        out = []
        for c in configs:
            try:
                r = HummingKernel.prepare_kernels(layer_config_str, compute_config_str, c).view(-1, 4)[0]
                out.append(torch.tensor([0, 1 << 30, int(r[2]), int(r[3])], dtype=torch.int64))
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}"[:300])
        return out


def shape_row(name: str, n: int, k: int, deadline: float) -> dict:
    from humming import ops
    from humming.config import LayerConfig
    from humming.tune import get_heuristics_config

    w, sf = random_nvfp4(n, k, seed=sum(map(ord, name)) % 1000)
    orig_w, orig_sf = w.clone(), sf.clone()
    alpha = torch.tensor([1.0 / (2688.0 * 60.0)], device=DEV)
    humming.prepare_dense(w, sf, BF16, keep_original=False)
    prep = humming.prepared_for(w, BF16)
    lc_str, cc_str = prep.meta["layer_config"], prep.meta["compute_config"]
    lc_obj = json.loads(lc_str)
    lc_obj.pop("sublayer_name", None)
    layer_config = LayerConfig(**lc_obj)
    row: dict = {"shape": name, "n": n, "k": k, "m": {}, "illegal": {}, "compile_errors": {}}

    # The configurations: Humming's own per M, the decode families per bucket, the prefill families.
    configs: list[dict] = []
    index: dict[str, int] = {}

    def add(label: str, config: dict) -> None:
        key = json.dumps(config, sort_keys=True, default=str)
        if key not in index:
            index[key] = len(configs)
            configs.append(config)
        index[label] = index[key]

    for m in DECODE_M + PREFILL_M:
        add(f"default@{m}", get_heuristics_config(layer_config, shape_m=m, gemm_type="dense"))
    for bm in sorted({bucket_m(m) for m in DECODE_M}):
        for fam, config in decode_families(bm).items():
            ok, why = _legal(layer_config, bm, config)
            if not ok:
                row["illegal"][f"{fam} bm{bm}"] = why
            elif fam in DECODE_TIMED:
                add(f"{fam}@bm{bm}", _finish(layer_config, config))
    for fam, config in prefill_families().items():
        ok, why = _legal(layer_config, 1024, config)
        if not ok:
            row["illegal"][fam] = why
        else:
            add(f"{fam}@prefill", _finish(layer_config, config))
    t0 = time.perf_counter()
    kernels = _compile(lc_str, cc_str, configs)
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    row["kernels"] = len(configs)
    row["configs"] = {label: configs[i] for label, i in index.items() if "@" in label}

    # The weight's exact values in bf16 (E2M1 x E4M3 needs 5 significant bits): cuBLAS on them is the
    # reference every candidate is checked against (and the bf16 model the times are compared with).
    w_bf16 = nvfp4.dequantize_unscaled(orig_w, orig_sf, BF16)
    fp4_bytes = (
        prep.tensors["weight"].numel()
        + prep.tensors["weight_scale"].numel() * prep.tensors["weight_scale"].element_size()
    )
    r_fp4 = max(1, min(32, math.ceil(COLD_BYTES / fp4_bytes)))
    r_bf16 = max(1, min(32, math.ceil(COLD_BYTES / (2 * n * k))))
    copies = [(prep.tensors["weight"], prep.tensors["weight_scale"])] + [
        (prep.tensors["weight"].clone(), prep.tensors["weight_scale"].clone()) for _ in range(r_fp4 - 1)
    ]
    bf16_copies = [w_bf16] + [w_bf16.clone() for _ in range(r_bf16 - 1)]
    row["cold_copies"] = {"fp4": r_fp4, "bf16": r_bf16}

    def launch(kern, x, out, wt=None):
        wt = wt or copies[0]
        ops.launch_kernel(
            configs=kern,
            inputs=x,
            weight=wt[0],
            weight_scale=wt[1],
            weight_scale_2=alpha,
            outputs=out,
            locks=prep.locks,
        )

    for m in DECODE_M + PREFILL_M:
        if time.perf_counter() > deadline:
            row["stopped"] = f"budget reached before M={m}"
            break
        x, gx, a, a_sf = activations(m, k, seed=m)
        xq = nvfp4.dequantize_unscaled(a, a_sf, BF16)
        ref = torch.matmul(xq, w_bf16.T).float() * alpha
        decode = m <= 64
        cell: dict = {"candidates": {}}
        if m in (1, 1024):  # the bf16 reference against the W4A4 oracle itself
            oracle = nvfp4.reference_mm_fp4(a, orig_w.T, a_sf, orig_sf.T, alpha, torch.float32)
            cell["reference_vs_oracle"] = rel_err(ref, oracle)
            del oracle
        outs = [torch.empty(m, n, dtype=BF16, device=DEV) for _ in range(max(r_fp4, r_bf16))]
        if decode:
            cell["bf16_hot_ms"] = graph_ms(lambda: torch.matmul(x, w_bf16.T, out=outs[0]), 50)
            cell["bf16_cold_ms"] = (
                graph_ms(lambda: [torch.matmul(x, wb.T, out=o) for wb, o in zip(bf16_copies, outs)], 20) / r_bf16
            )
        else:
            cell["bf16_ms"] = events_ms(lambda: torch.matmul(x, w_bf16.T, out=outs[0]), 10)
        labels = [f"default@{m}"] + (
            [lab for lab in index if lab.endswith(f"@bm{bucket_m(m)}")]
            if decode
            else [lab for lab in index if lab.endswith("@prefill")]
        )
        seen = set()
        for label in labels:
            i = index[label]
            if i in seen:
                cell["candidates"][label.split("@")[0]] = {"same_as": "default"}
                continue
            seen.add(i)
            kern = kernels[i]
            fam = label.split("@")[0]
            if not isinstance(kern, torch.Tensor):
                cell["candidates"][fam] = {"error": kern}
                continue
            entry: dict = {}
            try:
                out = outs[0].fill_(float("nan"))
                launch(kern, xq, out)
                torch.cuda.synchronize()
                entry["finite"] = bool(torch.isfinite(out).all())
                entry["rel_err"] = rel_err(out, ref)
                if not entry["finite"] or entry.get("rel_err", 0) > 0.01:
                    entry["wrong"] = True
                    cell["candidates"][fam] = entry
                    continue
                if decode:
                    entry["hot_ms"] = graph_ms(lambda: launch(kern, xq, outs[0]), 50)
                    entry["cold_ms"] = (
                        graph_ms(lambda: [launch(kern, xq, o, c) for c, o in zip(copies, outs)], 20) / r_fp4
                    )
                else:
                    entry["ms"] = events_ms(lambda: launch(kern, xq, outs[0]), 10)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            cell["candidates"][fam] = entry
        row["m"][m] = cell
        x = a = a_sf = xq = ref = outs = None  # freed before the next shape (the timed lambdas read these names)
    copies = bf16_copies = w_bf16 = orig_w = orig_sf = (
        None  # freed before the next shape (the timed lambdas read these names)
    )
    return row


def dequant_rows() -> list[dict]:
    """The served dequantization kernel (CUDA C) against the memory floor, checked bit for bit against nvfp4's
    decode first. (The Triton fallback it was compared with was cut: ARCHITECTURE.md, "What was cut and why".)"""
    from sm120_fp4.backends.humming import cuda as _humming_cuda

    _humming_cuda.load(DEV)
    kernels = {"cuda": _humming_cuda.launch}
    rows = []
    for m, k in ((1, 8192), (64, 28672), (1024, 1024), (1024, 8192), (4096, 8192), (8192, 8192), (8192, 28672)):
        x, gx, a, a_sf = activations(m, k, seed=3)
        kp = nvfp4.swizzled_scale_shape(m, k)[1]
        want = nvfp4.dequantize_unscaled(a, a_sf, torch.float32).to(BF16)
        moved = m * k // 2 + a_sf.numel() + 2 * m * k
        row = {"m": m, "k": k, "floor_ms_at_4TBps": moved / 4.0e9}
        for name, launch in kernels.items():
            out = torch.full((m, k), float("nan"), dtype=BF16, device=DEV)
            launch(a, a_sf, out, kp)
            row[f"{name} exact"] = bool(torch.equal(out, want))
            # Graph replays: the kernel's own time, without its host launch cost (measured apart).
            row[f"{name} ms"] = graph_ms(lambda: launch(a, a_sf, out, kp), 30)
        rows.append(row)
    return rows


def host_rows() -> dict:
    """Host microseconds per call of the served call's parts (M=1, a small layer: the GPU keeps up)."""
    from humming import ops

    n, k, m = 1280, 1024, 1
    w, sf = random_nvfp4(n, k, seed=5)
    humming.prepare_dense(w, sf, BF16, keep_original=False)
    prep = humming.prepared_for(w, BF16)
    x, gx, a, a_sf = activations(m, k, seed=1)
    xq = nvfp4.dequantize_unscaled(a, a_sf, BF16)
    alpha = torch.tensor([1.0], device=DEV)
    out = torch.empty(m, n, dtype=BF16, device=DEV)
    humming.mm_fp4(a, w.T, a_sf, sf.T, alpha, BF16, out)
    from sm120_fp4.backends.humming import cuda as _humming_cuda

    kp = nvfp4.swizzled_scale_shape(m, k)[1]
    dq_out = torch.empty(m, k, dtype=BF16, device=DEV)

    def old_path():
        return ops.humming_gemm(
            layer_config=prep.meta["layer_config"],
            compute_config=prep.meta["compute_config"],
            tuning_config=prep.meta.get("tuning_config"),
            inputs=xq,
            weight=prep.tensors["weight"],
            weight_scale=prep.tensors["weight_scale"],
            weight_scale_2=alpha,
            outputs=out,
            locks=prep.locks,
        )

    parts = {
        "argument checks": lambda: check_mm_fp4_args(a, w.T, a_sf, sf.T, alpha, BF16, out),
        "dequantize_activations (served: CUDA C kernel, driver launch)": lambda: humming.dequantize_activations(
            a, a_sf, BF16
        ),
        "CUDA C dequantization kernel launch": lambda: _humming_cuda.launch(a, a_sf, dq_out, kp),
        "gemm via ops.humming_gemm (before)": old_path,
        "gemm via the cached kernel table (now)": lambda: humming.engine.current_engine().gemm(prep, xq, alpha, out),
        "served mm_fp4 (now)": lambda: humming.mm_fp4(a, w.T, a_sf, sf.T, alpha, BF16, out),
    }
    res = {}
    for name, fn in parts.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(400):
                fn()
            samples.append((time.perf_counter() - t0) / 400 * 1e6)
            torch.cuda.synchronize()
        res[name] = sorted(samples)[2]
    return res


def geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summarise(rows: list[dict]) -> dict:
    """Per M: each family's geomean of (default time / its time) over the target shapes (hot and cold)."""
    out: dict = {}
    targets = [r for r in rows if r["shape"] in DENSE]
    for m in DECODE_M + PREFILL_M:
        fams: dict = {}
        for r in targets:
            cell = r["m"].get(m) or r["m"].get(str(m))
            if not cell:
                continue
            default = cell["candidates"].get("default", {})
            for fam, e in cell["candidates"].items():
                for key in ("hot_ms", "cold_ms") if m <= 64 else ("ms",):
                    if key in e and key in default:
                        fams.setdefault(fam, {}).setdefault(key, []).append(default[key] / e[key])
        out[m] = {fam: {key: (round(geomean(v), 3), len(v)) for key, v in d.items()} for fam, d in fams.items()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--shapes", default="")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: dequant, host, holdout, sweep")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU with humming-kernels; nothing to measure here")
        return 0
    skip = set(filter(None, opts.skip.split(",")))
    start = time.perf_counter()
    deadline = start + opts.budget_s
    payload: dict = {"humming": humming.doctor_info(), "errors": []}
    if "dequant" not in skip:
        payload["dequant"] = dequant_rows()
        names = ("cuda",)
        print(
            table(
                ["M", "K", "floor ms"] + [f"{n} ms" for n in names] + ["all exact"],
                [
                    [r["m"], r["k"], r["floor_ms_at_4TBps"]]
                    + [r[f"{n} ms"] for n in names]
                    + [all(r[f"{n} exact"] for n in names)]
                    for r in payload["dequant"]
                ],
            ),
            flush=True,
        )
    if "host" not in skip:
        payload["host_us"] = host_rows()
        print(payload["host_us"], flush=True)
    shapes = {} if "sweep" in skip else dict(DENSE)
    if "holdout" not in skip and "sweep" not in skip:
        shapes.update(HOLDOUT)
    if opts.shapes:
        shapes = {s: shapes[s] for s in opts.shapes.split(",")}
    payload["shapes"] = []
    for name, (n, k) in shapes.items():
        if time.perf_counter() > deadline:
            payload["errors"].append(f"budget reached before {name}")
            break
        try:
            payload["shapes"].append(shape_row(name, n, k, deadline))
            r = payload["shapes"][-1]
            print(
                f"{name}: {r['kernels']} kernels compiled in {r['compile_s']} s; {len(r['illegal'])} illegal; "
                f"{time.perf_counter() - start:.0f} s so far",
                flush=True,
            )
        except Exception as exc:
            payload["errors"].append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            print(payload["errors"][-1], flush=True)
        write("humming_tune", payload)
        torch.cuda.empty_cache()
    payload["summary"] = summarise(payload["shapes"])
    for m, fams in payload["summary"].items():
        best = sorted(fams.items(), key=lambda kv: -(kv[1].get("cold_ms") or kv[1].get("ms") or (0, 0))[0])[:5]
        print(m, [(f, v) for f, v in best])
    # The compact per-shape winner table.
    rows = []
    for r in payload["shapes"]:
        for m, cell in r["m"].items():
            key = "cold_ms" if m <= 64 else "ms"
            cands = {f: e[key] for f, e in cell["candidates"].items() if key in e}
            if not cands:
                continue
            best = min(cands, key=cands.get)
            bf = cell.get("bf16_cold_ms" if m <= 64 else "bf16_ms")
            hot = {f: e["hot_ms"] for f, e in cell["candidates"].items() if "hot_ms" in e}
            best_hot = min(hot, key=hot.get) if hot else ""
            rows.append(
                [
                    r["shape"],
                    m,
                    cands.get("default", float("nan")),
                    best,
                    cands[best],
                    bf / cands.get("default", float("nan")),
                    bf / cands[best],
                    best_hot,
                    (cell.get("bf16_hot_ms", 0) / hot[best_hot]) if hot else "",
                    (cell.get("bf16_hot_ms", 0) / hot["default"]) if "default" in hot else "",
                ]
            )
    print(
        table(
            [
                "shape",
                "M",
                "default ms",
                "best (cold/eager)",
                "best ms",
                "bf16/default",
                "bf16/best",
                "best hot",
                "bf16/best hot",
                "bf16/default hot",
            ],
            rows,
        )
    )
    write("humming_tune", payload)
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
