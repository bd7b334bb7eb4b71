"""Code that runs in spawned children (importable without pytest).

Nothing here imports SGLang or torch at module level: a spawned child imports this module to find
its target before the target runs, and the target must register its backend before SGLang loads.
"""

from __future__ import annotations

import os
import sys


def _stderr_to(path: str) -> None:
    """Send this process's stderr (fd 2 and sys.stderr) to `path`, so the parent can read it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def all_zeros(a, b, a_sf, b_sf, alpha, dtype, out):
    """A kernel that returns zeros (FlashInfer 2577 on SM120)."""
    out.zero_()
    return out


def scheduler_with_broken_backend(stderr_path: str) -> None:
    """Start the way an SGLang scheduler does under SM120_FP4=1 and load one NVFP4 layer.

    The backend named in SM120_FP4_BACKENDS is registered first (as a user's plugin would); the
    `.pth` bootstrap installs the library when SGLang is imported; the first layer's weight
    processing self-tests and, under SELFTEST=strict, raises RefusedToServe out of this function.
    On the way it writes which patch SGLang's alias carries once SGLang is imported.
    """
    _stderr_to(stderr_path)
    from sm120_fp4 import backends

    backends.register("zeros", all_zeros)
    import sglang.srt.layers.quantization.modelopt_quant  # noqa: F401 - the bootstrap installs here

    from helpers.common import sglang_alias  # after SGLang's import: it reads the installed release

    sys.stderr.write(f"child: alias patch {getattr(sglang_alias(), '__sm120_fp4_patch__', None)}\n")

    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import layers

    layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    sys.stderr.write("child: the layer loaded and the worker would serve\n")
