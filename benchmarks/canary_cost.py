"""What the serving canary costs a server: the longest pause it adds at an idle point (between two
forward passes), and its share of the time at a period of 60 s.

    .venv/bin/python benchmarks/canary_cost.py --quick     # CPU: simulated sm_120, layers / 16, TP8, 6 graph sizes
    python3 benchmarks/canary_cost.py [--kernel humming]    # on a GPU: emulated (or humming) on CUDA

The distinct dense configurations of a 70B-class model (Llama-3-70B: qkv, o_proj, gate_up, down) at
TP1 and TP8, and an NVFP4 MoE layer of a DeepSeek-V3 / GLM-class model (E=256, H=7168, top-8) at TP1
and TP8, are verified as at load (serving.verify_layer, the emulated backend: the only one that runs
off SM120, or --kernel humming; the layer's call is the routed backend after a quantizer, as
benchmarks/selftest_cost.py), then re-checked at every captured graph size as after SGLang's warm-up.
Then the canary (sm120_fp4.canary.Canary, SM120_FP4_CANARY=60, SM120_FP4_CANARY_SLICE_MS=5, the
captured graph sizes of SGLang 0.5.23's defaults) is driven one period at a time, its idle point
called back to back, through enough periods that every configuration runs at every decode and larger
batch size of its rotation. Each idle point that runs something runs one whole run (the weight
fingerprints, then the light check at a decode size and a larger one, two passes, every call
checked, the serving stream synchronised at its end): its time, as the serving thread measures it,
is the pause it adds. Reported per model: the longest pause (also less the backend's calls, which
take microseconds on SM120; and over the second half of the runs, after each configuration's runs
over the slice capped its sizes), how many pauses were over the slice, the mean time per period and
its share of 60 s, the peak memory the runs add, and the sizes left beyond the slice. A number,
not a target. Written to benchmarks/results/canary_cost-<machine>.json (`longest_pause_ms`).
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

import torch
from _common import table, write
from selftest_cost import CAPTURED, PEAKS, MoeLayer, dense_layer, prepare_quantizer, tp_configs

from sm120_fp4 import backends, canary, devices, graphs, serving, verify
from sm120_fp4.config import Settings
from sm120_fp4.sglang import moe

PERIOD_S = 60.0
SLICE_MS = 5.0


class Clock:
    """The canary's one clock: the real time (what a run costs), moved on a period at a time by drive()."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now + time.perf_counter()


def drive(c: canary.Canary, periods: int) -> list[canary.CanaryRun]:
    """`periods` periods of an idle server: the clock moves one period, the idle point is called until
    the period's runs are done."""
    runs = []
    for _ in range(periods):
        c.clock.now += c.period
        done, give_up = c.runs, time.monotonic() + 60.0
        while time.monotonic() < give_up:
            c.idle()
            if c.runs > done and not c._queue:
                break
        runs += c.status().recent[-(c.runs - done) :]
    return runs


PAUSES: list[
    tuple[float, float, str]
] = []  # every idle point that ran a run: (ms, of it the backend's calls, ms, what)
_in_run = [0.0]
_run_sweep = verify.Sweep.run
_run = canary.Canary._run


def _recording_pass(self, *args, **kwargs):
    """verify.Sweep.run, adding up how long the backend's own calls took in it (the rest of a
    run, the inputs, the oracle and the comparisons, stays the same on SM120, where the kernel is far
    faster). The device is synchronised first, so that a call's time (it synchronises after the call)
    holds the call's own GPU time and not the oracle's queued before it."""
    if self.device.type == "cuda":
        torch.cuda.synchronize(self.device)
    before = sum(r.duration_s for r in self.results)
    try:
        return _run_sweep(self, *args, **kwargs)
    finally:
        _in_run[0] += sum(r.duration_s for r in self.results) - before


def _recording_run(self, job):
    """canary.Canary._run (one whole run at one idle point), timed as the serving thread sees it,
    with its backend calls added up."""
    _in_run[0], start = 0.0, time.perf_counter()
    try:
        return _run(self, job)
    finally:
        PAUSES.append(((time.perf_counter() - start) * 1e3, _in_run[0] * 1e3, f"{job.served.check.label} M={job.ms}"))


verify.Sweep.run = _recording_pass
canary.Canary._run = _recording_run


QUICK_CAPTURED = [1, 2, 4, 8, 128, 256]  # --quick: a few of the captured sizes (the re-check runs every one)


