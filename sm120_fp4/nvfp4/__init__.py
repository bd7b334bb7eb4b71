"""The NVFP4 format in pure PyTorch: the oracle every backend is checked against.

:mod:`.format` holds the codes, packing, the 128x4 scale swizzle, quantize and dequantize;
:mod:`.reference` the dense GEMM and fused-MoE oracles written over it.
"""

from .format import *  # noqa: F403
from .format import __all__ as _format_all
from .reference import *  # noqa: F403
from .reference import __all__ as _reference_all

__all__ = [*_format_all, *_reference_all]
