"""``sm120-fp4 bench``: the speed of each candidate backend on this GPU, beside its verdict.

Each candidate is first verified at each served layer configuration (a checkpoint's, or defaults); each
verified one, and a bf16 yardstick of the same shape, is then timed at the batch sizes a server runs (a
CUDA-graph replay per sample where it can be captured, L2 flushed before each, after FlashInfer's autotune).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import backends, deciding, nvfp4, verify
from .backends import flashinfer
from .devices import Device
from .verify.moe import _moe_weights as moe_weights

__all__ = ["DECODE_SIZES", "PREFILL_SIZES", "DenseShape", "MoeShape", "configurations", "run", "table", "plot", "main"]

DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_SIZES = (512, 1024, 2048, 4096, 8192)
BF16 = "bf16"  # the yardstick's row name

# Without a checkpoint: one dense and one MoE layer of a common NVFP4 MoE model (a fused qkv_proj of
# 40 heads of 128 on a 2048 hidden size; 128 experts, top-8, hidden 2048, intermediate 768). On a
# simulated CPU device: small layers, since every kernel there is the pure-PyTorch emulation.
DEFAULT_DENSE, DEFAULT_MOE = ((5120, 2048),), ((128, 8, 2048, 768, True),)
CPU_DENSE, CPU_MOE = ((256, 512),), ((8, 2, 128, 64, True),)
REPEATS = {"cuda": 20, "cpu": 3}
_FLUSH_MIN_BYTES = 256 << 20  # the L2 flush buffer: at least twice the largest L2 of these GPUs (128 MiB)


@dataclass(frozen=True)
class DenseShape:
    """One served dense layer configuration: out = x (M, K) @ W (N, K).T."""

    n: int
    k: int

    def label(self) -> str:
        return f"N={self.n} K={self.k}"

    def flops(self, m: int) -> float:
        return 2.0 * m * self.n * self.k


@dataclass(frozen=True)
class MoeShape:
    """One served MoE layer configuration: E experts, top-k routing, hidden H, intermediate I."""

    experts: int
    top_k: int
    hidden: int
    inter: int
    gated: bool = True  # gate and up projections (SwiGLU); False: one projection (ReLU^2)

    @property
    def activation(self) -> str:
        return "swiglu" if self.gated else "relu2"

    def label(self) -> str:
        return f"E={self.experts} top_k={self.top_k} H={self.hidden} I={self.inter} {self.activation}"

    def flops(self, m: int) -> float:
        fc1 = (2 if self.gated else 1) * self.inter * self.hidden
        return 2.0 * m * self.top_k * (fc1 + self.inter * self.hidden)


def configurations(model: str | None, on_cpu: bool) -> tuple[list[DenseShape], list[MoeShape]]:
    """Return the distinct layer configurations to time: `model`'s (q/k/v and gate/up fused as servers do), else defaults."""
    if model is None:
        dense, moe = (CPU_DENSE, CPU_MOE) if on_cpu else (DEFAULT_DENSE, DEFAULT_MOE)
        return [DenseShape(*c) for c in dense], [MoeShape(*c) for c in moe]
    from . import checkpoints

    checkpoint = checkpoints.inspect(model, values=False)
    linear = checkpoint.linear()
    dense: dict[DenseShape, None] = {}
    done: set[str] = set()
    for module in sorted(linear):
        if module in done:
            continue
        parent, _, leaf = module.rpartition(".")
        for parts in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            names = [f"{parent}.{p}" for p in parts]
            if leaf in parts and all(n in linear for n in names) and len({linear[n][1] for n in names}) == 1:
                dense[DenseShape(sum(linear[n][0] for n in names), linear[module][1])] = None
                done.update(names)
                break
        else:
            dense[DenseShape(*linear[module])] = None
    text = checkpoints.text_config(checkpoint.config)
    top_k = text.get("num_experts_per_tok") or text.get("moe_topk") or 2
    moe: dict[MoeShape, None] = {}
    for roles in checkpoint.experts.values():
        down = roles["down_proj"]
        hidden, inter = checkpoint.modules[down[min(down)]]
        moe[MoeShape(len(down), int(top_k), hidden, inter, "gate_proj" in roles)] = None
    return list(dense), list(moe)


def _dense_call(fn: Callable, config: DenseShape, m: int, device: torch.device) -> Callable[[], object]:
    _, _, args = verify.quantized_inputs((m, config.n, config.k), device, seed=m)
    out = torch.empty((m, config.n), dtype=torch.bfloat16, device=device)
    return lambda: fn(*args, torch.bfloat16, out)


