"""Humming (``humming-kernels``) as the last verified link of the fallback chain: :mod:`.engine` (Humming
itself), :mod:`.convert` (each served layer converted at load), :mod:`.adapter` (the backends, status),
:mod:`.cuda` and :mod:`.dequant` (the activation dequantization: CUDA C through NVRTC, else Triton)."""

from .adapter import *  # noqa: F403
from .adapter import __all__  # noqa: F401
