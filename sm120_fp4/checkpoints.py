"""Read an NVFP4 checkpoint directory's quantization format, and validate its NVFP4 tensors.

ModelOpt (``quant_algo: NVFP4`` in ``config.json`` or ``hf_quant_config.json``) and compressed-tensors
(4-bit float weights in groups of 16) are read with the standard library only. :func:`inspect` checks every
NVFP4 layer's tensors, dtypes, shapes and scales before any kernel is called; a fault is a CheckpointError
naming the file, the tensor and what is accepted.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field

from .errors import CheckpointError, ConfigError

__all__ = ["Quantization", "read_quantization", "MODELOPT", "COMPRESSED_TENSORS", "Checkpoint", "inspect", "NAMES"]

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
_MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization format (None for none), whether any layer is NVFP4, and its config."""

    format: str | None
    nvfp4: bool
    config: dict
    source: str = ""  # the file it was read from


def _read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes; not a model config")
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds {type(value).__name__}, expected a JSON object")
    return value


def _fp4_weights(group: object) -> dict | None:
    """Return a compressed-tensors config group's weights section where they are 4-bit floats, else None."""
    weights = group.get("weights") if isinstance(group, dict) else None
    fp4 = isinstance(weights, dict) and weights.get("num_bits") == 4 and weights.get("type") == "float"
    return weights if fp4 else None


def _modelopt_nvfp4(quant: dict) -> bool:
    algo = str(quant.get("quant_algo") or "").upper()
    if algo == "NVFP4":
        return True
    layers = quant.get("quantized_layers")
    if algo == "MIXED_PRECISION" and isinstance(layers, dict):
        return any(isinstance(v, dict) and str(v.get("quant_algo", "")).upper() == "NVFP4" for v in layers.values())
    return False


def text_config(config: dict) -> dict:
    """Return the text model's config: a VLM's ``text_config``, else `config` itself."""
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def read_quantization(model_dir: str) -> Quantization:
    """Return the quantization of the checkpoint in local directory `model_dir`."""
    if not isinstance(model_dir, (str, os.PathLike)) or not os.path.isdir(model_dir):
        raise ConfigError(
            f"model_dir={model_dir!r} is not a directory; expected a local checkpoint directory with config.json"
        )
    source = os.path.join(model_dir, "config.json")
    config = _read_json(source)
    if config is None:
        raise ConfigError(f"model_dir={model_dir!r} has no config.json; expected a Hugging Face checkpoint directory")
    quant = config.get("quantization_config") or text_config(config).get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method") or "").lower()
        if method == MODELOPT or "quant_algo" in quant:
            return Quantization(MODELOPT, _modelopt_nvfp4(quant), quant, source)
        if method == COMPRESSED_TENSORS:
            groups = quant.get("config_groups")
            nvfp4 = isinstance(groups, dict) and any(
                (_fp4_weights(g) or {}).get("group_size") == 16 for g in groups.values()
            )
            return Quantization(COMPRESSED_TENSORS, nvfp4, quant, source)
        return Quantization(method or None, False, quant, source)
    source = os.path.join(model_dir, "hf_quant_config.json")
    legacy = _read_json(source)
    section = legacy.get("quantization") if isinstance(legacy, dict) else None
    if isinstance(section, dict):
        return Quantization(MODELOPT, _modelopt_nvfp4(section), section, source)
    return Quantization(None, False, {})