def measure(label: str, settings: Settings, tdev: torch.device, periods: int, captured: list[int] = CAPTURED) -> dict:
    """The canary over the configurations verified so far (serving's state), after the re-check
    SGLang's warm-up triggers at every captured graph size (as in a server; a JIT-compiling backend
    compiles those sizes' kernels there)."""
    reports = serving.recheck(settings, captured)
    assert all(r.passed for r in reports), [r.reason for r in reports if not r.passed]
    c = canary.Canary(settings)
    c.clock = Clock()
    c.on_warmup(captured)
    c.idle()  # armed
    if tdev.type == "cuda":
        torch.cuda.synchronize(tdev)
    PEAKS.start(tdev)  # the runs' peak, split at the served calls (selftest_cost.Peaks)
    start = time.perf_counter()
    PAUSES.clear()
    runs = drive(c, periods)
    wall = time.perf_counter() - start
    peaks = PEAKS.stop()
    peak = peaks.get("total")
    assert all(r.passed for r in runs), [r.reason for r in runs if not r.passed]
    status = c.status()
    pauses = [ms for ms, _, _ in PAUSES]
    less = [ms - backend for ms, backend, _ in PAUSES]
    longest = max(PAUSES)
    per_period = sum(r.busy_ms for r in runs) / periods
    after_cap = pauses[len(pauses) // 2 :]  # the second half: every configuration's cap found by then
    print(
        f"{label}: {len(runs)} runs, {per_period:.2f} ms per period ({per_period / 1e3 / PERIOD_S:.4%} of {PERIOD_S:g} s); "
        f"longest pause at an idle point {longest[0]:.1f} ms ({longest[1]:.1f} ms of it the backend's calls; {longest[2]}); "
        f"pauses over the {SLICE_MS:g} ms slice: {sum(ms > SLICE_MS for ms in pauses)} of {len(pauses)}"
        + (
            f"; peak extra GPU memory {peaks['total']:.0f} MiB: the runs' own {peaks['own']:.0f} MiB (bound "
            f"{devices.CHECK_MEMORY_BYTES / 2**20:.0f} MiB), the largest served call's own {peaks['served']:.0f} MiB"
            if peaks
            else ""
        ),
        flush=True,
    )
    return {
        "label": label,
        "periods": periods,
        "runs": len(runs),
        "wall_s": wall,
        "per_period_ms": per_period,
        "share": per_period / 1e3 / PERIOD_S,
        "longest_pause_ms": longest[0],
        "longest_pause_backend_ms": longest[1],
        "longest_pause": longest[2],
        "longest_pause_less_backend_ms": max(less),
        "longest_pause_second_half_ms": max(after_cap),
        "pauses": len(pauses),
        "pauses_over_slice": sum(ms > SLICE_MS for ms in pauses),
        "pause_ms_p50_p99": [statistics.median(pauses), sorted(pauses)[int(0.99 * (len(pauses) - 1))]],
        "peak_extra_mib": peak,
        "peak_own_mib": peaks.get("own"),
        "peak_served_call_mib": peaks.get("served"),
        "check_memory_bound_mib": devices.CHECK_MEMORY_BYTES / 2**20,
        "beyond_slice": status.beyond_slice,
        "larger_sizes_run": sorted({r.ms[-1] for r in runs}),
        "decode_sizes_run": sorted({r.ms[0] for r in runs}),
        "pauses_ms": [[round(ms, 3), what] for ms, _, what in PAUSES],
    }


def rounds_needed(checks) -> int:
    """Runs per configuration that cover every decode and larger batch size of its rotation."""
    ms = sorted(set(CAPTURED) | {m for c in checks for m in (*c.ms, *c.recheck_ms)})
    return max(sum(m < canary.SMALL_M for m in ms), sum(m >= canary.SMALL_M for m in ms))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small layers, few periods (a CPU smoke run of the same code)"
    )
    parser.add_argument(
        "--part",
        choices=("all", "dense", "moe"),
        default="all",
        help="the dense configurations, the MoE layer, or both",
    )
    parser.add_argument(
        "--kernel",
        choices=("emulated", "humming"),
        default="emulated",
        help="the served backend (humming: a real NVFP4-weight kernel on SM90)",
    )
    parser.add_argument(
        "--tp", default=None, help="the tensor-parallel sizes whose layer shapes are measured (default 1,8; --quick: 8)"
    )
    parser.add_argument(
        "--captures",
        action="store_true",
        help=("let the canary's runs capture CUDA graphs, as they did before graphs.no_capture (an A/B in one run)"),
    )
    args = parser.parse_args()
    if args.captures:
        graphs.no_capture = contextlib.nullcontext
    tps = tuple(int(t) for t in (args.tp or ("8" if args.quick else "1,8")).split(","))
    captured = QUICK_CAPTURED if args.quick else CAPTURED
    settings = Settings(
        simulate="12.0",
        backends=args.kernel,
        moe_backends=args.kernel,
        canary=str(PERIOD_S),
        canary_slice_ms=str(SLICE_MS),
    )
    device = devices.list_devices(settings.simulated_capability)[0]
    tdev = device.torch_device
    scale = 16 if args.quick or not device.is_cuda else 1
    results, rows = [], []
    if (
        args.part != "moe"
    ):  # the stand-in for SGLang's quantizer replayed from graphs, captured here (selftest_cost.StandInQuantizer)
        prepare_quantizer(tdev, tps, scale)

    for tp in tps if args.part != "moe" else ():
        serving.STATE.reset()
        serving.route(device.index, settings)
        checks = []
        for name, (n, k) in tp_configs(tp, scale).items():
            check = dense_layer(n, k, tdev, args.kernel)
            report = serving.verify_layer(device.index, check, settings)
            assert report is not None and report.passed, report and report.reason
            checks.append(check)
        periods = len(checks) * (3 if args.quick else rounds_needed(checks))
        results.append(measure(f"70B-class dense TP{tp}", settings, tdev, periods, captured))

    for tp in tps if args.part != "dense" else ():
        serving.STATE.reset()
        serving.route(device.index, settings, "moe")
        experts, hidden, inter = (256, 7168, 2048 // tp) if scale == 1 else (32, 512, 256 // tp)
        layer = MoeLayer(experts, hidden, inter, 8, tdev)
        check = moe.moe_check("bench-moe", layer, serve=PEAKS.wrap(backends.resolve_moe(args.kernel)))
        report = serving.verify_layer(device.index, check, settings)
        assert report is not None and report.passed, report and report.reason
        periods = 3 if args.quick else rounds_needed([check])
        results.append(measure(f"MoE E={experts} H={hidden} I={inter} top-8 TP{tp}", settings, tdev, periods, captured))
        del layer

    print(
        f"on {device.label()}, {args.kernel} backend{' (--quick: layers / 16)' if scale > 1 else ''}"
        f"{', runs may capture graphs (--captures)' if args.captures else ''}; "
        f"SM120_FP4_CANARY={PERIOD_S:g}, SM120_FP4_CANARY_SLICE_MS={SLICE_MS:g}, {len(captured)} captured graph sizes\n"
    )
    for r in results:
        rows.append(
            [
                r["label"],
                r["runs"],
                r["per_period_ms"],
                f"{r['share']:.4%}",
                r["longest_pause_ms"],
                r["longest_pause_less_backend_ms"],
                r["longest_pause_second_half_ms"],
                f"{r['pauses_over_slice']} of {r['pauses']}",
                "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}",
                "-" if r["peak_own_mib"] is None else f"{r['peak_own_mib']:.0f}",
            ]
        )
    print(
        table(
            [
                "model",
                "runs",
                "ms per period",
                "share of 60 s",
                "longest pause ms",
                "less the backend's calls",
                "longest pause, second half",
                f"pauses over {SLICE_MS:g} ms",
                "peak extra MiB",
                "of it the runs' own",
            ],
            rows,
        )
    )
    for r in results:
        print(
            f"\n{r['label']}: longest pause {r['longest_pause_ms']:.1f} ms ({r['longest_pause']}); batch sizes "
            f"re-checked: decode {r['decode_sizes_run']}, larger {r['larger_sizes_run']}; beyond the slice: "
            f"{'; '.join(r['beyond_slice']) or 'none'}"
        )
    longest = max(r["longest_pause_ms"] for r in results)
    print(f"\nthe longest pause the canary added at one idle point: {longest:.2f} ms ({device.label()}, {args.kernel})")
    write(
        "canary_cost_captures" if args.captures else "canary_cost",
        {
            "device": device.label(),
            "quick": scale > 1,
            "kernel": args.kernel,
            "captures_in_runs": args.captures,
            "period_s": PERIOD_S,
            "slice_ms": SLICE_MS,
            "captured": len(captured),
            "longest_pause_ms": longest,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
