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
# safetensors' dtypes and their sizes in bits (safetensors refuses any other name).
_BITS = {
    **dict.fromkeys(("F64", "I64", "U64", "C64"), 64),
    **dict.fromkeys(("F32", "I32", "U32"), 32),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 16),
    **dict.fromkeys(("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"), 8),
    **dict.fromkeys(("F6_E2M3", "F6_E3M2"), 6),
    "F4": 4,
}
_MAX_HEADER = 100_000_000  # safetensors' own bound on a header


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, as its header says: dtype (safetensors' name), shape, byte range."""

    file: str
    dtype: str
    shape: tuple
    start: int  # absolute offset in the file
    nbytes: int


def _open_regular(path: str, error: type[Exception]):
    """Return `path` opened for reading, or None where there is none; `error` where it is not a regular file.

    Checked before it is opened (a FIFO or device named like a checkpoint file is never opened: reading a FIFO
    would block forever), and again on the open file, opened non-blocking, should it be swapped in between. A
    link is followed (Hugging Face's cache links each file to its blob) and judged by what it points to.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise error(f"{path}: not a regular file; accepted: a readable regular file (or a link to one)")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise error(f"{path}: cannot open it ({exc.strerror or exc}); accepted: a readable regular file") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{path}: not a regular file; accepted: a readable regular file (or a link to one)")
    return os.fdopen(fd, "rb")


def _parse(path: str, raw: bytes, error: type[Exception], what: str = "") -> object:
    """Return the JSON in `raw`, or `error` naming `path` (invalid, or nested beyond Python's recursion limit)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise error(f"{path}: {what}invalid JSON ({why}); accepted: a JSON object as transformers writes it") from exc


def read_json(path: str) -> dict | None:
    """Return the JSON object in regular file `path` (at most 16 MiB), or None where there is no such file."""
    if (f := _open_regular(path, ConfigError)) is None:
        return None
    with f:
        try:
            data = f.read(_MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes; not a model config")
    if not isinstance(value := _parse(path, data, ConfigError), dict):
        raise ConfigError(f"{path} holds {type(value).__name__}, expected a JSON object")
    return value


def _header(path: str) -> dict[str, TensorInfo]:
    """Return every tensor of one safetensors file from its header, validated as safetensors itself validates it."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; accepted: a readable, complete safetensors file")

    if (f := _open_regular(path, CheckpointError)) is None:
        raise bad("cannot open it (no such file)")
    with f:
        size = os.fstat(f.fileno()).st_size
        try:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > _MAX_HEADER or 8 + length > size:
                claim = "no 8-byte header length" if length is None else f"a header of {length} bytes"
                raise bad(f"{size} bytes with {claim}: truncated or not safetensors")
            raw = f.read(length)
        except OSError as exc:
            raise bad(f"cannot read it ({exc.strerror or exc})") from exc
    header = _parse(path, raw, CheckpointError, "its safetensors header is ")
    if not isinstance(header, dict):
        raise bad("its safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad(f"its __metadata__ is {str(metadata)[:120]}, not a map of strings to strings")
    out, entries = {}, []
    for name, entry in header.items():
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, span = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        ok = dtype in _BITS and isinstance(shape, list) and isinstance(span, list) and len(span) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *span])
        if not ok:
            raise bad(f"tensor {name!r} has a malformed header entry {str(entry)[:120]}")
        entries.append((span, name, dtype, shape))
    # safetensors: the tensors, in the order of their byte ranges, cover the data exactly, without gap or overlap.
    data, end = size - 8 - length, 0
    for (begin, stop), name, dtype, shape in sorted(entries):
        if begin != end or stop < begin:
            where = f"bytes {begin}-{stop} of the data, but the previous tensor ends at {end}"
            raise bad(f"tensor {name} spans {where} (a gap or an overlap)")
        end = stop
        bits = math.prod(shape) * _BITS[dtype]
        if bits % 8 or stop - begin != bits // 8:
            raise bad(f"tensor {name} ({dtype} {tuple(shape)}) spans {stop - begin} bytes, not {bits / 8:g}")
        if stop > data:
            raise bad(f"tensor {name} needs bytes {begin}-{stop} of the data, the file holds {data}: truncated")
        out[name] = TensorInfo(path, dtype, tuple(shape), 8 + length + begin, stop - begin)
    if end != data:
        raise bad(f"its tensors cover {end} bytes of data, the file holds {data} (trailing bytes)")
    return out


def read_tensors(model_dir: str) -> dict[str, TensorInfo]:
    """Return every tensor the engines load from the checkpoint: the files its index names, else every *.safetensors."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    accepted = "accepted: the safetensors index as transformers writes it"
    try:
        index = read_json(index_path)
    except ConfigError as exc:
        raise CheckpointError(f"{exc}; {accepted}") from exc
    weight_map = index.get("weight_map") if index is not None else {}
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: its weight_map is not a map of tensor names to file names; {accepted}")
    for tensor, file in weight_map.items():
        if os.path.basename(file) != file or file in ("", ".", ".."):
            raise CheckpointError(
                f"{index_path}: names the file of tensor {tensor} as {file!r}, not a file name; accepted: the name "
                f"of a safetensors file in {model_dir}, as transformers writes the index (SGLang and vLLM join it "
                "to the checkpoint directory and load only the files found there)"
            )
    present = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not (names := sorted(set(weight_map.values())) if index is not None else present):
        raise CheckpointError(f"{model_dir}: no *.safetensors files; accepted: a safetensors checkpoint directory")
    found: dict[str, TensorInfo] = {}
    for name in names:
        for tensor, info in _header(os.path.join(model_dir, name)).items():
            if tensor in found:
                raise CheckpointError(
                    f"{info.file}: tensor {tensor} is also in {found[tensor].file}; accepted: each tensor in one file"
                )
            found[tensor] = info
    for tensor, file in weight_map.items():
        info = found.get(tensor)
        if info is None or os.path.basename(info.file) != file:
            held = f"it is in {info.file}" if info is not None else "no file holds it"
            raise CheckpointError(
                f"{index_path}: names tensor {tensor} in {file}, but {held}; accepted: an index that "
                "matches the safetensors files"
            )
    _unlisted(model_dir, index_path, [n for n in present if n not in names], found)
    return found


def _unlisted(model_dir: str, index_path: str, names: list[str], found: dict[str, TensorInfo]) -> None:
    """Refuse a file the index leaves out that holds the model's tensors: the engines would never load them."""
    roots = {t.partition(".")[0] for t in found}  # another layout's copy (Mistral's consolidated.*) is left alone
    for name in names:
        try:
            tensors = _header(os.path.join(model_dir, name))
        except CheckpointError:
            continue  # never read by an engine: its faults are not the served model's
        if missing := sorted(t for t in tensors if t not in found and t.partition(".")[0] in roots):
            raise CheckpointError(
                f"{os.path.join(model_dir, name)}: holds tensor {missing[0]} (and {len(missing) - 1} more) that "
                f"{index_path} does not name: SGLang and vLLM load only the files the index lists, so it would "
                "never be loaded; accepted: an index naming every file of the model (regenerate it)"
            )


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
