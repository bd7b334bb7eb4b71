"""The verdict store: what the preflight (``sm120-fp4 selftest``/``launch``) saw each candidate do.

The preflight runs each GPU's self-test in a short-lived subprocess. A candidate that crashes that
process (an illegal memory access poisons the CUDA context; FlashInfer #3170) is recorded here,
keyed by GPU name, capability, driver, CUDA, FlashInfer version, family (dense or moe) and backend,
and serving workers skip it -- with a reason naming the crash and when it was recorded -- rather
than crash themselves. Passed and failed verdicts are recorded too (evidence; workers still
self-test). The file is ``SM120_FP4_VERDICTS`` (default ``~/.cache/sm120_fp4/verdicts.json``);
writes are atomic and serialised with an advisory lock. A verdict for another driver, CUDA or
FlashInfer version does not apply: upgrading re-tries the candidate.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["device_key", "record", "crash_of", "note_crash", "load", "write_json", "CRASHED", "PASSED", "FAILED"]

_LOG = logging.getLogger("sm120_fp4")
CRASHED, PASSED, FAILED = "crashed", "passed", "failed"
_lock = threading.Lock()
# Crashes this process was told about (the preflight worker's --crashed), used with or without a file.
_session: dict[tuple[str, str], str] = {}


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML, no driver
        return None


def device_key(device) -> dict[str, Any]:
    """What a verdict about `device` is keyed by (besides family and backend)."""
    from .kernels import version as flashinfer_version

    cuda = None
    with contextlib.suppress(Exception):
        import torch

        cuda = torch.version.cuda
    return {
        "gpu": device.name,
        "capability": f"{device.capability[0]}.{device.capability[1]}",
        "simulated": device.simulated,
        "driver": _driver_version() if device.is_cuda else None,
        "cuda": cuda,
        "flashinfer": flashinfer_version(),
    }


def _matches(entry: dict, key: dict, family: str, backend: str) -> bool:
    return entry.get("family") == family and entry.get("backend") == backend and entry.get("key") == key


def load(path: Path | None) -> list[dict]:
    """Every verdict in `path` ([] when there is none, or it cannot be read: a warning)."""
    if path is None:
        return []
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        _LOG.warning("sm120_fp4: could not read the verdict file %s (%s); treating it as empty", path, exc)
        return []
    entries = data.get("verdicts") if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def record(path: Path | None, key: dict, family: str, backend: str, verdict: str, reason: str | None) -> None:
    """Record (replace) the verdict on `backend` of `family` for `key`; atomic, under a file lock."""
    if path is None:
        return
    path = Path(path)
    entry = {"key": key, "family": family, "backend": backend, "verdict": verdict, "reason": reason,
             "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "recorded_by": "sm120-fp4 selftest"}
    with _lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = [e for e in load(path) if not _matches(e, key, family, backend)] + [entry]
            write_json(path, {"version": 1, "verdicts": entries}, ".verdicts-")


def write_json(path: Path, payload: dict, prefix: str) -> None:
    """Write `payload` to `path` atomically: a temp file (`prefix`...) in the same directory, mode
    0644, renamed over `path` -- which replaces a symlink planted there itself, never its target --
    and removed on any failure. The one writer of this library's JSON files (this verdict file and
    the report, selection.write_report); standard library only, like this module."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".json", dir=Path(path).parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def note_crash(family: str, backend: str, reason: str) -> None:
    """Tell this process that `backend` of `family` crashed a preflight worker (no file needed)."""
    with _lock:
        _session[(family, backend)] = reason


def crash_of(path: Path | None, device, family: str, backend: str) -> str | None:
    """Why `backend` must be skipped on `device` (it crashed a preflight process), or None."""
    with _lock:
        told = _session.get((family, backend))
    if told is not None:
        return f"skipped: it crashed the preflight self-test process ({told})"
    entries = load(path)
    if not entries:
        return None
    key = device_key(device)
    for entry in entries:
        if _matches(entry, key, family, backend) and entry.get("verdict") == CRASHED:
            return (f"skipped: it crashed the self-test process of `sm120-fp4 selftest` ({entry.get('reason')}), recorded "
                    f"{entry.get('recorded_at')} in {path} for this GPU, driver, CUDA and FlashInfer; "
                    "delete that entry (or the file) to try it again")
    return None
