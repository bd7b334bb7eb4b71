"""``sm120-fp4 bench``: the speed of each candidate backend on this GPU, beside its verdict.

Each candidate is first verified at each served layer configuration (a checkpoint's, or defaults); each
verified one, and a bf16 yardstick of the same shape, is then timed at the batch sizes a server runs (a
CUDA-graph replay per sample where it can be captured, L2 flushed before each, after FlashInfer's autotune).
"""

from .command import main, plot, table
from .measure import DECODE_SIZES, PREFILL_SIZES, DenseShape, MoeShape, configurations, run

__all__ = ["DECODE_SIZES", "PREFILL_SIZES", "DenseShape", "MoeShape", "configurations", "run", "table", "plot", "main"]
