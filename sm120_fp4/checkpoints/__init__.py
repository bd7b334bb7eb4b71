"""What a checkpoint directory says: ModelOpt or compressed-tensors, NVFP4 or not, its tensors checked once."""

from .checks import ROLES, Checkpoint, inspect
from .layers import DEFAULT_PACKED, EXPERT, ModelLayers, discover, dtype, load
from .quantization import COMPRESSED_TENSORS, MODELOPT, NAMES, Quantization, read_quantization, text_config

__all__ = [
    "Quantization",
    "read_quantization",
    "MODELOPT",
    "COMPRESSED_TENSORS",
    "Checkpoint",
    "inspect",
    "NAMES",
    "ROLES",
    "text_config",
    "DEFAULT_PACKED",
    "EXPERT",
    "ModelLayers",
    "discover",
    "dtype",
    "load",
]
