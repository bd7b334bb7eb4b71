"""``sm120-fp4 bench``: its options, its Markdown table, JSON and plot."""

from __future__ import annotations

import json
import os

from .. import backends
from ..devices import Device
from .measure import BF16, DECODE_SIZES, PREFILL_SIZES, configurations, eprint, run


def table(result: dict) -> list[str]:
    """Return the result as a Markdown table: one line per timed size, or per candidate not timed."""
    from ..tables import markdown_table

    def cells(r: dict) -> tuple:
        numbers = (("m", "d"), ("time_us", ".1f"), ("tflops", ".3g"), ("vs_bf16", ".2f"))
        shown = (format(r[k], f) if isinstance(r.get(k), (int, float)) else "-" for k, f in numbers)
        return (r["family"], r["config"], r["backend"], r["verdict"], *shown, r.get("timing", "-"))

    header = ("kernel", "layer configuration", "backend", "verdict", "M", "time (us)", "TFLOP/s", "x bf16", "timing")
    return markdown_table(header, [cells(r) for r in result["rows"]])


def plot(result: dict, path: str, pyplot) -> None:
    """Plot TFLOP/s against M per backend, one panel per layer configuration, into `path` (PNG)."""
    panels = list(dict.fromkeys((r["family"], r["config"]) for r in result["rows"]))
    fig, axes = pyplot.subplots(len(panels), 1, figsize=(8, 3.5 * len(panels)), squeeze=False)
    for ax, (family, config) in zip(axes[:, 0], panels):
        mine = [r for r in result["rows"] if (r["family"], r["config"]) == (family, config) and r.get("tflops")]
        for name in dict.fromkeys(r["backend"] for r in mine):
            sizes, tflops = zip(*sorted((r["m"], r["tflops"]) for r in mine if r["backend"] == name))
            ax.plot(sizes, tflops, marker="o", linestyle="--" if name == BF16 else "-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{family}: {config} on {result['device']['name']}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot.close(fig)


EXIT_OK, EXIT_USAGE = 0, 2
SIMULATE_ON_CPU = "SM120_FP4_SIMULATE=12.0 sm120-fp4 bench --backend emulated"


def _sizes(given: list[int] | None) -> list[int] | str:
    if not given:
        return [*DECODE_SIZES, *PREFILL_SIZES]
    if bad := [m for m in given if m <= 0]:
        return f"--sizes {bad[0]} is not a batch size; accepted: positive token counts, e.g. --sizes 1 8 512"
    return sorted(set(given))


def _backends(given: list[str] | None) -> list[str] | None | str:
    """Return the names asked for with --backend (entry points looked up), or why one is not a backend."""
    if not given:
        return None
    for family in ("dense", "moe"):
        backends.load_entry_points([n for n in given if n not in backends.names() + backends.moe_names()], family)
    known = dict.fromkeys(backends.names() + backends.moe_names())
    if unknown := [n for n in given if n not in known]:
        return f"--backend {unknown[0]!r} is not a known backend; accepted: {', '.join(known)}"
    return list(dict.fromkeys(given))


def _device(settings, index: int | None, any_gpu: bool) -> Device | int:
    """Return the device to measure, or the exit code after saying why there is none."""
    from .. import devices
    from ..config import check_flashinfer_env

    found = devices.list_devices(settings.simulated_capability, init_cuda=True)
    usable = [d for d in found if devices.is_sm12x(d.capability) or (any_gpu and d.is_cuda)]
    chosen = [d for d in found if d.index == index] if index is not None else usable[:1]
    if index is not None and not chosen:
        eprint(f"sm120-fp4 bench: --device {index} is not visible; visible: {[d.index for d in found]}")
        return EXIT_USAGE
    if not chosen:
        eprint(
            "sm120-fp4 bench: no compute-capability 12.x GPU visible; nothing to measure (--allow-any-gpu "
            f"measures another GPU; to try it on this CPU, in simulation: {SIMULATE_ON_CPU})"
        )
        return EXIT_OK
    device = chosen[0]
    if not (devices.is_sm12x(device.capability) or any_gpu):
        eprint(
            f"sm120-fp4 bench: --device {index} is {device.label()}, not a compute-capability 12.x GPU; "
            "accepted: a 12.x GPU, or any GPU with --allow-any-gpu"
        )
        return EXIT_USAGE
    if devices.is_sm12x(device.capability) and device.is_cuda:
        check_flashinfer_env()  # FlashInfer's own FP4 knobs would make every candidate fail its self-test
    return device


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot

        return pyplot
    except ImportError:
        return None


def _usage_problem(args, sizes, wanted, pyplot) -> str | None:
    """Return what is wrong with the command's options, or None."""
    for problem in (sizes, wanted):
        if isinstance(problem, str):
            return problem
    if args.plot and pyplot is None:
        return "--plot needs matplotlib, which is not installed (pip install matplotlib)"
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            return f"{option} {path!r}: the folder {folder!r} does not exist"
    if args.model is not None and not os.path.isdir(args.model):
        return f"--model {args.model!r} is not a directory"
    return None


def main(args) -> int:
    """Run ``sm120-fp4 bench``: verify, then time, each candidate at the served configurations and sizes."""
    from ..config import load_settings
    from ..errors import CheckpointError, ConfigError, DeviceMappingError

    sizes, wanted = _sizes(args.sizes), _backends(args.backend)
    pyplot = _pyplot() if args.plot else None
    problem = _usage_problem(args, sizes, wanted, pyplot)
    if problem is not None:
        eprint(f"sm120-fp4 bench: {problem}")
        return EXIT_USAGE
    try:
        settings = load_settings()
        device = _device(settings, args.device, args.allow_any_gpu)
        if isinstance(device, int):
            return device
        dense, moe = configurations(args.model, on_cpu=not device.is_cuda)
    except (ConfigError, CheckpointError, DeviceMappingError) as exc:
        eprint(f"sm120-fp4 bench: {exc}")
        return EXIT_USAGE
    result = run(device, settings, dense, moe, sizes, wanted)
    print("\n".join(table(result)))
    try:
        if args.json:
            with open(args.json, "w") as f:
                f.write(json.dumps(result, indent=2) + "\n")
        if pyplot is not None:
            plot(result, args.plot, pyplot)
    except OSError as exc:
        eprint(f"sm120-fp4 bench: cannot write {exc.filename!r}: {exc.strerror or exc}")
        return EXIT_USAGE
    return EXIT_OK
