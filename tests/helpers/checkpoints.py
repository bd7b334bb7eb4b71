"""The demo's tiny NVFP4 checkpoint in either format the library reads (tests of selftest --model, the canary server).

``sm120_fp4.demo.checkpoint.write_checkpoint`` writes ModelOpt's format (what the demo serves);
:func:`write_checkpoint` here also writes llm-compressor's (compressed-tensors) from it: the same tensors under
compressed-tensors' names, the global scales as encode scales, and its quantization_config.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import torch

from sm120_fp4.checkpoints import COMPRESSED_TENSORS, MODELOPT
from sm120_fp4.demo import checkpoint as demo_checkpoint
from sm120_fp4.sglang.moe_layers import QUANT_CONFIGS

__all__ = ["COMPRESSED_TENSORS", "MODELOPT", "as_compressed_tensors", "write_checkpoint"]


def as_compressed_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return ModelOpt tensors under llm-compressor's names, the global scales as encode scales (shape (1,))."""
    out = {}
    for name, value in tensors.items():
        stem, kind = name.rsplit(".", 1)
        if kind == "weight" and value.dtype == torch.uint8:
            out[stem + ".weight_packed"] = value
        elif kind == "weight_scale_2":
            out[stem + ".weight_global_scale"] = (1.0 / value.float()).reshape(1)
        elif kind == "input_scale":
            out[stem + ".input_global_scale"] = (1.0 / value.float()).reshape(1)
        else:
            out[name] = value
    return out


def write_checkpoint(root: str, seed: int = 0, fmt: str = MODELOPT) -> str:
    """Write the demo's tiny checkpoint in `fmt` (MODELOPT or COMPRESSED_TENSORS) into `root`; return `root`."""
    from safetensors.torch import load_file, save_file

    if fmt not in (MODELOPT, COMPRESSED_TENSORS):
        raise ValueError(f"write_checkpoint: fmt={fmt!r}; accepted: {MODELOPT!r}, {COMPRESSED_TENSORS!r}")
    demo_checkpoint.write_checkpoint(root, seed)
    if fmt == MODELOPT:
        return root
    path = os.path.join(root, "model.safetensors")
    save_file(as_compressed_tensors(load_file(path)), path, metadata={"format": "pt"})
    os.remove(os.path.join(root, "hf_quant_config.json"))  # ModelOpt's own file
    with open(os.path.join(root, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = QUANT_CONFIGS[COMPRESSED_TENSORS]
    with open(os.path.join(root, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return root
