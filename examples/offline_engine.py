"""Offline batch generation with ``sglang.Engine`` and sm120_fp4 active (no HTTP server).

    python examples/offline_engine.py --model-path nvidia/Llama-3.1-8B-Instruct-FP4
    python examples/offline_engine.py --check-only   # install + print status(); no GPU or model needed

``install()`` must run before the Engine is built: it exports ``SM120_FP4=1`` so the scheduler
processes the Engine spawns patch themselves and self-test their GPU at the first NVFP4 layer. If no
FP4 GEMM backend verifies, the Engine fails to start with the refusal message instead of generating
garbage. ``SM120_FP4_*`` environment variables configure it (see ``sm120-fp4 doctor``).
"""

import argparse

import sm120_fp4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", default="nvidia/Llama-3.1-8B-Instruct-FP4", help="an NVFP4 (ModelOpt) checkpoint"
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel GPUs")
    parser.add_argument("--check-only", action="store_true", help="install and print the status only")
    args = parser.parse_args()

    status = sm120_fp4.install()
    print(status.model_dump_json(indent=2) if args.check_only else f"sm120_fp4: {status.message}")
    if args.check_only:
        return

    import sglang  # after install(): nothing is patched too late

    engine = sglang.Engine(
        model_path=args.model_path,
        quantization="modelopt_fp4",  # SGLang's NVFP4 linear method: the GEMM sm120_fp4 verifies
        tp_size=args.tp_size,
        mem_fraction_static=0.8,
        log_level="warning",  # SGLang's default for Engine is "error", which hides the self-test line
    )
    try:
        prompts = ["The capital of France is", "Write a haiku about 4-bit floating point:"]
        outputs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 32})
        for prompt, out in zip(prompts, outputs):
            print(f"{prompt!r} -> {out['text']!r}")
        print(sm120_fp4.status().message)  # this process's view; each worker logs its decision
    finally:
        engine.shutdown()


if __name__ == "__main__":  # required: SGLang spawns worker processes that re-import this file
    main()
