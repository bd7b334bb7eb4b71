"""A stand-in for nvidia-ml-py (`pynvml`) describing a machine's GPUs: in this process
(`fake_pynvml(gpus)`, a module for sys.modules) or in a child (`pynvml_site(folder, gpus)`, a
directory to put first on PYTHONPATH). Only what sm120_fp4.devices asks NVML is answered.

A GPU is a dict: name, cc (major, minor), uuid ("GPU-..."), bus ("00000000:01:00.0"), and optionally
mig: a list of (uuid "MIG-...", name) for a GPU with MIG mode enabled. NVML's own index order is
the list order (deliberately not always the PCI order: NVML promises none).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

SOURCE = """
import json

GPUS = json.loads({gpus!r})


class NVMLError(Exception):
    pass


class _Pci:
    def __init__(self, bus):
        self.busId = bus.encode()  # older pynvml returns bytes


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return len(GPUS)


def nvmlDeviceGetHandleByIndex(i):
    return ("gpu", i)


def _gpu(handle):
    return GPUS[handle[1]]


def nvmlDeviceGetName(handle):
    if handle[0] == "mig":
        return _gpu(handle)["mig"][handle[2]][1].encode()
    return _gpu(handle)["name"].encode()


def nvmlDeviceGetCudaComputeCapability(handle):
    return tuple(_gpu(handle)["cc"])


def nvmlDeviceGetUUID(handle):
    if handle[0] == "mig":
        return _gpu(handle)["mig"][handle[2]][0]
    return _gpu(handle)["uuid"]


def nvmlDeviceGetPciInfo(handle):
    return _Pci(_gpu(handle)["bus"])


def nvmlDeviceGetMigMode(handle):
    if "mig" not in _gpu(handle):
        raise NVMLError("Not Supported")
    return (1, 1)


def nvmlDeviceGetMaxMigDeviceCount(handle):
    return 7


def nvmlDeviceGetMigDeviceHandleByIndex(handle, j):
    if j >= len(_gpu(handle)["mig"]):
        raise NVMLError("Not Found")
    return ("mig", handle[1], j)


def nvmlSystemGetDriverVersion():
    return "580.00"
"""

A6000 = {
    "name": "NVIDIA RTX A6000",
    "cc": (8, 6),
    "uuid": "GPU-aaaa1111-0000-0000-0000-000000000001",
    "bus": "00000000:01:00.0",
}
PRO6000 = {
    "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "cc": (12, 0),
    "uuid": "GPU-bbbb2222-0000-0000-0000-000000000002",
    "bus": "00000000:02:00.0",
}


def source(gpus: list[dict]) -> str:
    return SOURCE.format(gpus=json.dumps(gpus))


def fake_pynvml(gpus: list[dict]) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    exec(source(gpus), module.__dict__)
    return module


def pynvml_site(folder: Path, gpus: list[dict]) -> Path:
    """`folder` holding a pynvml.py for `gpus`; put it first on a child's PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pynvml.py").write_text(source(gpus))
    return folder
