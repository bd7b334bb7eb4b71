"""Check an NVFP4 checkpoint's tensors once, against NVFP4 and config.json, before any kernel runs."""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field

from ..errors import CheckpointError, ConfigError
from .quantization import GROUP_SIZE, NAMES, Quantization, group_size_problem, ignored, read_quantization, text_config
from .scales import SCALE_NAMES, alpha_problem, block_scale_problem, scale_problem
from .tensors import TensorInfo, read_bytes, read_json, read_scalar, read_tensors

_PACKED_DTYPES = ("U8", "I8")
_BLOCK_DTYPES = ("F8_E4M3", "U8")
_SCALAR_DTYPES = ("F32", "BF16", "F16")
_TORCH_NAMES = dict(
    zip(
        "F8_E4M3 F8_E5M2 U8 I8 I32 I64 F16 BF16 F32 F64".split(),
        "float8_e4m3fn float8_e5m2 uint8 int8 int32 int64 float16 bfloat16 float32 float64".split(),
    )
)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
ROLES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class Checkpoint:
    """What :func:`inspect` found: every tensor, every NVFP4 module's (N, K), and experts by prefix, role, index."""

    dir: str
    format: str
    config: dict
    tensors: dict[str, TensorInfo]
    modules: dict[str, tuple[int, int]] = field(default_factory=dict)
    experts: dict[str, dict[str, dict[int, str]]] = field(default_factory=dict)

    def linear(self) -> dict[str, tuple[int, int]]:
        """Return the NVFP4 modules that are not experts: module -> (N, K)."""
        return {m: nk for m, nk in self.modules.items() if _EXPERT.match(m) is None}


def _nvfp4_modules(fmt: str, quant: Quantization, tensors: dict[str, TensorInfo]) -> list[str]:
    """Return every module with an FP4-packed weight or a weight global scale (only NVFP4 layers have one)."""
    packed, _, global_name, _ = NAMES[fmt]
    kinds: dict[str, set[str]] = {}
    for name in tensors:
        module, _, kind = name.rpartition(".")
        kinds.setdefault(module, set()).add(kind)
    layers = quant.config.get("quantized_layers") if isinstance(quant.config.get("quantized_layers"), dict) else {}
    out = []
    for module, have in sorted(kinds.items()):
        algo = layers.get(module, {}).get("quant_algo") if isinstance(layers.get(module), dict) else None
        if algo is not None and "NVFP4" not in str(algo).upper():
            continue  # MIXED_PRECISION: another algorithm's layer
        weight = tensors.get(f"{module}.{packed}")
        if global_name in have or (weight is not None and weight.dtype in _PACKED_DTYPES):
            out.append(module)
    return out


