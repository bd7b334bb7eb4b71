"""What verification costs at start-up, per GPU: the generic self-tests and every layer check.

    .venv/bin/python benchmarks/selftest_cost.py [--quick]   # CPU: simulated sm_120, emulated backend
    python3 benchmarks/selftest_cost.py                       # on a GPU: emulated on CUDA

Measured, each on its own, with the `emulated` backend (the only one that runs off SM120):
* decide(): the generic dense self-test (DEFAULT_SHAPES) and the generic MoE self-test
  (DEFAULT_MOE_CONFIG);
* the served-layer checks of a 70B-class model (Llama-3-70B: hidden 8192, intermediate 28672, 64
  heads, 8 KV heads, 80 layers) at TP1 and TP8: per configuration (qkv, o_proj, gate_up, down) the
  first layer's full sweep -- every batch-size bucket up to 512, M=2049 and the prefill sizes up to
  SGLang's chunk (8192 where its settings are not visible), two passes -- and every other layer's
  light check (its own weights, one decode batch, its fingerprint);
* the MoE layer check of a DeepSeek-V3 / GLM-class layer (E=256, H=7168, top-8, I=2048 at TP1, 256
  at TP8): the layer's own top-k, every batch routed among 8 of its experts, one batch to all 256,
  one with SGLang's -1 slots, T up to the chunk; plus a few more layers' light checks. The kernel
  for these is the oracle-backed stand-in `oracle_moe` (what `emulated` was before it became
  capture-safe); the capture-safe `emulated` MoE is timed per call on its own;
* the re-check after warm-up and CUDA-graph capture (serving.recheck) of the same layers: every
  layer's fingerprint, then every configuration at every graph size SGLang 0.5.23 captures by
  default (decode batch sizes up to 512 and prefill token counts up to 2048: CAPTURED, from
  SGLang's cuda_graph_hook.py) and its re-check sizes.
Targets on the GPU: dense layer checks <= 1.5 s per GPU in total (all layers), each MoE layer
configuration <= 2 s (at load); the re-check is reported, not targeted.
The layer's call is the routed backend after SGLang's quantizer (nvfp4.quantize stands in for it,
replayed from a CUDA graph per batch size: StandInQuantizer; --eager-quantizer calls it eagerly).
--quick uses small layers and few of them (CPU smoke run of the same code). --kernel humming serves
through Humming (a real NVFP4-weight kernel that runs on SM90) instead of `emulated`, its kernels
compiled first on throwaway layers, so the kernel column is a real kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _common import table, write

from sm120_fp4 import backends, devices, graphs, nvfp4, serving, verify
from sm120_fp4.config import Settings
from sm120_fp4.serving import policy
from sm120_fp4.sglang import hooks, moe

DENSE_TARGET_S = 1.5
MOE_TARGET_S = 2.0
# SGLang 0.5.23's default CUDA-graph sizes (arg_groups/cuda_graph_hook.py): decode without
# speculative decoding, max_bs 512; prefill (piecewise) token counts, the documented max 2048.
DECODE_CAPTURED = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), 512]
PREFILL_CAPTURED = [
    *range(4, 33, 4),
    *range(48, 257, 16),
    *range(288, 513, 32),
    *range(576, 1025, 64),
    *range(1280, 2049, 256),
]
CAPTURED = sorted(set(DECODE_CAPTURED) | set(PREFILL_CAPTURED))
LLAMA70B = {"qkv": (10240, 8192), "o_proj": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}


def tp_configs(tp: int, scale: int = 1) -> dict[str, tuple[int, int]]:
    """The 70B-class (N, K) of each dense configuration on one of `tp` ranks, divided by `scale`
    (kept multiples of the FP4 GEMM's alignment)."""
    n_split = {"qkv": True, "o_proj": False, "gate_up": True, "down": False}  # column- or row-parallel
    shapes = {name: ((n // tp, k) if n_split[name] else (n, k // tp)) for name, (n, k) in LLAMA70B.items()}
    return {name: (max(32, n // scale // 32 * 32), max(64, k // scale // 64 * 64)) for name, (n, k) in shapes.items()}


def synced(device: torch.device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def random_e4m3(shape, device, lo=0x20, hi=0x48) -> torch.Tensor:
    """Valid, finite E4M3 scale bytes in a moderate range (never NaN), as float8_e4m3fn."""
    return torch.randint(lo, hi, shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


class StandInQuantizer:
    """SGLang's activation quantizer, stood in for by nvfp4.quantize (FlashInfer's, one kernel on
    SM120, is not on the H200). Eagerly that is ~35 launches and ~0.5-0.8 ms of host time per call,
    which the real quantizer does not cost; so where an input shape was prepared (prepare(), outside
    every timed region; on CUDA, inputs up to graphs.MAX_INPUT_BYTES, the bound the checks' own
    graphs have) it is replayed from a CUDA graph: two input copies, one replay, two output copies.
    `eager` (--eager-quantizer) keeps the eager calls, the method before 2026-12-02."""

    def __init__(self) -> None:
        self.eager = False
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None

    def prepare(self, device: torch.device, ks, ms, dtype: torch.dtype = torch.bfloat16) -> int:
        """Capture a graph for every (M, K) of `ms` x `ks` whose input fits; the number captured."""
        if self.eager or device.type != "cuda":
            return 0
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        made = 0
        for k in sorted(set(ks)):
            for m in sorted(set(ms)):
                key = (m, k, dtype, device)
                if key in self._graphs or m * k * torch.finfo(dtype).bits // 8 > graphs.MAX_INPUT_BYTES:
                    continue
                x = torch.zeros((m, k), dtype=dtype, device=device)
                gsf = torch.ones((), dtype=torch.float32, device=device)
                nvfp4.quantize(x, gsf, check_finite=False)  # its device constants exist before capture
                graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(
                    side
                ):  # torch.cuda.graph() would also gc.collect() and empty the cache, per shape
                    graph.capture_begin(pool=self._pool)
                    try:
                        out = nvfp4.quantize(x, gsf, check_finite=False)
                    finally:
                        graph.capture_end()
                torch.cuda.current_stream(device).wait_stream(side)
                self._graphs[key] = (graph, x, gsf, out)
                made += 1
                if made == 1:  # the replay computes what the eager call does, with each call's own inputs
                    probe, scale = (
                        torch.randn((m, k), device=device).to(dtype),
                        torch.tensor(448.0 * 6 / 3.0, device=device),
                    )
                    got, want = self(probe, scale), nvfp4.quantize(probe, scale, check_finite=False)
                    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want)), (
                        "stand-in graph differs"
                    )
        return made

    def __call__(self, x: torch.Tensor, gsf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entry = None if self.eager else self._graphs.get((x.shape[0], x.shape[1], x.dtype, x.device))
        if entry is None:
            return nvfp4.quantize(x, gsf, check_finite=False)
        graph, static_x, static_gsf, (qx, sx) = entry
        static_x.copy_(x)
        static_gsf.copy_(gsf.reshape(()))
        graph.replay()
        return qx.clone(), sx.clone()


QUANTIZER = StandInQuantizer()


class Peaks:
    """The GPU memory one check (or canary drive) takes beyond what was allocated when it began, split at the
    served calls (torch's allocator counters, host-side: no synchronisation, nothing timed changes):
    * `served`: the most one served call took above what was allocated just before it -- its output and working
      memory, what serving that M costs the engine anyway (not the check's);
    * `own`: the check's own -- the most allocated outside the calls, less the last call's output (held here until
      the next call, so that it is subtracted exactly): check data, the oracle's reference and dequantization, the
      comparisons, original bytes copied to the GPU for the oracle. The bound (devices.CHECK_MEMORY_BYTES) is on it;
    * `total`: the most allocated at any time (what the earlier runs reported)."""

    def __init__(self) -> None:
        self.device = None
        self.base = self.own = self.served = self.total = self.held_bytes = 0
        self.held = None

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.device, self.base = device, torch.cuda.memory_allocated(device)
            self.own = self.served = self.total = self.held_bytes = 0

    def _segment(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.device) - self.base
        self.own, self.total = max(self.own, peak - self.held_bytes), max(self.total, peak)

    def wrap(self, serve):
        """`serve`, measured while started."""

        def measured(*args):
            if self.device is None:
                return serve(*args)
            self._segment()
            self.held, self.held_bytes = None, 0
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            out = serve(*args)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.served, self.total = max(self.served, peak - before), max(self.total, peak - self.base)
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:  # made by the call
                self.held, self.held_bytes = out, out.untyped_storage().nbytes()
            torch.cuda.reset_peak_memory_stats(self.device)
            return out

        return measured

    def stop(self) -> dict[str, float]:
        """The peaks in MiB since start() (empty off CUDA)."""
        if self.device is None:
            return {}
        self._segment()
        self.device, self.held = None, None
        return {"total": self.total / 2**20, "own": self.own / 2**20, "served": self.served / 2**20}


PEAKS = Peaks()


def prepare_quantizer(device: torch.device, tps, scale: int) -> int:
    """The stand-in quantizer's graphs for every configuration's K at every batch size the checks
    use: the light check's, the full sweep's, the re-check's and the captured graph sizes (which
    the canary rotates through too)."""
    sizes = hooks.sizes()  # the verification policy's batch sizes for SGLang's settings here
    ms = {policy.LIGHT_BATCH, *CAPTURED, *policy.load_ms(sizes), *policy.recheck_ms(sizes)}
    return QUANTIZER.prepare(device, [k for tp in tps for _, k in tp_configs(tp, scale).values()], ms)


def dense_layer(n: int, k: int, device: torch.device, kernel: str = "emulated"):
    """A layer's processed NVFP4 weights (random codes, valid scales) and its served call through
    backend `kernel` (humming converts the weights in place when the layer is verified)."""
    weight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    weight_sf = random_e4m3(nvfp4.swizzled_scale_shape(n, k), device)
    input_gsf = torch.tensor(448.0 * 6 / 8.0, device=device)
    alpha = (1.0 / (input_gsf * 448.0 * 6 / 0.05)).reshape(1).float()
    fn = backends.resolve(kernel)

    def serve(x):  # what SGLang's apply does: quantize (StandInQuantizer), then the routed GEMM
        qx, sx = QUANTIZER(x, input_gsf)
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=device)
        return fn(qx, weight.T, sx.view(torch.uint8), weight_sf.T, alpha, x.dtype, out)

    layer = types.SimpleNamespace(params_dtype=torch.bfloat16)
    watched = (weight, weight_sf, alpha, input_gsf)
    return policy.dense_check(hooks.sizes(), "bench", PEAKS.wrap(serve), layer, watched, n, k)


class MoeLayer(torch.nn.Module):
    """The processed state of one NVFP4 MoE layer as SGLang's ModelOpt method leaves it (random codes)."""

    def __init__(self, experts: int, hidden: int, inter: int, top_k: int, device: torch.device) -> None:
        super().__init__()
        p = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.w13_weight = p(torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8, device=device))
        self.w2_weight = p(torch.randint(0, 256, (experts, hidden, inter // 2), dtype=torch.uint8, device=device))
        self.w13_blockscale_swizzled = p(random_e4m3((experts, *nvfp4.swizzled_scale_shape(2 * inter, hidden)), device))
        self.w2_blockscale_swizzled = p(random_e4m3((experts, *nvfp4.swizzled_scale_shape(hidden, inter)), device))
        self.w13_input_scale_quant = p(torch.tensor(448.0 * 6 / 8.0, device=device))
        self.w2_input_scale_quant = p(torch.tensor(448.0 * 6 / 2.0, device=device))
        self.g1_alphas = p(torch.full((experts,), 1.0 / (448.0 * 6 / 8.0) / (448 * 6 / 0.05), device=device))
        self.g2_alphas = p(torch.full((experts,), 1.0 / (448.0 * 6 / 2.0) / (448 * 6 / 0.05), device=device))
        self.top_k, self.params_dtype = top_k, torch.bfloat16


def moe_serve(kernel: str):
    """Return the MoE layer's served call: the backend (`emulated`: the oracle's arithmetic, capture-safe)."""
    return PEAKS.wrap(backends.resolve_moe(kernel))


def warm_up(kernel: str, scale: int, device, settings, tps: tuple[int, ...]) -> float:
    """A backend that compiles its kernels on first use (humming's JIT: 10-20 s per layer shape)
    compiles them here, on throwaway layers of every configuration timed, so that the times below
    are a server's second start (kernels from the cache). Returns the seconds it took."""
    if kernel == "emulated":
        return 0.0
    start = time.perf_counter()
    for tp in tps:
        for n, k in tp_configs(tp, scale).values():
            report = serving.verify_layer(device.index, dense_layer(n, k, device.torch_device, kernel), settings)
            assert report is not None and report.passed, report and report.reason
        experts, hidden, inter = moe_shape(tp, scale)
        layer = MoeLayer(experts, hidden, inter, 8, device.torch_device)
        report = serving.verify_layer(
            device.index, moe.moe_check("bench-moe", layer, serve=moe_serve(kernel)), settings
        )
        assert report is not None and report.passed, report and report.reason
        del layer
        serving.STATE.reset()
    return time.perf_counter() - start


def moe_shape(tp: int, scale: int) -> tuple[int, int, int]:
    return (
        (256, 7168, 2048 // tp) if scale == 1 else (max(8, 512 // scale), 512, max(32, 4096 // scale // tp // 32 * 32))
    )


PEAK_MIB: dict[str, float] = {}  # per family: the most extra GPU memory one layer check took (its peak)
# per family: the most of each Peaks part one layer check took, and the kept originals on the GPU during it
PEAK_PARTS_MIB: dict[str, dict[str, float]] = {}
CONVERSION_S = [0.0]  # a backend's conversion of the layers' weights at load (humming), timed apart


def time_check(check, device, settings) -> tuple[float, verify.SelfTestReport]:
    """serving.verify_layer of one layer: (seconds, report). A backend that converts each layer's
    weights at load (humming) converts it first, timed apart (CONVERSION_S): serving it costs that
    with or without verification."""
    backend = backends.backend_of(
        check.family, (settings.backends if check.family == "dense" else settings.moe_backends)[0]
    )
    if backend.converter is not None and check.tensors is not None:
        _, seconds = synced(device.torch_device, lambda: backend.converter.convert(check.tensors, True))
        CONVERSION_S[0] += seconds
    tdev = device.torch_device
    if tdev.type == "cuda":
        torch.cuda.synchronize(tdev)
    kept = _kept_gpu_bytes(check.family)  # what a converting backend kept on the GPU for the oracle, before
    PEAKS.start(tdev)
    report, seconds = synced(tdev, lambda: serving.verify_layer(device.index, check, settings))
    peaks = PEAKS.stop()
    if peaks:
        peaks["kept_originals"] = kept / 2**20
        PEAK_MIB[check.family] = max(PEAK_MIB.get(check.family, 0.0), peaks["total"])
        parts = PEAK_PARTS_MIB.setdefault(check.family, {})
        parts.update({k: max(v, parts.get(k, 0.0)) for k, v in peaks.items()})
    return seconds, report


def _kept_gpu_bytes(family: str) -> int:
    """The original bytes Humming keeps on the GPU for `family`'s converted layers now (0 without Humming)."""
    try:
        from sm120_fp4.backends.humming import convert
    except ImportError:
        return 0
    return convert.kept_bytes(family)["gpu"]


def time_recheck(label: str, tdev: torch.device, settings) -> tuple[float, list]:
    """serving.recheck of every layer and configuration verified so far at CAPTURED: (seconds, table row)."""
    reports, seconds = synced(tdev, lambda: serving.recheck(settings, CAPTURED))
    assert all(r.passed for r in reports), [r.reason for r in reports]
    kernel = sum(r.duration_s for rep in reports for r in rep.shapes)
    return seconds, [
        f"{label} re-check after capture",
        "",
        len(reports[0].shapes),
        seconds * 1e3,
        kernel * 1e3,
        (seconds - kernel) * 1e3,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small layers (a CPU smoke run of the same code)")
    parser.add_argument(
        "--prefill", type=int, default=None, help="SGLang's chunked-prefill size to assume (default 8192, --quick 2048)"
    )
    parser.add_argument(
        "--scale", type=int, default=None, help="divide the layer shapes by this (default 1 on a GPU, 16 otherwise)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="layers per dense configuration (default 80, --quick 3)"
    )
    parser.add_argument(
        "--moe-layers", type=int, default=None, help="more MoE layers light-checked (default 4, --quick 1)"
    )
    parser.add_argument(
        "--kernel",
        choices=("emulated", "humming"),
        default="emulated",
        help="the served backend (humming: a real NVFP4-weight kernel on SM90; its kernels compiled first)",
    )
    parser.add_argument(
        "--tp", default="1,8", help="the tensor-parallel sizes whose layer shapes are timed (default 1,8)"
    )
    parser.add_argument(
        "--eager-quantizer",
        action="store_true",
        help=("call the stand-in for SGLang's activation quantizer eagerly (~35 launches per call), not from a graph"),
    )
    args = parser.parse_args()
    QUANTIZER.eager = args.eager_quantizer
    args.layers = args.layers or (3 if args.quick else 80)
    args.moe_layers = (1 if args.quick else 4) if args.moe_layers is None else args.moe_layers
    if args.prefill or args.quick:  # SGLang's chunk where its settings are not visible (a CPU smoke run: its smallest)
        hooks.DEFAULT_CHUNKED_PREFILL = args.prefill or 2048
    settings = Settings(simulate="12.0", backends=args.kernel, moe_backends=args.kernel)
    device = devices.list_devices(settings.simulated_capability)[0]
    tdev = device.torch_device
    scale = args.scale or (16 if args.quick or not device.is_cuda else 1)
    tps = tuple(int(t) for t in args.tp.split(","))
    warm_s = warm_up(args.kernel, scale, device, settings, tps)
    quantizer_graphs = prepare_quantizer(tdev, tps, scale)

    runs = []
    for _ in range(3):  # the first includes one-off costs (CUDA context, cuBLAS handles, caches)
        serving.STATE.reset()
        _, seconds = synced(tdev, lambda: serving.route(device.index, settings))
        runs.append(seconds)
    dense_generic = statistics.median(runs[1:])
    _, moe_generic = synced(tdev, lambda: serving.route(device.index, settings, "moe"))
    [moe_decision] = [d for d in serving.decisions() if d.family == "moe"]
    moe_generic_kernel = sum(s.duration_s for s in moe_decision.reports[0].shapes)

    rows, dense, rechecks = [], {}, {}
    layers = args.layers
    for tp in tps:
        total = 0.0
        for name, (n, k) in tp_configs(tp, scale).items():
            check = dense_layer(n, k, tdev, args.kernel)
            seconds, report = time_check(check, device, settings)
            assert report is not None and report.passed, report and report.reason
            kernel = sum(r.duration_s for r in report.shapes)
            light, light_kernel = 0.0, 0.0
            for _ in range(layers - 1):  # the configuration's other layers: each its own weights
                other = dense_layer(n, k, tdev, args.kernel)
                s, r = time_check(other, device, settings)
                assert r is not None and r.passed, r and r.reason
                light += s
                light_kernel += sum(x.duration_s for x in r.shapes)
            total += seconds + light
            rows.append(
                [f"TP{tp} {name}", f"N={n} K={k}", len(check.ms), seconds * 1e3, kernel * 1e3, (seconds - kernel) * 1e3]
            )
            if layers > 1:
                rows.append(
                    [
                        f"TP{tp} {name}: {layers - 1} more layers",
                        "light checks",
                        1,
                        light * 1e3,
                        light_kernel * 1e3,
                        (light - light_kernel) * 1e3,
                    ]
                )
        dense[f"tp{tp}"] = total
        rows.append([f"TP{tp} all four x {layers} layers", "", "", total * 1e3, "", ""])
        rechecks[f"dense_tp{tp}"], row = time_recheck(f"TP{tp}", tdev, settings)
        rows.append(row)
        serving.STATE.reset()
        serving.route(device.index, settings)
    serving.route(device.index, settings, "moe")  # decided before the layer checks are timed

    moe_rows, moe_costs, moe_light = [], {}, {}
    for tp in tps:
        experts, hidden, inter = moe_shape(tp, scale)
        layer = MoeLayer(experts, hidden, inter, 8, tdev)
        check = moe.moe_check("bench-moe", layer, serve=moe_serve(args.kernel))
        seconds, report = time_check(check, device, settings)
        assert report is not None and report.passed, report and report.reason
        moe_costs[f"tp{tp}"] = seconds
        kernel = sum(r.duration_s for r in report.shapes)
        moe_rows.append(
            [
                f"TP{tp}",
                f"E={experts} H={hidden} I={inter} top-8",
                len(report.shapes),
                seconds * 1e3,
                kernel * 1e3,
                (seconds - kernel) * 1e3,
            ]
        )
        extra = []
        light = 0.0
        for _ in range(args.moe_layers):
            extra.append(MoeLayer(experts, hidden, inter, 8, tdev))
            s, r = time_check(moe.moe_check("bench-moe", extra[-1], serve=moe_serve(args.kernel)), device, settings)
            assert r is not None and r.passed, r and r.reason
            light += s
        if args.moe_layers:
            moe_light[f"tp{tp}"] = light / args.moe_layers
            moe_rows.append([f"TP{tp}: {args.moe_layers} more layers", "light checks", 1, light * 1e3, "", ""])
        rechecks[f"moe_tp{tp}"], row = time_recheck(f"TP{tp}", tdev, settings)
        moe_rows.append(row)
        del layer, extra
        serving.STATE.reset()  # the next TP's layer is re-checked on its own
        serving.route(device.index, settings, "moe")

    emulated_rows = []
    if args.kernel == "emulated":
        # The capture-safe `emulated` MoE (the fallback SGLang's graphs replay): one call, TP8's layer shape.
        experts, hidden, inter = (256, 7168, 256) if scale == 1 else (max(8, 512 // scale), 512, 32)
        w = MoeLayer(experts, hidden, inter, 8, tdev)
        weights = moe.processed_weights(w).weights
        fn = backends.resolve_moe("emulated")
        for tokens in (1, 64, 512):
            gen = torch.Generator().manual_seed(tokens)
            ids, tw = verify.moe_routing(tokens, 8, experts, "random", gen)
            x = (torch.randn(tokens, hidden, generator=gen) * 2).to(torch.bfloat16).to(tdev)
            out = torch.empty_like(x)
            call = lambda: fn(x, ids.to(tdev), tw.to(tdev), *weights, "swiglu", torch.bfloat16, out)  # noqa: E731
            call()
            _, seconds = synced(tdev, call)
            emulated_rows.append([f"T={tokens}", f"E={experts} H={hidden} I={inter} top-8", seconds * 1e3])
        del w, weights

    print(
        f"on {device.label()}, {args.kernel} backend{' (--quick: layers / 16)' if scale > 1 else ''}"
        + (f"; its kernels compiled first, on throwaway layers ({warm_s:.0f} s)" if warm_s else "")
        + (
            "; the stand-in quantizer eager (--eager-quantizer)"
            if QUANTIZER.eager
            else f"; the stand-in quantizer from {quantizer_graphs} CUDA graphs (eager where none fits)"
        )
        + "\n"
    )
    print(
        f"generic dense self-test (decide): {dense_generic * 1e3:.0f} ms; generic MoE self-test: {moe_generic * 1e3:.0f} ms "
        f"(its kernel calls: {moe_generic_kernel * 1e3:.0f} ms)\n"
    )
    # "kernel ms": the emulated backend's own calls (on SM120 the FlashInfer kernel's, far shorter);
    # "oracle + checks ms": inputs, references and comparisons, the part that stays on SM120.
    print(table(["dense layer", "shape", "batch sizes", "check ms", "kernel ms", "oracle + checks ms"], rows))
    print()
    print(table(["MoE layer", "shape", "batches", "check ms", "kernel ms", "oracle + checks ms"], moe_rows))
    print()
    print(table(["capture-safe emulated MoE, one call", "shape", "ms"], emulated_rows))
    if CONVERSION_S[0]:
        print(
            f"\n{args.kernel}'s own conversion of the layers' weights at load (timed apart, not in the rows above): "
            f"{CONVERSION_S[0]:.1f} s in all"
        )
    met_dense = all(v <= DENSE_TARGET_S for v in dense.values())
    met_moe = all(v <= MOE_TARGET_S for v in moe_costs.values())
    print(
        f"\ndense layer checks per GPU ({layers} layers per configuration): {', '.join(f'{k} {v:.2f} s' for k, v in dense.items())} "
        f"(target <= {DENSE_TARGET_S} s: {'met' if met_dense else 'NOT met'}); MoE per configuration: "
        f"{', '.join(f'{k} {v:.2f} s' for k, v in moe_costs.items())} (target <= {MOE_TARGET_S} s: {'met' if met_moe else 'NOT met'})"
    )
    print(
        f"re-check after capture at {len(CAPTURED)} graph sizes (dense: all four configurations; MoE: one layer): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in rechecks.items())
    )
    if PEAK_MIB:
        print("peak extra GPU memory of one layer check: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in PEAK_MIB.items()))
        bound = devices.CHECK_MEMORY_BYTES / 2**20
        for family, parts in PEAK_PARTS_MIB.items():
            own = parts["own"] + parts["kept_originals"]  # both inside the bound
            print(
                f"  {family}: the check's own {own:.0f} MiB ({parts['own']:.0f} made by the check, "
                f"{parts['kept_originals']:.0f} original bytes kept on the GPU for its oracle; bound {bound:.0f} MiB: "
                f"{'within' if own <= bound else 'OVER'}); the largest served call's own {parts['served']:.0f} MiB "
                "(its output and working memory, the engine's cost of serving that M)"
            )
    write(
        "selftest_cost",
        {
            "check_peak_extra_mib": PEAK_MIB,
            "check_peak_parts_mib": PEAK_PARTS_MIB,
            "check_memory_bound_mib": devices.CHECK_MEMORY_BYTES / 2**20,
            "recheck_s": rechecks,
            "recheck_sizes": len(CAPTURED),
            "device": device.label(),
            "quick": scale > 1,
            "kernel": args.kernel,
            "warm_up_s": warm_s,
            "quantizer": "eager" if QUANTIZER.eager else f"{quantizer_graphs} graphs",
            "conversion_s": CONVERSION_S[0],
            "dense_generic_s": dense_generic,
            "moe_generic_s": moe_generic,
            "moe_generic_kernel_s": moe_generic_kernel,
            "dense_rows": rows,
            "dense_total_s": dense,
            "moe_rows": moe_rows,
            "moe_s": moe_costs,
            "moe_light_per_layer_s": moe_light,
            "layers": layers,
            "emulated_moe_rows": emulated_rows,
            "targets": {"dense_per_gpu_s": DENSE_TARGET_S, "moe_per_config_s": MOE_TARGET_S},
            "met": {"dense": met_dense, "moe": met_moe},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