def _dense_bf16(config: DenseShape, m: int, device: torch.device) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, config.k, generator=gen).to(torch.bfloat16).to(device)
    w = torch.randn(config.n, config.k, generator=gen).to(torch.bfloat16).to(device)
    out = torch.empty((m, config.n), dtype=torch.bfloat16, device=device)
    return lambda: torch.matmul(x, w.T, out=out)


def _moe_call(
    fn: Callable, weights: nvfp4.MoeWeights, config: MoeShape, m: int, device: torch.device
) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(m)
    ids, topk_weights = verify.moe_routing(m, config.top_k, config.experts, "balanced", gen)
    x = verify.structured_activations(m, config.hidden, 4.0, gen).to(torch.bfloat16).to(device)
    ids, topk_weights, out = ids.to(device), topk_weights.to(device), torch.empty_like(x)
    return lambda: fn(x, ids, topk_weights, *weights, config.activation, x.dtype, out)


def _moe_bf16(config: MoeShape, m: int, device: torch.device) -> Callable[[], object]:
    """Return the MoE yardstick: bf16 bmm FC1, activation, FC2 over the experts a balanced routing touches."""
    active = min(config.experts, m * config.top_k)
    rows = math.ceil(m * config.top_k / active)
    gen = torch.Generator().manual_seed(m)
    rows13 = (2 if config.gated else 1) * config.inter
    x = torch.randn(active, rows, config.hidden, generator=gen).to(torch.bfloat16).to(device)
    w13 = (torch.randn(active, config.hidden, rows13, generator=gen) * 0.05).to(torch.bfloat16).to(device)
    w2 = (torch.randn(active, config.inter, config.hidden, generator=gen) * 0.05).to(torch.bfloat16).to(device)
    h = torch.empty(active, rows, rows13, dtype=torch.bfloat16, device=device)
    out = torch.empty(active, rows, config.hidden, dtype=torch.bfloat16, device=device)

    def call():
        torch.bmm(x, w13, out=h)
        if config.gated:
            gate, up = h.chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
        else:
            act = torch.relu(h).square()
        return torch.bmm(act, w2, out=out)

    return call


class _Timer:
    """Median time of one call: a CUDA-graph replay per sample (else eager), L2 flushed; perf_counter on a CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats, self._flush = device, repeats, None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
            self._flush = torch.empty(max(_FLUSH_MIN_BYTES, 2 * l2), dtype=torch.uint8, device=device)

    def time(self, call: Callable[[], object], tune: bool) -> tuple[float, str]:
        """Return (median seconds, how: "graph", "eager: <why>" or "cpu")."""
        if self.device.type != "cuda":
            call()
            return statistics.median(_elapsed(call) for _ in range(self.repeats)), "cpu"
        with torch.cuda.device(self.device):
            if tune:
                with flashinfer.autotuning():
                    call()  # FlashInfer profiles its tactics for this shape, as a server's warm-up does
            call()
            torch.cuda.synchronize(self.device)
            step, how = self._captured(call)
            step()
            return statistics.median(self._sample(step) for _ in range(self.repeats)), how

    def _captured(self, call: Callable[[], object]) -> tuple[Callable[[], object], str]:
        """Return (a CUDA-graph replay of `call`, "graph"), or (`call`, "eager: <why>") where it cannot be captured."""
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                call()  # warm on the side stream, as torch's capture recipe asks
            torch.cuda.current_stream(self.device).wait_stream(stream)
            with torch.cuda.graph(graph):
                call()
            return graph.replay, "graph"
        except Exception as exc:
            torch.cuda.synchronize(self.device)
            return call, f"eager: {_first_line(exc)}"[:120]

    def _sample(self, step: Callable[[], object]) -> float:
        self._flush.zero_()  # cold L2: the weights come from memory, as in a server's many layers
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def _elapsed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _verify_sizes(sizes: list[int]) -> list[int]:
    """Return the sizes the self-test checks: the smallest, the largest decode size, the smallest prefill size."""
    decode = [m for m in sizes if m <= DECODE_SIZES[-1]]
    prefill = [m for m in sizes if m > DECODE_SIZES[-1]]
    return sorted({min(sizes), *(decode[-1:]), *(prefill[:1])})


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _verify(family: str, name: str, config, sizes: list[int], device: Device, settings) -> str:
    """Return this backend's verdict on `device` at `config`: "verified", else why not."""
    timeout = settings.selftest_timeout
    try:
        if family == "dense":
            shapes = [(m, config.n, config.k) for m in _verify_sizes(sizes)]
            quantizer = backends.quantizer_for(name, device)
            report = verify.run(name, device, shapes, bounds=verify.Bounds(timeout_s=timeout), quantizer=quantizer)
        else:
            layer = dict(experts=config.experts, hidden=config.hidden, intermediate=config.inter, top_k=config.top_k)
            cases = tuple(
                verify.MoeCase(**layer, activation=config.activation, tokens=m, dtype="bfloat16", routing=routing)
                for m in _verify_sizes(sizes)
                for routing in ("balanced", "random")
            )
            bounds = verify.MOE_BOUNDS.model_copy(update={"timeout_s": timeout})
            report = verify.run_moe(name, device, verify.MoeConfig(cases=cases), bounds=bounds)
    except Exception as exc:
        return f"failed: {_first_line(exc)}"
    return "verified" if report.passed else f"failed: {(report.reason or 'did not pass').splitlines()[0]}"