# Each format's names for an NVFP4 layer's four tensors: packed weight, block scales, the weight's
# global scale, the activation's global scale (ModelOpt: decode scales; compressed-tensors: encode scales).
NAMES = {
    MODELOPT: ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
}
GROUP_SIZE = 16
_PACKED_DTYPES = ("U8", "I8")
_BLOCK_DTYPES = ("F8_E4M3", "U8")
_SCALAR_DTYPES = ("F32", "BF16", "F16")
_TORCH_NAMES = dict(
    zip(
        "F8_E4M3 F8_E5M2 U8 I8 I32 I64 F16 BF16 F32 F64".split(),
        "float8_e4m3fn float8_e5m2 uint8 int8 int32 int64 float16 bfloat16 float32 float64".split(),
    )
)
_ITEMSIZE = {
    **dict.fromkeys(("F64", "I64", "U64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
}
_MAX_HEADER = 100 << 20  # safetensors' own bound on a header
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
ROLES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, as its header says: dtype (safetensors' name), shape, byte range."""

    file: str
    dtype: str
    shape: tuple
    start: int  # absolute offset in the file
    nbytes: int


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


def _header(path: str) -> dict[str, TensorInfo]:
    """Return every tensor of one safetensors file from its header, checking each lies inside the file."""
    accepted = "accepted: a readable, complete safetensors file"
    try:
        # Non-blocking: a FIFO named *.safetensors must not hang the check; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open it ({exc.strerror or exc}); {accepted}") from exc
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno())
        if not stat.S_ISREG(size.st_mode):
            raise CheckpointError(f"{path}: not a regular file; {accepted}")
        try:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > _MAX_HEADER or 8 + length > size.st_size:
                claim = "no 8-byte header length" if length is None else f"a header of {length} bytes"
                raise CheckpointError(
                    f"{path}: {size.st_size} bytes with {claim}: truncated or not safetensors; {accepted}"
                )
            raw = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc}); {accepted}") from exc
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: its safetensors header is not valid JSON ({exc}); {accepted}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its safetensors header is not a JSON object; {accepted}")
    data, out = size.st_size - 8 - length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, span = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not isinstance(span, list)
            or len(span) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *span])
            or span[0] > span[1]
        ):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {str(entry)[:120]}; {accepted}"
            )
        if span[1] > data:
            raise CheckpointError(
                f"{path}: tensor {name} needs bytes {span[0]}-{span[1]} of the data, the file holds "
                f"{data}: truncated; {accepted}"
            )
        if dtype in _ITEMSIZE and span[1] - span[0] != math.prod(shape) * _ITEMSIZE[dtype]:
            raise CheckpointError(
                f"{path}: tensor {name} ({dtype} {tuple(shape)}) spans {span[1] - span[0]} bytes, not "
                f"{math.prod(shape) * _ITEMSIZE[dtype]}; {accepted}"
            )
        out[name] = TensorInfo(path, dtype, tuple(shape), 8 + length + span[0], span[1] - span[0])
    return out


def _tensors(model_dir: str) -> dict[str, TensorInfo]:
    """Return every tensor of the checkpoint's *.safetensors files, checked against its index file."""
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"{model_dir}: no *.safetensors files; accepted: a safetensors checkpoint directory")
    found: dict[str, TensorInfo] = {}
    for name in names:
        for tensor, info in _header(os.path.join(model_dir, name)).items():
            if tensor in found:
                raise CheckpointError(
                    f"{info.file}: tensor {tensor} is also in {found[tensor].file}; accepted: each tensor in one file"
                )
            found[tensor] = info
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    try:
        index = _read_json(index_path)
    except ConfigError as exc:
        raise CheckpointError(f"{exc}; accepted: the safetensors index as transformers writes it") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    for tensor, file in weight_map.items() if isinstance(weight_map, dict) else ():
        info = found.get(tensor)
        if info is None or os.path.basename(info.file) != file:
            held = f"it is in {info.file}" if info is not None else "no file holds it"
            raise CheckpointError(
                f"{index_path}: names tensor {tensor} in {file}, but {held}; accepted: an index that "
                "matches the safetensors files"
            )
    return found


def _group_size_problem(quant: Quantization) -> str | None:
    """Return why the quantization config names a group size other than NVFP4's 16, or None."""
    config = quant.config
    if quant.format == MODELOPT:
        sizes = (
            [("group_size", config.get("group_size"))] if "NVFP4" in str(config.get("quant_algo", "")).upper() else []
        )
        layers = config.get("quantized_layers")
        for layer, info in layers.items() if isinstance(layers, dict) else ():
            if isinstance(info, dict) and "NVFP4" in str(info.get("quant_algo", "")).upper():
                sizes.append((f"quantized_layers.{layer}.group_size", info.get("group_size", GROUP_SIZE)))
    elif quant.format == COMPRESSED_TENSORS:
        groups = config.get("config_groups")
        sizes = [
            (f"config_groups.{g}.weights.group_size", _fp4_weights(group).get("group_size"))
            for g, group in (groups.items() if isinstance(groups, dict) else ())
            if _fp4_weights(group) is not None
        ]
    else:
        return None
    for key, value in sizes:
        if value is not None and value != GROUP_SIZE:
            return (
                f"{quant.source}: {key} = {value!r}; accepted: {GROUP_SIZE} (NVFP4 block scales cover 16 weights, "
                "and SGLang's NVFP4 layers read them so)"
            )
    return None