def _check_module(fmt: str, module: str, tensors: dict[str, TensorInfo]) -> tuple[int, int]:
    """Check one NVFP4 module's four tensors are present, of accepted dtypes and shapes; return its (N, K)."""
    packed, block, global_name, input_name = NAMES[fmt]
    where = next(tensors[f"{module}.{k}"].file for k in NAMES[fmt] if f"{module}.{k}" in tensors)
    needs = f"accepted: an NVFP4 layer ({fmt}) with {module}.{packed}, .{block}, .{global_name} and .{input_name}"
    for kind in NAMES[fmt]:
        if f"{module}.{kind}" not in tensors:
            raise CheckpointError(f"{where}: {module}.{kind} is missing; {needs}")

    def bad(info: TensorInfo, kind: str, accepted: str, shape: bool = True) -> CheckpointError:
        what = f"{_TORCH_NAMES.get(info.dtype, info.dtype)}{f' {info.shape}' if shape else ''}"
        return CheckpointError(f"{info.file}: {module}.{kind} is {what}; accepted: {accepted}")

    weight = tensors[f"{module}.{packed}"]
    if weight.dtype not in _PACKED_DTYPES or len(weight.shape) != 2 or 0 in weight.shape:
        raise bad(weight, packed, "uint8 (N, K/2), two FP4 (E2M1) codes a byte")
    n, k = weight.shape[0], weight.shape[1] * 2
    scales = tensors[f"{module}.{block}"]
    if scales.dtype not in _BLOCK_DTYPES:
        raise bad(scales, block, "float8_e4m3fn (or its bytes as uint8) block scales, one per 16 weights", shape=False)
    if k % GROUP_SIZE or scales.shape != (n, k // GROUP_SIZE):
        raise CheckpointError(
            f"{scales.file}: {module}.{block} has shape {scales.shape}; accepted: (N, K/16) = "
            f"({n}, {k / GROUP_SIZE:g}) for {module}.{packed} of shape {weight.shape} (K = {k})"
        )
    for kind, what in ((global_name, "the weight's global scale"), (input_name, "the activation's global scale")):
        info = tensors[f"{module}.{kind}"]
        if info.dtype not in _SCALAR_DTYPES or math.prod(info.shape) != 1:
            raise bad(info, kind, f"{what} as one float32 (shape () or (1,))")
    return n, k


def _experts(checkpoint: Checkpoint, fmt: str) -> None:
    """Group the expert modules by MoE layer; check every expert 0..E-1 carries every projection, all alike."""
    text = text_config(checkpoint.config)  # its sizes checked by _check_config: non-negative ints or absent
    count = next((text[k] for k in _EXPERT_COUNT if text.get(k) is not None), None)
    packed = NAMES[fmt][0]
    for module in checkpoint.modules:
        m = _EXPERT.match(module)
        if m is not None:
            role = ROLES.get(m["proj"], m["proj"])
            checkpoint.experts.setdefault(m["prefix"], {}).setdefault(role, {})[int(m["e"])] = module
    for prefix, roles in checkpoint.experts.items():
        some = next(iter(next(iter(roles.values())).values()))
        where = getattr(checkpoint.tensors.get(f"{some}.{packed}"), "file", checkpoint.dir)
        name = {r: w for w, r in ROLES.items()} if re.search(r"\.w[123]$", some) else {r: r for r in ROLES.values()}
        need = ["gate_proj"] * ("gate_proj" in roles) + ["up_proj", "down_proj"]
        ids = {e for r in roles.values() for e in r}
        total = count if count is not None else max(ids) + 1
        accepted = f"accepted: every expert 0..{total - 1} with {', '.join(name[r] for r in need)}"
        if beyond := sorted(e for e in ids if e >= total):
            raise CheckpointError(
                f"{where}: {prefix}.{beyond[0]} is beyond config.json's expert count {total}; {accepted}"
            )
        for e, role in ((e, role) for e in range(total) for role in need if e not in roles.get(role, {})):
            raise CheckpointError(
                f"{where}: {prefix}.{e}.{name[role]}.{packed} is missing (expert {e} of {total}); {accepted}"
            )
        for role in need:
            if len(shapes := {checkpoint.modules[mod] for mod in roles[role].values()}) > 1:
                raise CheckpointError(
                    f"{where}: the experts of {prefix} have {name[role]} weights of different (N, K): "
                    f"{sorted(shapes)}; accepted: one shape for every expert"
                )
    top_k = next((k for k in ("num_experts_per_tok", "moe_topk") if text.get(k) is not None), None)
    if checkpoint.experts and top_k is not None and not 1 <= text[top_k] <= (count or text[top_k]):
        accepted = f"accepted: 1 to the number of experts ({count or 'config.json names none'})"
        raise CheckpointError(f"{os.path.join(checkpoint.dir, 'config.json')}: {top_k} = {text[top_k]!r}; {accepted}")


_SIZES = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads")
_SIZES += ("num_key_value_heads", "head_dim", "num_experts_per_tok", "moe_topk") + _EXPERT_COUNT


def _check_config(checkpoint: Checkpoint) -> None:
    """Refuse config.json sizes the engines would reject when they build the model (or build wrong)."""
    text, source = text_config(checkpoint.config), os.path.join(checkpoint.dir, "config.json")

    def refuse(key: str, accepted: str) -> CheckpointError:
        return CheckpointError(f"{source}: {key} = {text[key]!r}; accepted: {accepted}")

    for key in _SIZES:
        value = text.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise refuse(key, "a non-negative integer (SGLang and vLLM build the model's layers from it)")
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if heads and kv_heads is not None and (kv_heads == 0 or heads % kv_heads):
        raise refuse("num_key_value_heads", f"a divisor of num_attention_heads ({heads}), at least 1")


def _check_siblings(checkpoint: Checkpoint, fmt: str) -> None:
    """Refuse a layer missing a module the engines fuse with its NVFP4 siblings (q/k/v, gate/up): never served apart."""
    text = text_config(checkpoint.config)
    mla = any(k in text for k in ("kv_lora_rank", "qk_nope_head_dim"))
    linear = checkpoint.linear()
    prefixes = {t.rpartition(".")[0] for t in checkpoint.tensors}
    for module in linear:
        parent, _, leaf = module.rpartition(".")
        group = ("q_proj", "k_proj", "v_proj") if leaf in ("q_proj", "k_proj", "v_proj") and not mla else ()
        group = ("gate_proj", "up_proj") if leaf == "gate_proj" else group  # up_proj alone: a non-gated MLP
        for sibling in (f"{parent}.{p}" for p in group if f"{parent}.{p}" not in linear):
            where = checkpoint.tensors[f"{module}.{NAMES[fmt][0]}"].file
            state = "is not NVFP4" if sibling in prefixes else "is missing"
            kv = text.get("num_key_value_heads") or text.get("num_attention_heads")
            said = f" (config.json says {kv} KV heads)" if kv and "k_proj" in group else ""
            raise CheckpointError(
                f"{where}: {sibling} {state}, while {module} is NVFP4{said}; accepted: every module that SGLang and vLLM fuse with it ({', '.join(group)}) present "
                "and NVFP4"
            )


def _dims_problem(checkpoint: Checkpoint, fmt: str) -> str | None:
    """Return a shape that contradicts config.json (hidden, intermediate, heads * head_dim), or None."""
    text = text_config(checkpoint.config)

    def num(key: str) -> int | None:  # a size _check_config found a non-negative int, or absent; 0 as absent
        return text.get(key) or None

    hidden, heads, kv_heads = num("hidden_size"), num("num_attention_heads"), num("num_key_value_heads")
    head_dim = num("head_dim") or (hidden // heads if hidden and heads else None)
    mla = any(k in text for k in ("kv_lora_rank", "qk_nope_head_dim"))  # MLA: q/k/v sizes are not heads * head_dim
    hid = {hidden} if hidden else set()
    o_sizes = {heads * head_dim} if heads and head_dim else set()
    q_sizes = o_sizes | {2 * heads * head_dim} if o_sizes and text.get("attn_output_gate") else o_sizes
    moe_key = "moe_intermediate_size" if num("moe_intermediate_size") else "intermediate_size"
    for module, (n, k) in checkpoint.modules.items():
        if "vision" in module or "visual" in module or not re.search(r"(^|\.)layers\.\d+\.", module):
            continue  # the text model's decoder layers only
        m = _EXPERT.match(module)
        parent, _, leaf = module.rpartition(".")
        role = ROLES.get(m["proj"], m["proj"]) if m else leaf
        inter = num(moe_key) if m else (num("intermediate_size") if parent.endswith(".mlp") else None)
        key, inter = (moe_key if m else "intermediate_size"), ({inter} if inter else set())
        attn = parent.endswith("self_attn") and not mla and head_dim
        heads_key, kv_key = "num_attention_heads * head_dim", "num_key_value_heads * head_dim"
        checks = (
            (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), k, "hidden_size", hid),
            (("o_proj", "down_proj"), n, "hidden_size", hid),
            (("gate_proj", "up_proj"), n, key, inter),
            (("down_proj",), k, key, inter),
            (("q_proj",), n, heads_key, q_sizes if attn else set()),
            (("k_proj", "v_proj"), n, kv_key, {kv_heads * head_dim} if attn and kv_heads else set()),
            (("o_proj",), k, heads_key, o_sizes if attn else set()),
        )
        for roles, value, what, expected in checks:
            if role in roles and expected and value not in expected:
                info = checkpoint.tensors[f"{module}.{NAMES[fmt][0]}"]
                return (
                    f"{info.file}: {module}.{NAMES[fmt][0]} of shape {info.shape} is a layer of N={n}, K={k}, but "
                    f"config.json's {what} is {' or '.join(map(str, sorted(expected)))}; accepted: tensors whose "
                    "shapes match config.json"
                )
    return None  # the expert count: checked by _experts


def _check_values(checkpoint: Checkpoint, fmt: str) -> None:
    """Check every NVFP4 module's global and activation scales and its alpha, and its block scales' bytes."""
    _, block, global_name, input_name = NAMES[fmt]
    opened: dict = {}
    with contextlib.ExitStack() as files:
        for module in checkpoint.modules:
            found = []
            for kind in (global_name, input_name):
                name = f"{module}.{kind}"
                info = checkpoint.tensors[name]
                found.append(read_scalar(read_bytes(files, opened, name, info), info.dtype))
                if problem := scale_problem(name, found[-1]):
                    raise CheckpointError(f"{info.file}: {problem}")
            if problem := alpha_problem(f"{info.file}: {module}", *found, encode=SCALE_NAMES[fmt][2]):
                raise CheckpointError(problem)
            name = f"{module}.{block}"
            info = checkpoint.tensors[name]
            if problem := block_scale_problem(name, read_bytes(files, opened, name, info), info.shape):
                raise CheckpointError(f"{info.file}: {problem}")


def inspect(model_dir: str, values: bool = True) -> Checkpoint:
    """Validate the NVFP4 checkpoint in `model_dir` (its scales' values too with `values`), or raise CheckpointError."""
    quant = read_quantization(model_dir)
    if (problem := group_size_problem(quant)) is not None:
        raise CheckpointError(problem)
    if quant.format not in NAMES or not quant.nvfp4:
        raise ConfigError(
            f"model_dir={model_dir!r}: quantization {quant.format or 'none'!r} is not NVFP4; "
            f"accepted: ModelOpt NVFP4 or compressed-tensors NVFP4 (W4A4) checkpoints"
        )
    fmt = quant.format
    config = read_json(os.path.join(model_dir, "config.json")) or {}
    checkpoint = Checkpoint(model_dir, fmt, config, read_tensors(model_dir))
    for module in _nvfp4_modules(fmt, quant, checkpoint.tensors):
        checkpoint.modules[module] = _check_module(fmt, module, checkpoint.tensors)
    for module in checkpoint.modules:
        m = _EXPERT.match(module)
        for name in (module, m["prefix"]) if m else (module,):
            if (entry := ignored(quant, name)) is not None:
                carried = checkpoint.tensors[f"{module}.{NAMES[fmt][2]}"]
                raise CheckpointError(
                    f"{quant.source}: the ignore list's entry {entry!r} names {name}, whose tensors "
                    f"in {carried.file} are NVFP4 ({module}.{NAMES[fmt][0]}, ...): SGLang would build it "
                    "unquantized; accepted: an ignore list naming only unquantized layers"
                )
    _check_config(checkpoint)
    _experts(checkpoint, fmt)
    _check_siblings(checkpoint, fmt)
    if (problem := _dims_problem(checkpoint, fmt)) is not None:
        raise CheckpointError(problem)
    if values:
        _check_values(checkpoint, fmt)
    return checkpoint
