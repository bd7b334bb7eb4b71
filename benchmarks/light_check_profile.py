"""Where a light layer check's time goes: CPU, GPU, launches and host synchronisations per check.

    .venv/bin/python benchmarks/light_check_profile.py --quick   # CPU: small layers (a smoke run)
    python3 benchmarks/light_check_profile.py [--kernel humming]  # on a GPU: 70B-class TP1 shapes

Every NVFP4 layer after a configuration's first gets a light check (its own weights, one decode
batch, its fingerprint before and after): 316 of a 70B-class model's 320 layers, most of the
dense layer-check cost (the target: all of them <= 1.5 s per GPU). Per configuration of
`selftest_cost.py`'s shapes this times `--layers` light checks through serving.verify_layer, then
profiles as many more (torch.profiler): per check the wall time, the CPU time, the time the GPU was
busy, the kernel launches and the host synchronisations, and which of the library's steps hold the
CPU time. A check whose CPU time is well above its GPU time is bound by launches and Python, not
by the GPU's bandwidth: a faster GPU would not make it cheaper.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import selftest_cost as sc
import torch
from _common import table, write
from torch.profiler import ProfilerActivity, profile, record_function

from sm120_fp4 import devices, nvfp4, serving, verify
from sm120_fp4.config import Settings
from sm120_fp4.sglang import hooks

# The library's steps of a light check, each shown with its CPU time per check.
STEPS = [
    (hooks, "_served_cases", "inputs + oracle"),
    (nvfp4, "reference_mm_fp4", "reference_mm_fp4 (the oracle's and emulated's own)"),
    (verify.engine, "_call", "the served call (kernel), synchronised"),
    (verify.engine, "fingerprint", "fingerprints (2)"),
    (verify, "fingerprint", "fingerprints (2)"),
    (verify.engine, "_compare", "comparison"),
]
LABELS = list(
    dict.fromkeys(label for _, _, label in STEPS)
)  # their ranges on the GPU's timeline are annotations, not work


def _traced(mod, name: str, label: str) -> None:
    fn = getattr(mod, name)

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    setattr(mod, name, traced)


def _device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small layers, few checks (a CPU smoke run of the same code)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="light checks timed, and as many profiled (default 20, --quick 3)"
    )
    parser.add_argument(
        "--kernel",
        choices=("emulated", "humming"),
        default="emulated",
        help="the served backend (humming: a real NVFP4-weight kernel on SM90; its kernels compiled first)",
    )
    args = parser.parse_args()
    layers = args.layers or (3 if args.quick else 20)
    settings = Settings(simulate="12.0", backends=args.kernel, moe_backends=args.kernel)
    device = devices.list_devices(settings.simulated_capability)[0]
    tdev = device.torch_device
    scale = 16 if args.quick or not device.is_cuda else 1
    if args.quick:
        hooks.DEFAULT_CHUNKED_PREFILL = 2048
    for mod, name, label in STEPS:
        _traced(mod, name, label)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.is_cuda else [])
    sc.warm_up(args.kernel, scale, device, settings, (1,))
    serving.route(device.index, settings)
    sc.prepare_quantizer(tdev, (1,), scale)
    rows, steps, payload = [], [], {}
    for name, (n, k) in sc.tp_configs(1, scale).items():
        _, report = sc.time_check(
            sc.dense_layer(n, k, tdev, args.kernel), device, settings
        )  # the full sweep: the configuration's first layer
        assert report is not None and report.passed, report and report.reason
        others = [sc.dense_layer(n, k, tdev, args.kernel) for _ in range(2 * layers)]
        walls = []
        for layer in others[:layers]:
            seconds, report = sc.time_check(layer, device, settings)
            assert report is not None and report.passed, report and report.reason
            walls.append(seconds)
        with profile(activities=activities) as prof:
            for layer in others[layers:]:
                _, report = sc.time_check(layer, device, settings)
                assert report is not None and report.passed, report and report.reason
        events = prof.key_averages()
        cpu = torch.autograd.DeviceType.CPU
        count = {e.key: e.count for e in events}
        cpu_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / layers
        gpu_ms = sum(_device_us(e) for e in events if e.device_type != cpu and e.key not in LABELS) / 1e3 / layers
        launches = (
            count.get("cudaLaunchKernel", 0) + count.get("cudaLaunchKernelExC", 0) + count.get("cudaGraphLaunch", 0)
        ) / layers
        syncs = (count.get("cudaStreamSynchronize", 0) + count.get("cudaDeviceSynchronize", 0)) / layers
        wall_ms = statistics.median(walls) * 1e3
        rows.append([name, f"N={n} K={k}", wall_ms, cpu_ms, gpu_ms, launches, syncs])
        total = {e.key: e.cpu_time_total / 1e3 / layers for e in events if e.device_type == cpu}
        step_ms = [total.get(label, 0.0) for label in LABELS]
        steps.append([name, *step_ms])
        payload[name] = {
            "n": n,
            "k": k,
            "wall_ms": wall_ms,
            "cpu_ms_profiled": cpu_ms,
            "gpu_busy_ms": gpu_ms,
            "launches": launches,
            "host_syncs": syncs,
            "steps_cpu_ms": dict(zip(LABELS, step_ms)),
        }
        del others
        serving.STATE.reset()
        serving.route(device.index, settings)
    print(
        f"on {device.label()}, {args.kernel} backend, {layers} light checks timed and {layers} profiled per configuration"
        + (" (--quick: layers / 16)" if scale > 1 else "")
        + "\n"
    )
    print(
        table(
            [
                "configuration",
                "shape",
                "light check ms (median)",
                "CPU ms (profiled)",
                "GPU busy ms",
                "launches",
                "host syncs",
            ],
            rows,
        )
    )
    print("\nCPU ms per light check in the library's steps (profiled; inclusive, so nested steps overlap):\n")
    print(table(["configuration", *LABELS], steps))
    write(
        "light_check_profile",
        {
            "device": device.label(),
            "kernel": args.kernel,
            "quick": scale > 1,
            "layers": layers,
            "configurations": payload,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
