"""The verdict store: what the preflight (``sm120-fp4 selftest``/``launch``) saw each candidate do.

A candidate that crashed a preflight worker (FlashInfer #3170) is recorded, keyed by GPU, capability, driver, CUDA,
FlashInfer and its kernel packages, family and backend, and serving workers skip it rather than crash; passed and
failed verdicts are evidence only. The file is ``SM120_FP4_VERDICTS``, owner-only (:mod:`.files`)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from . import devices, files, locks
from .errors import say_once
from .versions import kernel_versions

CRASHED, PASSED, FAILED = "crashed", "passed", "failed"
_lock = locks.lock()


def device_key(device) -> dict[str, Any]:
    """Return what a verdict about `device` is keyed by (besides family and backend)."""
    import torch

    from .backends.flashinfer import version as flashinfer_version

    key = {"gpu": device.name, "capability": f"{device.capability[0]}.{device.capability[1]}"}
    driver = devices.nvml(lambda nvml: devices.as_text(nvml.nvmlSystemGetDriverVersion())) if device.is_cuda else None
    key |= {"simulated": device.simulated, "driver": driver, "cuda": torch.version.cuda}
    # FlashInfer's prebuilt kernels and the CuTe DSL decide which kernel runs as much as flashinfer-python does.
    return key | {"flashinfer": flashinfer_version(), "kernels": kernel_versions()}


def _matches(entry: dict, key: dict, family: str, backend: str) -> bool:
    return entry.get("family") == family and entry.get("backend") == backend and entry.get("key") == key


def load(path: Path | None) -> list[dict]:
    """Return every verdict in `path` ([] when none, or untrusted or unreadable: warned once per reason)."""
    if path is None:
        return []
    try:
        data = files.read_json(Path(path), "verdict file")
    except (OSError, ValueError) as exc:
        say_once(logging.WARNING, f"sm120_fp4: not reading the verdict file {path} ({exc}); treating it as empty")
        return []
    return _entries(data)


def _entries(data: object) -> list[dict]:
    """Return the verdicts of a verdict file's JSON (what is not one is left out)."""
    entries = data.get("verdicts") if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def trouble(path: Path | None) -> str | None:
    """Return why the verdict store at `path` is neither read nor written, or None."""
    if path is None:
        return None
    try:
        files.read_json(Path(path), "verdict file")
        lock = Path(path).with_name(Path(path).name + ".lock")
        if os.path.lexists(lock):
            with files.locked(lock, "verdict lock file"):
                pass
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def record(path: Path, key: dict, family: str, backend: str, verdict: str, reason: str | None) -> None:
    """Record (replace) the verdict on `backend` of `family` for `key`, atomically under a file lock."""
    # `path`: the settings' verdicts_path, which the callers check is not None (off) first.
    entry = {"key": key, "family": family, "backend": backend, "verdict": verdict, "reason": reason}
    entry |= {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "recorded_by": "sm120-fp4 selftest"}
    with _lock:
        files.make_private_dirs(path.parent)
        # Bounded (files.LockTimeout, an OSError the caller reports): the preflight never hangs on a lock.
        with files.locked(path.with_name(path.name + ".lock"), "verdict lock file", timeout_s=10.0):
            try:
                data = files.read_json(path, "verdict file")
            except ValueError:
                data = None  # not JSON: replaced by a valid file (it held nothing we can use)
            entries = [e for e in _entries(data) if not _matches(e, key, family, backend)] + [entry]
            files.write_json(path, {"version": 1, "verdicts": entries}, "verdict file")


def crashed(path: Path | None, device, family: str) -> dict[str, str]:
    """Return each backend of `family` that the store at `path` says crashed a preflight process on `device`, and why
    (what this process was told besides: ``serving.crashed``)."""
    found: dict[str, str] = {}
    key = device_key(device) if path is not None else None
    for entry in load(path):
        backend = entry.get("backend")
        if _matches(entry, key, family, backend) and entry.get("verdict") == CRASHED and backend not in found:
            found[backend] = (
                f"skipped: it crashed the self-test process of `sm120-fp4 selftest` ({entry.get('reason')}), recorded "
                f"{entry.get('recorded_at')} in {path} for this GPU, driver, CUDA and FlashInfer (its kernel packages too); "
                "delete that entry (or the file) to try it again"
            )
    return found
