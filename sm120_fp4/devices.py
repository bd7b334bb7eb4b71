"""Which GPUs exist and their compute capability: the one seam tests mock.

Asks NVML first (nvidia-ml-py, a FlashInfer dependency: ~20 ms, creates no CUDA context) when
NVML's numbering is known to match CUDA's; otherwise asks torch (which initialises CUDA: only
do that in a worker). ``simulate`` (``SM120_FP4_SIMULATE``) overrides every capability and
supplies one CPU device when no GPU exists. ``use_probe()`` replaces the probe in tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

__all__ = ["Device", "list_devices", "get_device", "use_probe", "clear_cache", "is_sm12x", "SM12X"]

_LOG = logging.getLogger(__name__)
SM12X = ((12, 0), (12, 1))
CPU_INDEX = -1


@dataclass(frozen=True)
class Device:
    """One device as the library sees it: CUDA ordinal (-1 for the simulated CPU), name, capability."""

    index: int
    name: str
    capability: tuple[int, int]
    simulated: bool = False
    source: str = "nvml"

    @property
    def sm(self) -> int:
        return self.capability[0] * 10 + self.capability[1]

    @property
    def is_cuda(self) -> bool:
        return self.index >= 0

    @property
    def torch_device(self):
        import torch

        return torch.device("cuda", self.index) if self.is_cuda else torch.device("cpu")

    @property
    def key(self) -> tuple[int, tuple[int, int], bool]:
        return (self.index, self.capability, self.simulated)

    def label(self) -> str:
        where = f"cuda:{self.index}" if self.is_cuda else "cpu"
        sim = ", simulated" if self.simulated else ""
        return f"{where} {self.name!r} (sm_{self.sm}{sim})"


def is_sm12x(capability: tuple[int, int]) -> bool:
    return capability[0] == 12


Probe = Callable[[], list[Device]]
_lock = threading.Lock()
_probe_override: Probe | None = None
_cache: dict[str | None, list[Device]] = {}


def _nvml_order_matches_cuda() -> bool:
    # NVML numbers GPUs by PCI bus; CUDA does too only with CUDA_DEVICE_ORDER=PCI_BUS_ID, and
    # CUDA_VISIBLE_DEVICES renumbers them. Use NVML only where the mapping is certain.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not all(p.strip().isdigit() for p in visible.split(",") if p.strip()):
        return False
    return os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" or visible is None


def _probe_nvml() -> list[Device] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVMLError_LibraryNotFound and friends
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        found = []
        for handle in handles:
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            found.append((name, tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))))
    except Exception as exc:
        _LOG.debug("NVML probe failed: %s", exc)
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        order = [int(p) for p in visible.split(",") if p.strip()]
        # CUDA stops at the first invalid ordinal in CUDA_VISIBLE_DEVICES.
        picked = []
        for ordinal in order:
            if not 0 <= ordinal < len(found):
                break
            picked.append(found[ordinal])
        found = picked
    return [Device(i, name, (int(cc[0]), int(cc[1])), source="nvml") for i, (name, cc) in enumerate(found)]


def _probe_torch() -> list[Device]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [
            Device(i, torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)), source="torch")
            for i in range(torch.cuda.device_count())
        ]
    except Exception as exc:  # a broken CUDA install must not break the host process
        _LOG.warning("sm120_fp4: could not list CUDA devices through torch: %s", exc)
        return []


def _probe() -> list[Device]:
    if _nvml_order_matches_cuda():
        found = _probe_nvml()
        if found is not None:
            return found
    return _probe_torch()


def list_devices(simulate: tuple[int, int] | None = None, *, refresh: bool = False) -> list[Device]:
    """The devices of this process, with `simulate` overriding every capability (cached per process)."""
    key = None if simulate is None else f"{simulate[0]}.{simulate[1]}"
    with _lock:
        if not refresh and key in _cache:
            return list(_cache[key])
        probe = _probe_override or _probe
    real = probe()
    if simulate is None:
        result = real
    elif real:
        result = [Device(d.index, d.name, simulate, simulated=True, source=d.source) for d in real]
    else:
        result = [Device(CPU_INDEX, "simulated (no GPU)", simulate, simulated=True, source="simulate")]
    with _lock:
        _cache[key] = result
    return list(result)


def get_device(index: int | None, simulate: tuple[int, int] | None = None) -> Device:
    """The Device for a CUDA ordinal (or the CPU stand-in, index -1/None, in simulation)."""
    devices = list_devices(simulate)
    if index == CPU_INDEX and simulate is not None and not any(d.index == CPU_INDEX for d in devices):
        # In simulation, CPU tensors stand for the simulated GPU even where real GPUs exist.
        return Device(CPU_INDEX, "simulated (CPU tensors)", simulate, simulated=True, source="simulate")
    if index is None:
        if not devices:
            raise LookupError("no CUDA device is visible (set SM120_FP4_SIMULATE=12.0 to simulate one)")
        return devices[0]
    for device in devices:
        if device.index == index:
            return device
    raise LookupError(f"no device with index {index}; visible: {[d.label() for d in devices] or 'none'}")


def clear_cache() -> None:
    with _lock:
        _cache.clear()


@contextlib.contextmanager
def use_probe(probe: Probe) -> Iterator[None]:
    """Replace how devices are discovered (tests: mocked capabilities), restoring it on exit."""
    global _probe_override
    with _lock:
        previous, _probe_override = _probe_override, probe
        _cache.clear()
    try:
        yield
    finally:
        with _lock:
            _probe_override = previous
            _cache.clear()
