"""The command line: its parser, and ``main`` handing each command to its module."""

from __future__ import annotations

import argparse
from typing import Sequence

from .common import EXIT_OK, EXIT_USAGE, _eprint
from .engines import ENGINE_NAMES
from .launch import cmd_launch
from .selftest import cmd_selftest, cmd_selftest_model
from .workers import _model_worker, _worker, _worker_exit


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="sm120-fp4", description="Verified NVFP4 GEMM for SGLang on SM120/SM121 GPUs."
    )
    parser.add_argument("--version", action="version", version=f"sm120-fp4 {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_preflight_commands(sub)
    _add_tool_commands(sub)
    return parser


def _add_preflight_commands(sub) -> None:
    """Add doctor, selftest and launch."""
    doctor = sub.add_parser("doctor", help="report GPUs, versions, settings, patch targets and backends")
    doctor.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    doctor.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    doctor.add_argument("--quick", action="store_true", help="skip importing SGLang to check each patch target")
    selftest = sub.add_parser("selftest", help="self-test each GPU in a short-lived subprocess")
    selftest.add_argument(
        "--device", type=int, action="append", help="CUDA ordinal (repeatable); default: every 12.x GPU"
    )
    selftest.add_argument(
        "--backend",
        action="append",
        help="candidate backend (repeatable); default: SM120_FP4_BACKENDS (with --moe: MoE backends, default SM120_FP4_MOE_BACKENDS)",
    )
    selftest.add_argument("--moe", action="store_true", help="the NVFP4 fused-MoE family instead of the dense FP4 GEMM")
    selftest.add_argument("--json", action="store_true")
    selftest.add_argument(
        "--model",
        metavar="DIR",
        help="verify this local NVFP4 checkpoint's own layers (ModelOpt or compressed-tensors), no server",
    )
    selftest.add_argument(
        "--engine", choices=ENGINE_NAMES, default="sglang", help="with --model: whose layer classes build the layers"
    )
    launch = sub.add_parser("launch", help="preflight (dense and MoE), then exec COMMAND with SM120_FP4=1")
    launch.add_argument(
        "--allow-unverified",
        action="store_true",
        help="start COMMAND even when a decision would serve unverified (SM120_FP4_SELFTEST=warn/off)",
    )
    launch.add_argument("command", nargs=argparse.REMAINDER)


def _add_tool_commands(sub) -> None:
    """Add demo, bench and the preflight's worker commands."""
    demo = sub.add_parser(
        "demo", help="SGLang's real FP4 linear layer, patched and self-tested on a simulated SM120 (CPU)"
    )
    demo.add_argument(
        "--server",
        action="store_true",
        help="a real SGLang server on this CPU (simulation): an answer, then a broken kernel refused",
    )
    demo.add_argument("--model-path", help="with --server: serve this local NVFP4 checkpoint once instead")
    demo.add_argument("server_args", nargs=argparse.REMAINDER, help="with --server: after --, arguments for SGLang")
    bench = sub.add_parser(
        "bench", help="verify, then time, each candidate backend and bf16 at the served shapes and batch sizes"
    )
    bench.add_argument(
        "--model",
        metavar="DIR",
        help="the layer configurations of this local NVFP4 checkpoint (default: one dense, one MoE)",
    )
    bench.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    bench.add_argument(
        "--plot", metavar="PNG", help="also plot TFLOP/s against M per backend into PNG (needs matplotlib)"
    )
    bench.add_argument("--device", type=int, help="CUDA ordinal (default: the first 12.x GPU)")
    bench.add_argument(
        "--backend", action="append", help="candidate backend (repeatable); default: the configured candidates"
    )
    bench.add_argument(
        "--sizes", type=int, nargs="+", metavar="M", help="batch sizes (default: 1..256 by powers of two, 512..8192)"
    )
    bench.add_argument("--allow-any-gpu", action="store_true", help="measure a GPU that is not compute-capability 12.x")
    worker = sub.add_parser("_selftest-worker")
    worker.add_argument("--device", type=int, required=True)
    worker.add_argument("--backend", action="append")
    worker.add_argument("--moe", action="store_true")
    worker.add_argument("--crashed", action="append", help="NAME=REASON: a candidate that crashed an earlier worker")
    worker.add_argument(
        "--uuid", help="the UUID of the GPU the parent numbered --device (checked against CUDA's numbering)"
    )
    model_worker = sub.add_parser("_model-worker")
    model_worker.add_argument("--device", type=int, required=True)
    model_worker.add_argument("--model", required=True)
    model_worker.add_argument("--engine", choices=ENGINE_NAMES, default="sglang")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if args.cmd == "doctor":
        from ..doctor import run as doctor

        return doctor(as_json=args.json, strict=args.strict, deep=not args.quick)
    if args.cmd == "selftest":
        if args.model:
            if args.moe or args.backend:
                _eprint(
                    "sm120-fp4 selftest: --model verifies the checkpoint with the configured backends "
                    "(SM120_FP4_BACKENDS, SM120_FP4_MOE_BACKENDS); --moe and --backend do not apply"
                )
                return EXIT_USAGE
            return cmd_selftest_model(args)
        if args.engine != "sglang":
            _eprint("sm120-fp4 selftest: --engine goes with --model (the kernel self-test is engine-neutral)")
            return EXIT_USAGE
        return cmd_selftest(args)
    if args.cmd == "bench":
        from ..bench import main as bench

        return bench(args)
    if args.cmd == "_model-worker":
        return _worker_exit(_model_worker(args))
    if args.cmd == "launch":
        return cmd_launch(args)
    if args.cmd == "demo":
        if args.server or args.model_path or args.server_args:
            if not args.server:
                _eprint("sm120-fp4 demo: --model-path and SGLang arguments go with --server")
                return EXIT_USAGE
            from ..demo.server import main as server_demo

            return server_demo(args.model_path, args.server_args)
        from ..demo import main as demo

        return demo()
    return _worker_exit(_worker(args))
