"""A tiny NVFP4 checkpoint in NVIDIA ModelOpt's export format, written for ``sm120-fp4 demo --server``.

Random weights (the server's answer is not meant to make sense), quantized with :mod:`sm120_fp4.nvfp4`
exactly as ModelOpt's ``export_hf_checkpoint`` lays them out (or, with ``fmt="compressed-tensors"``, as
llm-compressor names them: ``weight_packed``, and the encode scales ``weight_global_scale`` /
``input_global_scale`` instead of the decode scales): per linear layer ``weight`` (uint8 (N, K/2),
packed E2M1), ``weight_scale`` (float8_e4m3fn (N, K/16), linear, not swizzled), ``weight_scale_2`` and
``input_scale`` (0-dim float32 decode scales, amax / (448 * 6)). The config carries the quantization both
as ``config.json``'s ``quantization_config`` and as ``hf_quant_config.json``. The model is a two-layer
Qwen3-MoE (attention projections: NVFP4 dense layers; eight experts per layer, top-2: NVFP4 MoE layers);
the tokenizer is byte-level (every text encodes), written with ``tokenizers``.
"""

from __future__ import annotations

import json
import os

import torch

from .. import nvfp4
from ..checkpoints import COMPRESSED_TENSORS, MODELOPT
from ..errors import InvalidArgument

__all__ = ["write_checkpoint", "ARCHITECTURE", "MODELOPT", "COMPRESSED_TENSORS"]

ARCHITECTURE = dict(
    hidden=256, moe_intermediate=128, experts=8, top_k=2, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=512
)
_SPECIAL = ["<s>", "</s>"]


def _quantize(name: str, dense: torch.Tensor, calibration_amax: float) -> dict[str, torch.Tensor]:
    """One linear layer's four ModelOpt NVFP4 tensors."""
    gsf_w = nvfp4.global_scale(dense)
    packed, swizzled = nvfp4.quantize(dense, gsf_w)
    n, k = dense.shape
    return {
        f"{name}.weight": packed,
        f"{name}.weight_scale": nvfp4.unswizzle_scales(swizzled, n, k).view(torch.float8_e4m3fn),
        f"{name}.weight_scale_2": (1.0 / gsf_w).reshape(()).float(),
        f"{name}.input_scale": torch.tensor(calibration_amax / (nvfp4.E4M3_MAX * nvfp4.E2M1_MAX), dtype=torch.float32),
    }


def _as_compressed_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same quantized bytes under llm-compressor's names: ``weight_packed``, ``weight_scale``, and the
    encode scales themselves as ``weight_global_scale`` / ``input_global_scale`` (float32, shape (1,))."""
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


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    a = ARCHITECTURE
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    h, q, kv = a["hidden"], a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"]
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(a["vocab"], h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(a["vocab"], h),
    }
    for i in range(a["layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[f"{p}.self_attn.q_norm.weight"] = torch.ones(a["head_dim"], dtype=torch.bfloat16)
        out[f"{p}.self_attn.k_norm.weight"] = torch.ones(a["head_dim"], dtype=torch.bfloat16)
        # q, k and v with one global scale, as ModelOpt's export makes the shards of a fused layer (SGLang
        # serves qkv_proj with one, the largest): quantize them together, then split.
        qkv = _quantize("x", torch.cat([rand(q, h), rand(kv, h), rand(kv, h)]), 8.0)
        row = 0
        for proj, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            name = f"{p}.self_attn.{proj}"
            for kind in ("weight", "weight_scale"):
                out[f"{name}.{kind}"] = qkv[f"x.{kind}"][row : row + n].clone()
            out[f"{name}.weight_scale_2"], out[f"{name}.input_scale"] = (
                qkv["x.weight_scale_2"].clone(),
                qkv["x.input_scale"].clone(),
            )
            row += n
        out.update(_quantize(f"{p}.self_attn.o_proj", rand(h, q), 8.0))
        out[f"{p}.mlp.gate.weight"] = rand(a["experts"], h, std=0.5)
        inter = a["moe_intermediate"]
        for e in range(a["experts"]):
            gate_up = rand(2 * inter, h)
            # One global scale for w1 and w3, as ModelOpt's export makes them (SGLang's cutlass MoE applies
            # the gate's to both halves): quantize them together, then split.
            both = _quantize("x", gate_up, 8.0)
            for half, proj in ((slice(0, inter), "gate_proj"), (slice(inter, 2 * inter), "up_proj")):
                name = f"{p}.mlp.experts.{e}.{proj}"
                out[f"{name}.weight"] = both["x.weight"][half].clone()
                out[f"{name}.weight_scale"] = both["x.weight_scale"][half].clone()
                out[f"{name}.weight_scale_2"] = both["x.weight_scale_2"].clone()
                out[f"{name}.input_scale"] = both["x.input_scale"].clone()
            out.update(_quantize(f"{p}.mlp.experts.{e}.down_proj", rand(h, inter), 8.0))
    return out


def _quantization_config(fmt: str) -> dict:
    if fmt == MODELOPT:
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "ignore": ["lm_head"],
            "producer": {"name": "sm120_fp4", "version": "demo"},
        }
    fp4 = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "symmetric": True,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": fp4,
                "format": "nvfp4-pack-quantized",
                "input_activations": {**fp4, "dynamic": "local"},
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
    }


def _config(fmt: str) -> dict:
    a = ARCHITECTURE
    quant = _quantization_config(fmt)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "hidden_size": a["hidden"],
        "intermediate_size": 4 * a["moe_intermediate"],
        "moe_intermediate_size": a["moe_intermediate"],
        "num_experts": a["experts"],
        "num_local_experts": a["experts"],
        "num_experts_per_tok": a["top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": a["layers"],
        "num_attention_heads": a["heads"],
        "num_key_value_heads": a["kv_heads"],
        "head_dim": a["head_dim"],
        "vocab_size": a["vocab"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "attention_bias": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "quantization_config": quant,
    }


def _write_tokenizer(root: str) -> None:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens plus <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for token in _SPECIAL:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(_SPECIAL)
    path = os.path.join(root, "tokenizer.json")
    tokenizer.save(path)
    os.chmod(path, 0o600)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 2048,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    _write_json(os.path.join(root, "tokenizer_config.json"), config)


def _write_json(path: str, value: dict) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


def write_checkpoint(root: str, seed: int = 0, fmt: str = MODELOPT) -> str:
    """Write the tiny checkpoint, in `fmt` (MODELOPT or COMPRESSED_TENSORS), into the new or empty directory
    `root` (created owner-only); returns `root`."""
    from safetensors.torch import save_file

    if fmt not in (MODELOPT, COMPRESSED_TENSORS):
        raise InvalidArgument(f"write_checkpoint: fmt={fmt!r}; accepted: {MODELOPT!r}, {COMPRESSED_TENSORS!r}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    if os.listdir(root):
        raise InvalidArgument(f"write_checkpoint: root={root!r} is not empty; accepted: a new or empty directory")
    config = _config(fmt)
    _write_json(os.path.join(root, "config.json"), config)
    tensors = _tensors(seed)
    if fmt == MODELOPT:
        _write_json(
            os.path.join(root, "hf_quant_config.json"),
            {
                "producer": config["quantization_config"]["producer"],
                "quantization": {
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "kv_cache_quant_algo": None,
                    "exclude_modules": ["lm_head"],
                },
            },
        )
    else:
        tensors = _as_compressed_tensors(tensors)
    _write_json(os.path.join(root, "generation_config.json"), {"bos_token_id": 256, "eos_token_id": 257})
    path = os.path.join(root, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o600)
    _write_tokenizer(root)
    return root
