"""Start SGLang's OpenAI-compatible server with sm120_fp4 active, from Python.

    python examples/launch_sglang.py --model-path nvidia/Llama-3.1-8B-Instruct-FP4 \
        --quantization modelopt_fp4 --host 0.0.0.0 --port 30000

Every argument is SGLang's own (``python -m sglang.launch_server --help``). ``install()`` patches
this process and exports ``SM120_FP4=1``, so the scheduler processes SGLang spawns patch themselves
(``.pth`` bootstrap / ``sglang.srt.plugins`` entry point). Each one self-tests its GPU at the first
NVFP4 layer and exits non-zero, naming why, when no FP4 GEMM backend verifies. Equivalent from the
shell: ``sm120-fp4 launch -- python -m sglang.launch_server ...`` (adds a preflight per GPU).
"""

import runpy
import sys

import sm120_fp4

if __name__ == "__main__":
    status = sm120_fp4.install()  # SM120_FP4_* env vars apply; see `sm120-fp4 doctor`
    patches = ", ".join(f"{p.name}={p.state}" for p in status.patches if p.state != "skipped")
    # One line on stderr, before SGLang starts: what is patched, or why nothing is.
    print(f"sm120_fp4 {status.version}: {status.message}; patches: {patches or 'none'}", file=sys.stderr, flush=True)
    # Hand over to SGLang's real launcher, as `python -m sglang.launch_server` with this argv.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
