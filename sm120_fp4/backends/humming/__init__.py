"""Humming (``humming-kernels``) as the last verified link of the fallback chain: :mod:`.adapter`
(support, the conversion of each served layer, the dense and MoE backends, status), :mod:`.cuda`
and :mod:`.dequant` (the dense backend's activation dequantization: a CUDA C kernel through NVRTC,
else a Triton kernel)."""

from .adapter import *  # noqa: F403
from .adapter import __all__  # noqa: F401
