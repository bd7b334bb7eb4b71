"""The command line: its parser, and ``main`` handing each command to its module."""

from __future__ import annotations

import argparse
from typing import Sequence

from .common import EXIT_OK, EXIT_USAGE, _eprint
from .launch import cmd_launch
from .selftest import ENGINE_NAMES, cmd_selftest, cmd_selftest_model
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
    add = sub.add_parser("doctor", help="report GPUs, versions, settings, patch targets and backends").add_argument
    add("--json", action="store_true", help="JSON instead of Markdown")
    add("--strict", action="store_true", help="exit 1 when a problem is found")
    add("--quick", action="store_true", help="skip importing SGLang to check each patch target")
    add = sub.add_parser("selftest", help="self-test each GPU in a short-lived subprocess").add_argument
    add("--device", type=int, action="append", help="CUDA ordinal (repeatable); default: every 12.x GPU")
    moe = "with --moe: MoE backends, default SM120_FP4_MOE_BACKENDS"
    add("--backend", action="append", help=f"candidate backend (repeatable); default: SM120_FP4_BACKENDS ({moe})")
    add("--moe", action="store_true", help="the NVFP4 fused-MoE family instead of the dense FP4 GEMM")
    add("--json", action="store_true")
    own = "verify this local NVFP4 checkpoint's own layers (ModelOpt or compressed-tensors), no server"
    add("--model", metavar="DIR", help=own)
    add("--engine", choices=ENGINE_NAMES, default="sglang", help="with --model: whose layer classes build the layers")
    add = sub.add_parser("launch", help="preflight (dense and MoE), then exec COMMAND with SM120_FP4=1").add_argument
    unverified = "start COMMAND even when a decision would serve unverified (SM120_FP4_SELFTEST=warn/off)"
    add("--allow-unverified", action="store_true", help=unverified)
    add("command", nargs=argparse.REMAINDER)


def _add_tool_commands(sub) -> None:
    """Add demo, bench and the preflight's worker commands."""
    demo = "SGLang's real FP4 linear layer, patched and self-tested on a simulated SM120 (CPU)"
    add = sub.add_parser("demo", help=demo).add_argument
    server = "a real SGLang server on this CPU (simulation): an answer, then a broken kernel refused"
    add("--server", action="store_true", help=server)
    add("--model-path", help="with --server: serve this local NVFP4 checkpoint once instead")
    add("server_args", nargs=argparse.REMAINDER, help="with --server: after --, arguments for SGLang")
    bench = "verify, then time, each candidate backend and bf16 at the served shapes and batch sizes"
    add = sub.add_parser("bench", help=bench).add_argument
    configs = "the layer configurations of this local NVFP4 checkpoint (default: one dense, one MoE)"
    add("--model", metavar="DIR", help=configs)
    add("--json", metavar="PATH", help="also write the result as JSON to PATH")
    add("--plot", metavar="PNG", help="also plot TFLOP/s against M per backend into PNG (needs matplotlib)")
    add("--device", type=int, help="CUDA ordinal (default: the first 12.x GPU)")
    add("--backend", action="append", help="candidate backend (repeatable); default: the configured candidates")
    add("--sizes", type=int, nargs="+", metavar="M", help="batch sizes (default: 1..256 by powers of two, 512..8192)")
    add("--allow-any-gpu", action="store_true", help="measure a GPU that is not compute-capability 12.x")
    add = sub.add_parser("_selftest-worker").add_argument
    add("--device", type=int, required=True)
    add("--backend", action="append")
    add("--moe", action="store_true")
    add("--crashed", action="append", help="NAME=REASON: a candidate that crashed an earlier worker")
    add("--uuid", help="the UUID of the GPU the parent numbered --device (checked against CUDA's numbering)")
    add = sub.add_parser("_model-worker").add_argument
    add("--device", type=int, required=True)
    add("--model", required=True)
    add("--engine", choices=ENGINE_NAMES, default="sglang")


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
