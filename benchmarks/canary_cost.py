"""What the serving canary costs a server: its share of the time at a period of 60 s, and the longest
slice it adds between two forward passes.

    .venv/bin/python benchmarks/canary_cost.py [--quick]   # CPU: simulated sm_120, layers / 16
    python3 benchmarks/canary_cost.py                       # on a GPU: emulated on CUDA

The distinct dense configurations of a 70B-class model (Llama-3-70B: qkv, o_proj, gate_up, down) at
TP1 and TP8, and an NVFP4 MoE layer of a DeepSeek-V3 / GLM-class model (E=256, H=7168, top-8) at TP1
and TP8, are verified as at load (serving.verify_layer, the emulated backend: the only one that runs
off SM120, or --kernel humming; the layer's call is the routed backend after a quantizer, as
benchmarks/selftest_cost.py), then re-checked at every captured graph size as after SGLang's warm-up.
Then the canary (sm120_fp4.canary.Canary, SM120_FP4_CANARY=60, SM120_FP4_SLICE_MS=5, the captured
graph sizes of SGLang 0.5.23's defaults) is driven one period at a time, its idle point called back to
back, through enough periods that every configuration runs at every decode and larger batch size of
its rotation. Reported per configuration and batch size: each step (a run's weight fingerprints; a
batch size's check built, then its two passes, a step each where the check keeps at most
canary.KEEP_BYTES meanwhile, else all three in one step; every call checked) as the serving thread
measures it; per model: the mean time per period and its share of 60 s,
the longest slice (also less the backend's calls, which take microseconds on SM120), the peak memory
the steps add. Targets: share <= 0.5 %, longest slice <= 5 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import table, write  # noqa: E402
from selftest_cost import CAPTURED, MoeLayer, dense_layer, prepare_quantizer, tp_configs  # noqa: E402
from sm120_fp4 import backends, canary, devices, graphs, serving, verify  # noqa: E402
from sm120_fp4.config import Settings  # noqa: E402
from sm120_fp4.sglang import moe  # noqa: E402

PERIOD_S = 60.0
SHARE_TARGET = 0.005
SLICE_TARGET_MS = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(c: canary.Canary, periods: int) -> list[canary.CanaryRun]:
    """`periods` periods of an idle server: the clock moves one period, the idle point is called until
    the period's runs are done."""
    runs = []
    for _ in range(periods):
        c.clock.now += c.period
        done, give_up = c.runs, time.monotonic() + 60.0
        while time.monotonic() < give_up:  # an idle point may run nothing (a fetch on its way)
            c.idle()
            if c.runs > done and not c._queue:
                break
        runs += c.status().recent[-(c.runs - done):]
    return runs


KERNEL_MS: dict[tuple, float] = {}  # (family, index, key, kind, M) -> the backend's calls in that step (longest)
_in_step = [0.0]
_run_pass = verify.Sweep.run_pass
_step = canary.Canary._step


def _recording_pass(self, *args, **kwargs):
    """selftest.Sweep.run_pass, adding up how long the backend's own calls took in it (the rest of a
    step, the inputs, the oracle and the comparisons, stays the same on SM120, where the kernel is
    far faster). The device is synchronised first, so that a call's time (it synchronises after the
    call) holds the call's own GPU time and not the oracle's queued before it: the step's time is
    the same either way, its split between the backend and the rest is not."""
    if self.device.type == "cuda":
        torch.cuda.synchronize(self.device)
    before = sum(r.duration_s for r in self.results)
    try:
        return _run_pass(self, *args, **kwargs)
    finally:
        _in_step[0] += sum(r.duration_s for r in self.results) - before


LONGEST: dict[tuple, tuple[float, int]] = {}  # (family, index, key, kind, M) -> its longest step: (ms, graph captures in it)


def _captures() -> int:
    return sum(d["captures"] for d in graphs.stats().values())


