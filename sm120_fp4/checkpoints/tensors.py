"""Read a checkpoint's files: JSON configs (bounded), safetensors headers, tensors' bytes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass

from ..errors import CheckpointError, ConfigError

_MAX_CONFIG_BYTES = 16 << 20
_ITEMSIZE = {
    **dict.fromkeys(("F64", "I64", "U64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
}
_MAX_HEADER = 100 << 20  # safetensors' own bound on a header


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, as its header says: dtype (safetensors' name), shape, byte range."""

    file: str
    dtype: str
    shape: tuple
    start: int  # absolute offset in the file
    nbytes: int


def read_json(path: str) -> dict | None:
    """Return the JSON object in file `path` (at most 16 MiB), or None where there is no such file."""
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


def _header(path: str) -> dict[str, TensorInfo]:
    """Return every tensor of one safetensors file from its header, checking each lies inside the file."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; accepted: a readable, complete safetensors file")

    try:
        # Non-blocking: a FIFO named *.safetensors must not hang the check; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise bad(f"cannot open it ({exc.strerror or exc})") from exc
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno())
        if not stat.S_ISREG(size.st_mode):
            raise bad("not a regular file")
        try:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > _MAX_HEADER or 8 + length > size.st_size:
                claim = "no 8-byte header length" if length is None else f"a header of {length} bytes"
                raise bad(f"{size.st_size} bytes with {claim}: truncated or not safetensors")
            raw = f.read(length)
        except OSError as exc:
            raise bad(f"cannot read it ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"its safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise bad("its safetensors header is not a JSON object")
    data, out = size.st_size - 8 - length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, span = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        ok = isinstance(dtype, str) and isinstance(shape, list) and isinstance(span, list) and len(span) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *span])
        if not ok or span[0] > span[1]:
            raise bad(f"tensor {name!r} has a malformed header entry {str(entry)[:120]}")
        if span[1] > data:
            raise bad(f"tensor {name} needs bytes {span[0]}-{span[1]} of the data, the file holds {data}: truncated")
        nbytes = span[1] - span[0]
        want = math.prod(shape) * _ITEMSIZE[dtype] if dtype in _ITEMSIZE else nbytes
        if nbytes != want:
            raise bad(f"tensor {name} ({dtype} {tuple(shape)}) spans {nbytes} bytes, not {want}")
        out[name] = TensorInfo(path, dtype, tuple(shape), 8 + length + span[0], nbytes)
    return out


def read_tensors(model_dir: str) -> dict[str, TensorInfo]:
    """Return every tensor of the checkpoint's *.safetensors files, checked against its index file."""
    if not (names := sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))):
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
        index = read_json(index_path)
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


def read_bytes(files: contextlib.ExitStack, opened: dict, name: str, info: TensorInfo) -> bytes:
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


def read_scalar(data: bytes, dtype: str) -> float:
    """Return one F16, BF16 or F32 value from its bytes."""
    if dtype == "F16":
        return struct.unpack("<e", data)[0]
    return struct.unpack("<f", data if dtype == "F32" else b"\0\0" + data)[0]  # bfloat16: a float32's upper half