def _candidates(family: deciding.Family, settings, device: Device, wanted: list[str] | None) -> list[str]:
    if wanted is None:
        return deciding.candidate_names(settings, family=family, device=device)
    return [n for n in wanted if n in family.names()]


def _verified(family: deciding.Family, names: list[str], config, sizes: list[int], device: Device, settings, log):
    """Return the rows of candidates not timed (unsupported, failed) and (name, make call, tune) for the rest."""
    tdev, base = device.torch_device, {"family": family.name, "config": config.label()}
    if family is deciding.MOE:
        weights = moe_weights(config.experts, config.hidden, config.inter, config.activation, tdev, 0)
    rows, timed = [], []
    for name in names:
        ok, why = family.is_supported(name, device)
        if not ok:
            rows.append({**base, "backend": name, "verdict": f"unsupported: {why}", "m": None})
            continue
        log(f"[{device.label()}] verifying {family.name} backend {name!r} at {config.label()} ...")
        verdict = _verify(family.name, name, config, sizes, device, settings)
        if verdict != "verified":
            rows.append({**base, "backend": name, "verdict": verdict, "m": None})
            continue
        fn = family.resolve(name)
        tune = backends.backend_of(family.name, name).kind == "flashinfer"
        if family is deciding.DENSE:
            timed.append((name, lambda m, fn=fn: _dense_call(fn, config, m, tdev), tune))
        else:
            timed.append((name, lambda m, fn=fn: _moe_call(fn, weights, config, m, tdev), tune))
    yardstick = _dense_bf16 if family is deciding.DENSE else _moe_bf16
    return rows, [*timed, (BF16, lambda m: yardstick(config, m, tdev), False)]


def _timed(timer: _Timer, base: dict, config, name: str, make: Callable, tune: bool, m: int) -> dict:
    """Return the row of one timed call of backend `name` at batch size `m`."""
    row = {**base, "backend": name}
    try:
        seconds, how = timer.time(make(m), tune)
    except Exception as exc:
        return {**row, "verdict": f"failed while timed: {type(exc).__name__}: {exc}"[:200], "m": m}
    verdict = "yardstick" if name == BF16 else "verified"
    tflops = config.flops(m) / seconds / 1e12
    return {**row, "verdict": verdict, "m": m, "time_us": seconds * 1e6, "tflops": tflops, "timing": how}