def _recording_step(self, job, kind, m):
    _in_step[0] = 0.0
    captures, start = _captures(), time.perf_counter()
    report = _step(self, job, kind, m)
    key = job.key + (kind, m)
    ms = (time.perf_counter() - start) * 1e3
    if ms > LONGEST.get(key, (0.0, 0))[0]:
        LONGEST[key] = (ms, _captures() - captures)
    KERNEL_MS[key] = max(KERNEL_MS.get(key, 0.0), _in_step[0] * 1e3)
    _in_slice[0] += _in_step[0]
    return report


SLICES: list[tuple[float, float]] = []  # every slice: (ms, of it the backend's calls, ms)
_slice = canary.Canary._slice
_in_slice = [0.0]


def _recording_slice(self):
    """canary.Canary._slice, timed as the serving thread sees it, with its steps' backend calls added
    up: on SM120 a FlashInfer call at these sizes takes microseconds, so the slice less the backend's
    calls is what the slice bound holds there (the oracle's part grows there, see BENCHMARKS.md)."""
    _in_slice[0], start = 0.0, time.perf_counter()
    try:
        return _slice(self)
    finally:
        SLICES.append(((time.perf_counter() - start) * 1e3, _in_slice[0] * 1e3))


verify.Sweep.run_pass = _recording_pass
canary.Canary._step = _recording_step
canary.Canary._slice = _recording_slice


def step_name(config: str, kind: str, m: int) -> str:
    return f"{config}: weight fingerprints" if kind == "weights" else f"{config} M={m} ({kind})"


def measure(label: str, settings: Settings, tdev: torch.device, periods: int) -> dict:
    """The canary over the configurations verified so far (serving's state), after the re-check
    SGLang's warm-up triggers at every captured graph size (as in a server; a JIT-compiling backend
    compiles those sizes' kernels there)."""
    reports = serving.recheck(settings, CAPTURED)
    assert all(r.passed for r in reports), [r.reason for r in reports if not r.passed]
    c = canary.Canary(settings)
    c.clock = Clock()
    c.on_warmup(CAPTURED)
    c.idle()  # armed
    if tdev.type == "cuda":
        torch.cuda.synchronize(tdev)
        torch.cuda.reset_peak_memory_stats(tdev)
        before = torch.cuda.memory_allocated(tdev)
    start = time.perf_counter()
    SLICES.clear()
    runs = drive(c, periods)
    slices = [ms for ms, _ in SLICES]
    less = [ms - backend for ms, backend in SLICES]
    wall = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(tdev) - before) / 2**20 if tdev.type == "cuda" else None
    assert all(r.passed for r in runs), [r.reason for r in runs if not r.passed]
    status = c.status()
    per_period = sum(r.busy_ms for r in runs) / periods
    steps, kernel = [], {}
    for (family, index, key, kind, m), seconds in c._estimate.items():
        config = next(s.check.label for s in serving.served_configurations() if s.check.key == key)
        name = step_name(config, kind, m)
        longest, captures = LONGEST.get((family, index, key, kind, m), (0.0, 0))
        steps.append({"step": name, "kind": kind, "m": m, "ms": seconds * 1e3, "longest_ms": longest, "captures_in_longest": captures})
        kernel[name] = KERNEL_MS.get((family, index, key, kind, m))
    print(f"{label}: {len(runs)} runs, {per_period:.2f} ms per period ({per_period / 1e3 / PERIOD_S:.4%} of {PERIOD_S:g} s), "
          f"longest slice {status.longest_slice_ms:.1f} ms ({max(less):.1f} ms less the backend's calls; slices over "
          f"{SLICE_TARGET_MS:g} ms: {sum(ms > SLICE_TARGET_MS for ms in slices)} of {len(slices)}, less the backend's: "
          f"{sum(ms > SLICE_TARGET_MS for ms in less)}), longest step {status.longest_step_ms:.1f} ms ({status.longest_step})",
          flush=True)
    return {"label": label, "periods": periods, "runs": len(runs), "wall_s": wall, "per_period_ms": per_period,
            "share": per_period / 1e3 / PERIOD_S, "longest_slice_ms": status.longest_slice_ms,
            "longest_slice_less_backend_ms": max(less), "slices": len(slices),
            "slices_over": sum(ms > SLICE_TARGET_MS for ms in slices), "slices_over_less_backend": sum(ms > SLICE_TARGET_MS for ms in less),
            "slice_ms_p50_p99": [statistics.median(slices), sorted(slices)[int(0.99 * (len(slices) - 1))]],
            "longest_step_ms": status.longest_step_ms, "longest_step": status.longest_step,
            "max_slices_per_run": max(r.slices for r in runs), "peak_extra_mib": peak, "beyond_slice": status.beyond_slice,
            "larger_sizes_run": sorted({r.ms[-1] for r in runs}), "decode_sizes_run": sorted({r.ms[0] for r in runs}),
            "steps": sorted(steps, key=lambda st: (st["step"].split(" M=")[0], st["m"], st["kind"])), "kernel_ms": kernel}


