"""A tiny random NVFP4 Qwen3-MoE checkpoint (2 layers, 8 experts) in ModelOpt's format (the server demo's)."""

from __future__ import annotations

import json
import os

import torch

from .. import nvfp4
from ..checkpoints import MODELOPT
from ..errors import InvalidArgument
from ..sglang.moe_layers import QUANT_CONFIGS, TINY_MODEL_CONFIG
from .synthetic import quantize_weight

_SPECIAL = ["<s>", "</s>"]
_CALIBRATION_AMAX = 8.0


def _quantize_split(dense: torch.Tensor, names: list[str], sizes: list[int]) -> dict[str, torch.Tensor]:
    """Quantize the shards of one fused layer with one global scale, as ModelOpt exports them, then split."""
    packed, scales, scale_2 = quantize_weight(dense)
    input_scale = torch.tensor(_CALIBRATION_AMAX / (nvfp4.E4M3_MAX * nvfp4.E2M1_MAX), dtype=torch.float32)
    out, row = {}, 0
    for name, n in zip(names, sizes):
        out[f"{name}.weight"] = packed[row : row + n].clone()
        out[f"{name}.weight_scale"] = scales[row : row + n].clone()
        out[f"{name}.weight_scale_2"] = scale_2.float().clone()
        out[f"{name}.input_scale"] = input_scale.clone()
        row += n
    return out


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    c = TINY_MODEL_CONFIG
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    h, head, vocab, inter = c["hidden_size"], c["head_dim"], c["vocab_size"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    out = {"model.embed_tokens.weight": rand(vocab, h, std=1.0), "model.norm.weight": ones(h)}
    out["lm_head.weight"] = rand(vocab, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out.update({f"{p}.{n}.weight": ones(h) for n in ("input_layernorm", "post_attention_layernorm")})
        out.update({f"{p}.self_attn.{n}.weight": ones(head) for n in ("q_norm", "k_norm")})
        # SGLang serves qkv_proj (and each expert's gate/up) with one global scale: quantized together.
        qkv = [f"{p}.self_attn.{proj}" for proj in ("q_proj", "k_proj", "v_proj")]
        out.update(_quantize_split(torch.cat([rand(q, h), rand(kv, h), rand(kv, h)]), qkv, [q, kv, kv]))
        out.update(_quantize_split(rand(h, q), [f"{p}.self_attn.o_proj"], [h]))
        out[f"{p}.mlp.gate.weight"] = rand(c["num_experts"], h, std=0.5)
        for e in range(c["num_experts"]):
            expert = f"{p}.mlp.experts.{e}"
            gate_up = [f"{expert}.gate_proj", f"{expert}.up_proj"]
            out.update(_quantize_split(rand(2 * inter, h), gate_up, [inter, inter]))
            out.update(_quantize_split(rand(h, inter), [f"{expert}.down_proj"], [h]))
    return out


def _write_tokenizer(root: str) -> None:
    """Write a byte-level BPE tokenizer with no merges: 256 byte tokens plus <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    for token in _SPECIAL:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(_SPECIAL)
    path = os.path.join(root, "tokenizer.json")
    tokenizer.save(path)
    os.chmod(path, 0o600)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    config.update(model_max_length=2048, add_bos_token=False, clean_up_tokenization_spaces=False)
    _write_json(os.path.join(root, "tokenizer_config.json"), config)


def _write_json(path: str, value: dict) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


def write_checkpoint(root: str, seed: int = 0) -> str:
    """Write the tiny checkpoint into the new or empty directory `root` (made owner-only); return `root`."""
    from safetensors.torch import save_file

    os.makedirs(root, mode=0o700, exist_ok=True)
    if os.listdir(root):
        raise InvalidArgument(f"write_checkpoint: root={root!r} is not empty; accepted: a new or empty directory")
    quant = QUANT_CONFIGS[MODELOPT]
    _write_json(os.path.join(root, "config.json"), {**TINY_MODEL_CONFIG, "quantization_config": quant})
    hf_quant = dict(quant_algo="NVFP4", group_size=16, kv_cache_quant_algo=None, exclude_modules=["lm_head"])
    _write_json(os.path.join(root, "hf_quant_config.json"), {"producer": quant["producer"], "quantization": hf_quant})
    _write_json(os.path.join(root, "generation_config.json"), {"bos_token_id": 256, "eos_token_id": 257})
    path = os.path.join(root, "model.safetensors")
    save_file(_tensors(seed), path, metadata={"format": "pt"})
    os.chmod(path, 0o600)
    _write_tokenizer(root)
    return root