def _ignored(quant: Quantization, module: str) -> str | None:
    """Return the ignore list's entry that makes SGLang build `module` unquantized, or None."""
    config = quant.config
    entries = config.get("ignore", config.get("exclude_modules")) if quant.format == MODELOPT else config.get("ignore")
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, str):
            continue
        if quant.format == COMPRESSED_TENSORS:  # compressed_tensors.utils.check_equal_or_regex_match
            hit = (
                re.match(entry[3:], module) is not None
                if entry.startswith("re:")
                else module == entry or module.endswith("." + entry)
            )
        else:  # ModelOpt: is_layer_excluded (a glob over the whole name or any of its parts)
            try:
                pattern = re.compile(entry.replace(".", r"\.").replace("*", ".*"))
            except re.error:
                continue  # SGLang cannot compile it either
            names = [module, module.removeprefix("language_model.")]
            hit = any(pattern.fullmatch(n) for n in names) or any(pattern.fullmatch(p) for p in module.split("."))
        if hit:
            return entry
    return None


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
    weight = tensors[f"{module}.{packed}"]
    if weight.dtype not in _PACKED_DTYPES or len(weight.shape) != 2 or 0 in weight.shape:
        raise CheckpointError(
            f"{weight.file}: {module}.{packed} is {_TORCH_NAMES.get(weight.dtype, weight.dtype)} {weight.shape}; accepted: "
            "uint8 (N, K/2), two FP4 (E2M1) codes a byte"
        )
    n, k = weight.shape[0], weight.shape[1] * 2
    scales = tensors[f"{module}.{block}"]
    if scales.dtype not in _BLOCK_DTYPES:
        raise CheckpointError(
            f"{scales.file}: {module}.{block} is {_TORCH_NAMES.get(scales.dtype, scales.dtype)}; accepted: float8_e4m3fn "
            "(or its bytes as uint8) block scales, one per 16 weights"
        )
    if k % GROUP_SIZE or scales.shape != (n, k // GROUP_SIZE):
        raise CheckpointError(
            f"{scales.file}: {module}.{block} has shape {scales.shape}; accepted: (N, K/16) = "
            f"({n}, {k / GROUP_SIZE:g}) for {module}.{packed} of shape {weight.shape} (K = {k})"
        )
    for kind, what in ((global_name, "the weight's global scale"), (input_name, "the activation's global scale")):
        info = tensors[f"{module}.{kind}"]
        if info.dtype not in _SCALAR_DTYPES or math.prod(info.shape) != 1:
            raise CheckpointError(
                f"{info.file}: {module}.{kind} is {_TORCH_NAMES.get(info.dtype, info.dtype)} {info.shape}; accepted: "
                f"{what} as one float32 (shape () or (1,))"
            )
    return n, k


def _experts(checkpoint: Checkpoint, fmt: str) -> None:
    """Group the expert modules by MoE layer; check every expert 0..E-1 carries every projection, all alike."""
    text = text_config(checkpoint.config)
    count = next(
        (text[k] for k in _EXPERT_COUNT if isinstance(text.get(k), int) and not isinstance(text.get(k), bool)), None
    )
    packed = NAMES[fmt][0]
    for module in checkpoint.modules:
        m = _EXPERT.match(module)
        if m is not None:
            role = ROLES.get(m["proj"], m["proj"])
            checkpoint.experts.setdefault(m["prefix"], {}).setdefault(role, {})[int(m["e"])] = module
    for prefix, roles in checkpoint.experts.items():
        some = next(iter(next(iter(roles.values())).values()))
        info = checkpoint.tensors.get(f"{some}.{packed}")
        where = info.file if info is not None else checkpoint.dir
        w_style = re.search(r"\.w[123]$", some)
        name = {r: w for w, r in ROLES.items()} if w_style else {r: r for r in ROLES.values()}
        need = ["gate_proj"] * ("gate_proj" in roles) + ["up_proj", "down_proj"]
        ids = {e for r in roles.values() for e in r}
        total = count if count is not None else max(ids) + 1
        accepted = f"accepted: every expert 0..{total - 1} with {', '.join(name[r] for r in need)}"
        beyond = sorted(e for e in ids if e >= total)
        if beyond:
            raise CheckpointError(
                f"{where}: {prefix}.{beyond[0]} is beyond config.json's expert count {total}; {accepted}"
            )
        for e in range(total):
            for role in need:
                if e not in roles.get(role, {}):
                    raise CheckpointError(
                        f"{where}: {prefix}.{e}.{name[role]}.{packed} is missing (expert {e} of {total}); {accepted}"
                    )
        for role in need:
            shapes = {checkpoint.modules[mod] for mod in roles[role].values()}
            if len(shapes) > 1:
                raise CheckpointError(
                    f"{where}: the experts of {prefix} have {name[role]} weights of different (N, K): "
                    f"{sorted(shapes)}; accepted: one shape for every expert"
                )


def _dims_problem(checkpoint: Checkpoint, fmt: str) -> str | None:
    """Return a shape that contradicts config.json (hidden, intermediate, heads * head_dim), or None."""
    text = text_config(checkpoint.config)

    def num(key: str) -> int | None:
        value = text.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

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


def _read(files: contextlib.ExitStack, opened: dict, name: str, info: TensorInfo) -> bytes:
    """Return tensor `name`'s bytes, keeping one open file per safetensors file."""
    try:
        if info.file not in opened:
            opened[info.file] = files.enter_context(open(info.file, "rb"))
        opened[info.file].seek(info.start)
        data = opened[info.file].read(info.nbytes)
    except OSError as exc:
        raise CheckpointError(
            f"{info.file}: cannot read tensor {name} ({exc.strerror or exc}); accepted: a readable safetensors file"
        ) from exc
    if len(data) != info.nbytes:
        raise CheckpointError(
            f"{info.file}: tensor {name} is cut short ({len(data)} of {info.nbytes} bytes); "
            "accepted: a complete safetensors file"
        )
    return data


def _scalar(data: bytes, dtype: str) -> float:
    if dtype == "F16":
        return struct.unpack("<e", data)[0]
    return struct.unpack("<f", data if dtype == "F32" else b"\0\0" + data)[0]  # bfloat16: a float32's upper half


def scale_problem(name: str, value: float) -> str | None:
    """Return why a global or activation scale is unusable (NaN, infinite, zero, negative), or None."""
    if math.isfinite(value) and value > 0:
        return None
    return (
        f"{name} = {value!r}; accepted: a finite positive scale (the checkpoint's scale is wrong, not a kernel: "
        "requantize or recalibrate the layer)"
    )


def _check_values(checkpoint: Checkpoint, fmt: str) -> None:
    """Check every NVFP4 module's global and activation scales are finite and positive, and no block scale NaN."""
    _, block, global_name, input_name = NAMES[fmt]
    opened: dict = {}
    with contextlib.ExitStack() as files:
        for module in checkpoint.modules:
            for kind in (global_name, input_name):
                name = f"{module}.{kind}"
                info = checkpoint.tensors[name]
                problem = scale_problem(name, _scalar(_read(files, opened, name, info), info.dtype))
                if problem is not None:
                    raise CheckpointError(f"{info.file}: {problem}")
            name = f"{module}.{block}"
            info = checkpoint.tensors[name]
            data = _read(files, opened, name, info)
            at = min((i for i in (data.find(b"\x7f"), data.find(b"\xff")) if i >= 0), default=-1)
            if at >= 0:
                cols = info.shape[1]
                raise CheckpointError(
                    f"{info.file}: {name} holds a NaN block scale (E4M3 byte 0x{data[at]:02x} at row "
                    f"{at // cols}, block {at % cols}); accepted: float8_e4m3fn block scales that are "
                    "not NaN (any byte but 0x7f and 0xff): the checkpoint is corrupt, not a kernel"
                )


def inspect(model_dir: str, values: bool = True) -> Checkpoint:
    """Validate the NVFP4 checkpoint in `model_dir` (its scales' values too with `values`), or raise CheckpointError."""
    quant = read_quantization(model_dir)
    problem = _group_size_problem(quant)
    if problem is not None:
        raise CheckpointError(problem)
    if quant.format not in NAMES or not quant.nvfp4:
        raise ConfigError(
            f"model_dir={model_dir!r}: quantization {quant.format or 'none'!r} is not NVFP4; "
            f"accepted: ModelOpt NVFP4 or compressed-tensors NVFP4 (W4A4) checkpoints"
        )
    fmt = quant.format
    config = _read_json(os.path.join(model_dir, "config.json")) or {}
    checkpoint = Checkpoint(model_dir, fmt, config, _tensors(model_dir))
    for module in _nvfp4_modules(fmt, quant, checkpoint.tensors):
        checkpoint.modules[module] = _check_module(fmt, module, checkpoint.tensors)
    for module in checkpoint.modules:
        m = _EXPERT.match(module)
        for name in (module, m["prefix"]) if m else (module,):
            entry = _ignored(quant, name)
            if entry is not None:
                carried = checkpoint.tensors[f"{module}.{NAMES[fmt][2]}"]
                raise CheckpointError(
                    f"{quant.source}: the ignore list's entry {entry!r} names {name}, whose tensors "
                    f"in {carried.file} are NVFP4 ({module}.{NAMES[fmt][0]}, ...): SGLang would build it "
                    "unquantized; accepted: an ignore list naming only unquantized layers"
                )
    _experts(checkpoint, fmt)
    problem = _dims_problem(checkpoint, fmt)
    if problem is not None:
        raise CheckpointError(problem)
    if values:
        _check_values(checkpoint, fmt)
    return checkpoint