def rounds_needed(checks) -> int:
    """Runs per configuration that cover every decode and larger batch size of its rotation."""
    ms = sorted(set(CAPTURED) | {m for c in checks for m in (*c.ms, *c.recheck_ms)})
    return max(sum(m < canary.SMALL_M for m in ms), sum(m >= canary.SMALL_M for m in ms))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small layers, few periods (a CPU smoke run of the same code)")
    parser.add_argument("--part", choices=("all", "dense", "moe"), default="all", help="the dense configurations, the MoE layer, or both")
    parser.add_argument("--kernel", choices=("emulated", "humming"), default="emulated",
                        help="the served backend (humming: a real NVFP4-weight kernel on SM90)")
    parser.add_argument("--tp", default="1,8", help="the tensor-parallel sizes whose layer shapes are measured (default 1,8)")
    parser.add_argument("--captures", action="store_true", help=(
        "let the canary's steps capture CUDA graphs, as they did before graphs.no_capture (an A/B in one run)"))
    args = parser.parse_args()
    if args.captures:
        graphs.no_capture = contextlib.nullcontext
    tps = tuple(int(t) for t in args.tp.split(","))
    settings = Settings(simulate="12.0", backends=args.kernel, moe_backends=args.kernel, canary=str(PERIOD_S), canary_slice_ms="5")
    device = devices.list_devices(settings.simulated_capability)[0]
    tdev = device.torch_device
    scale = 16 if args.quick or not device.is_cuda else 1
    results, rows = [], []
    if args.part != "moe":  # the stand-in for SGLang's quantizer replayed from graphs, captured here (selftest_cost.StandInQuantizer)
        prepare_quantizer(tdev, tps, scale)

    for tp in tps if args.part != "moe" else ():
        serving.clear()
        serving.route(device.index, settings)
        checks = []
        for name, (n, k) in tp_configs(tp, scale).items():
            check = dense_layer(n, k, tdev, args.kernel)
            report = serving.verify_layer(device.index, check, settings)
            assert report is not None and report.passed, report and report.reason
            checks.append(check)
        periods = len(checks) * (3 if args.quick else rounds_needed(checks))
        results.append(measure(f"70B-class dense TP{tp}", settings, tdev, periods))

    for tp in tps if args.part != "dense" else ():
        serving.clear()
        serving.route(device.index, settings, "moe")
        experts, hidden, inter = (256, 7168, 2048 // tp) if scale == 1 else (32, 512, 256 // tp)
        layer = MoeLayer(experts, hidden, inter, 8, tdev)
        check = moe.moe_check("bench-moe", layer, serve=backends.resolve_moe(args.kernel))
        report = serving.verify_layer(device.index, check, settings)
        assert report is not None and report.passed, report and report.reason
        periods = 3 if args.quick else rounds_needed([check])
        results.append(measure(f"MoE E={experts} H={hidden} I={inter} top-8 TP{tp}", settings, tdev, periods))
        del layer

    print(f"on {device.label()}, {args.kernel} backend{' (--quick: layers / 16)' if scale > 1 else ''}"
          f"{', the steps may capture graphs (--captures)' if args.captures else ''}; "
          f"SM120_FP4_CANARY={PERIOD_S:g}, slice bound {SLICE_TARGET_MS:g} ms, {len(CAPTURED)} captured graph sizes\n")
    for r in results:
        rows.append([r["label"], r["runs"], r["per_period_ms"], f"{r['share']:.4%}", r["longest_slice_ms"],
                     r["longest_slice_less_backend_ms"], f"{r['slices_over']} / {r['slices_over_less_backend']} of {r['slices']}",
                     r["max_slices_per_run"],
                     "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"])
    print(table(["model", "runs", "ms per period", "share of 60 s", "longest slice ms", "less the backend's calls",
                 f"slices over {SLICE_TARGET_MS:g} ms (less the backend's)", "slices per run (max)",
                 "peak extra MiB"], rows))
    for r in results:
        over = sorted({st["m"] for st in r["steps"] if st["ms"] > SLICE_TARGET_MS and st["kind"] != "weights"})
        prints = [st["ms"] for st in r["steps"] if st["kind"] == "weights"]
        print(f"\n{r['label']}: longest step {r['longest_step_ms']:.1f} ms ({r['longest_step']}); steps above "
              f"{SLICE_TARGET_MS:g} ms at M = {', '.join(map(str, over)) or 'none'}; the weight fingerprints' step: longest "
              f"{max(prints, default=0.0):.2f} ms")
        print(f"  batch sizes re-checked: decode {r['decode_sizes_run']}, larger {r['larger_sizes_run']}; beyond the slice: "
              f"{'; '.join(r['beyond_slice']) or 'none'}")
        for what, sizes in (("decode sizes (M < 128)", lambda m: m < canary.SMALL_M), ("larger sizes", lambda m: m >= canary.SMALL_M)):
            took = [(st["ms"], st["ms"] - (r["kernel_ms"].get(st["step"]) or 0.0)) for st in r["steps"]
                    if st["kind"] != "weights" and sizes(st["m"])]
            if took:
                print(f"  steps at {what}: median {statistics.median(t for t, _ in took):.2f} ms, longest {max(t for t, _ in took):.2f} ms; "
                      f"less the backend's calls: median {statistics.median(x for _, x in took):.2f} ms, longest {max(x for _, x in took):.2f} ms")
        worst = sorted(r["steps"], key=lambda st: -st["ms"])[:6]
        print(table(["step (configuration, M)", "ms", "of it the backend's calls, ms"],
                    [[st["step"], st["ms"], r["kernel_ms"].get(st["step"]) or "-"] for st in worst]))
        once = sorted(r["steps"], key=lambda st: -st["longest_ms"])[:6]
        print(table(["step (configuration, M)", "its longest time, ms", "graph captures in it"],
                    [[st["step"], st["longest_ms"], st["captures_in_longest"]] for st in once]))
    share_met = all(r["share"] <= SHARE_TARGET for r in results)
    slice_met = all(r["longest_slice_ms"] <= SLICE_TARGET_MS for r in results)
    less_met = all(r["longest_slice_less_backend_ms"] <= SLICE_TARGET_MS for r in results)
    print(f"\nshare of GPU time at {PERIOD_S:g} s: target <= {SHARE_TARGET:.1%}: {'met' if share_met else 'NOT met'}; "
          f"longest slice: target <= {SLICE_TARGET_MS:g} ms: {'met' if slice_met else 'NOT met'} "
          f"({'met' if less_met else 'NOT met'} less the {args.kernel} backend's calls)")
    write("canary_cost_captures" if args.captures else "canary_cost", {
        "device": device.label(), "quick": scale > 1, "kernel": args.kernel, "captures_in_steps": args.captures,
        "period_s": PERIOD_S, "captured": len(CAPTURED), "results": results,
        "met": {"share": share_met, "slice": slice_met, "slice_less_backend": less_met},
        "targets": {"share": SHARE_TARGET, "slice_ms": SLICE_TARGET_MS}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