def run(
    device: Device,
    settings,
    dense: list[DenseShape],
    moe: list[MoeShape],
    sizes: list[int],
    wanted: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Verify, then time, each candidate of each family on `device`; return JSON-ready rows."""
    log = log or _eprint
    tdev = device.torch_device
    timer = _Timer(tdev, REPEATS["cuda" if tdev.type == "cuda" else "cpu"])
    rows: list[dict] = []
    for family, configs in ((deciding.DENSE, dense), (deciding.MOE, moe)):
        names = _candidates(family, settings, device, wanted)
        for config in configs:
            untimed, timed = _verified(family, names, config, sizes, device, settings, log)
            rows += untimed
            base = {"family": family.name, "config": config.label()}
            for name, make, tune in timed:
                log(f"[{device.label()}] timing {family.name} {name} at {config.label()} ...")
                rows += [_timed(timer, base, config, name, make, tune, m) for m in sizes]
    # each time beside the yardstick's at the same configuration and size
    yardstick = {
        (r["family"], r["config"], r["m"]): r["time_us"] for r in rows if r["backend"] == BF16 and r.get("time_us")
    }
    for row in rows:
        if row.get("time_us") and row["backend"] != BF16:
            ref = yardstick.get((row["family"], row["config"], row["m"]))
            row["vs_bf16"] = ref / row["time_us"] if ref else None
    return {
        "device": {
            "index": device.index,
            "name": device.name,
            "capability": f"{device.capability[0]}.{device.capability[1]}",
            "simulated": device.simulated,
        },
        "versions": {"torch": torch.__version__, "flashinfer": backends.flashinfer_version()},
        "sizes": sizes,
        "dense": [c.label() for c in dense],
        "moe": [c.label() for c in moe],
        "rows": rows,
    }


def table(result: dict) -> list[str]:
    """Return the result as a Markdown table: one line per timed size, or per candidate not timed."""
    from .tables import markdown_table

    def num(value, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    numbers = (("time_us", ".1f"), ("tflops", ".3g"), ("vs_bf16", ".2f"))
    rows = [
        (r["family"], r["config"], r["backend"], r["verdict"], num(r["m"], "d"))
        + tuple(num(r.get(key), fmt) for key, fmt in numbers)
        + (r.get("timing", "-"),)
        for r in result["rows"]
    ]
    return markdown_table(
        ("kernel", "layer configuration", "backend", "verdict", "M", "time (us)", "TFLOP/s", "x bf16", "timing"), rows
    )


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


def _eprint(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _sizes(given: list[int] | None) -> list[int] | str:
    if not given:
        return [*DECODE_SIZES, *PREFILL_SIZES]
    bad = [m for m in given if m <= 0]
    if bad:
        return f"--sizes {bad[0]} is not a batch size; accepted: positive token counts, e.g. --sizes 1 8 512"
    return sorted(set(given))


def _backends(given: list[str] | None) -> list[str] | None | str:
    """Return the names asked for with --backend (entry points looked up), or why one is not a backend."""
    if not given:
        return None
    for family in ("dense", "moe"):
        backends.load_entry_points([n for n in given if n not in backends.names() + backends.moe_names()], family)
    known = dict.fromkeys(backends.names() + backends.moe_names())
    unknown = [n for n in given if n not in known]
    if unknown:
        return f"--backend {unknown[0]!r} is not a known backend; accepted: {', '.join(known)}"
    return list(dict.fromkeys(given))


def _device(settings, index: int | None, any_gpu: bool) -> Device | int:
    """Return the device to measure, or the exit code after saying why there is none."""
    from . import devices
    from .config import check_flashinfer_env

    found = devices.list_devices(settings.simulated_capability, init_cuda=True)
    if index is not None:
        chosen = [d for d in found if d.index == index]
        if not chosen:
            _eprint(f"sm120-fp4 bench: --device {index} is not visible; visible: {[d.index for d in found]}")
            return EXIT_USAGE
        if not (devices.is_sm12x(chosen[0].capability) or any_gpu):
            _eprint(
                f"sm120-fp4 bench: --device {index} is {chosen[0].label()}, not a compute-capability 12.x GPU; "
                "accepted: a 12.x GPU, or any GPU with --allow-any-gpu"
            )
            return EXIT_USAGE
        device = chosen[0]
    else:
        usable = [d for d in found if devices.is_sm12x(d.capability) or (any_gpu and d.is_cuda)]
        if not usable:
            _eprint(
                "sm120-fp4 bench: no compute-capability 12.x GPU visible; nothing to measure (--allow-any-gpu "
                f"measures another GPU; to try it on this CPU, in simulation: {SIMULATE_ON_CPU})"
            )
            return EXIT_OK
        device = usable[0]
    if devices.is_sm12x(device.capability) and device.is_cuda:
        check_flashinfer_env()  # FlashInfer's own FP4 knobs would make every candidate fail its self-test
    return device


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return None
    return pyplot


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
    from .config import load_settings
    from .errors import CheckpointError, ConfigError, DeviceMappingError

    sizes, wanted = _sizes(args.sizes), _backends(args.backend)
    pyplot = _pyplot() if args.plot else None
    problem = _usage_problem(args, sizes, wanted, pyplot)
    if problem is not None:
        _eprint(f"sm120-fp4 bench: {problem}")
        return EXIT_USAGE
    try:
        settings = load_settings()
        device = _device(settings, args.device, args.allow_any_gpu)
        if isinstance(device, int):
            return device
        dense, moe = configurations(args.model, on_cpu=not device.is_cuda)
    except (ConfigError, CheckpointError, DeviceMappingError) as exc:
        _eprint(f"sm120-fp4 bench: {exc}")
        return EXIT_USAGE
    result = run(device, settings, dense, moe, sizes, wanted)
    print("\n".join(table(result)))
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
        if pyplot is not None:
            plot(result, args.plot, pyplot)
    except OSError as exc:
        _eprint(f"sm120-fp4 bench: cannot write {exc.filename!r}: {exc.strerror or exc}")
        return EXIT_USAGE
    return EXIT_OK
