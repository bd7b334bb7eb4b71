"""FP4 GEMM and NVFP4 fused-MoE backends behind two conventions (:mod:`.convention`): the registries
(:mod:`.registry`: ``register()``, ``register_moe()``, the entry-point groups ``sm120_fp4.backends`` and
``sm120_fp4.moe_backends``) and the built-ins: FlashInfer's, ``emulated`` (the oracle's arithmetic), Humming.
"""

from .registry import *  # noqa: F403
from .registry import __all__  # noqa: F401
