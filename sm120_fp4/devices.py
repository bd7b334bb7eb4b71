"""Which GPUs exist, their compute capability, and which physical GPU each CUDA ordinal is: the one seam tests mock
(``use_probe``).

The mapping is CUDA's own (through torch) where CUDA is initialised or about to be (``init_cuda``); else computed
from NVML where it is determined (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or GPUs all alike); else
:class:`~sm120_fp4.errors.DeviceMappingError` names the problem and the fix. Nothing is guessed: CUDA's default
FASTEST_FIRST heuristic is not documented well enough to reproduce from NVML. ``simulate`` (``SM120_FP4_SIMULATE``)
overrides every capability and supplies one CPU device when no GPU exists."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from . import locks
from .errors import DeviceMappingError

_LOG = logging.getLogger(__name__)
CPU_INDEX = -1
# The extra GPU memory one check (a layer check at load, a canary run while serving) takes at most per GPU,
# beyond the served call's own input and output: the oracle and the comparisons work in slices of rows,
# experts or columns below it, and a converting backend keeps a layer's original bytes on the GPU only below it.
CHECK_MEMORY_BYTES = 1 << 30
PCI_ORDER_FIX = (
    "set CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA then numbers GPUs by PCI bus id, as `nvidia-smi` lists them), "
    "or name the GPUs by UUID in CUDA_VISIBLE_DEVICES (`nvidia-smi -L`)"
)


@dataclass(frozen=True)
class Device:
    """One device: CUDA ordinal (-1: the simulated CPU), name, capability, and its UUID and PCI bus id where known."""

    index: int
    name: str
    capability: tuple[int, int]
    simulated: bool = False
    source: str = "nvml"
    uuid: str | None = None  # lower-case hex, no GPU-/MIG- prefix
    pci_bus_id: str | None = None

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

    def label(self) -> str:
        where = f"cuda:{self.index}" if self.is_cuda else "cpu"
        sim = ", simulated" if self.simulated else ""
        return f"{where} {self.name!r} (sm_{self.sm}{sim})"


def is_sm12x(capability: tuple[int, int]) -> bool:
    return capability[0] == 12


def as_text(value) -> str:
    """Return an NVML string (bytes in older bindings) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _uuid(value: object) -> str | None:
    """Normalise a UUID as NVML, CUDA_VISIBLE_DEVICES or torch write it."""
    if value is None:
        return None
    text = as_text(value).strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text or None


def same_uuid(a: object, b: object) -> bool:
    """Return whether two spellings of a GPU UUID name the same device (None never matches)."""
    a, b = _uuid(a), _uuid(b)
    return a is not None and a == b


Probe = Callable[[], list[Device]]
_lock = locks.lock()
_probe_override: Probe | None = None
_cache: dict[tuple, list[Device]] = {}


@dataclass(frozen=True)
class _Gpu:
    """What NVML says about one physical GPU (or one MIG device of one)."""

    name: str
    capability: tuple[int, int]
    uuid: str | None
    pci: tuple[int, int, int, int] | None
    mig: bool = False  # MIG mode enabled: CUDA shows its MIG devices, not the GPU
    migs: tuple["_Gpu", ...] = ()
    parent: str | None = None  # a MIG device: its GPU's UUID

    @property
    def bus_id(self) -> str | None:
        return None if self.pci is None else "{:04x}:{:02x}:{:02x}.{:x}".format(*self.pci)

    def shown(self) -> str:
        mig = ", MIG enabled" if self.mig else ""
        return f"{self.bus_id or '?'} {self.name!r} (sm_{self.capability[0]}{self.capability[1]}{mig})"


_BUS = re.compile(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)", re.ASCII)


def _pci(info) -> tuple[int, int, int, int] | None:
    bus = getattr(info, "busId", None)
    match = _BUS.fullmatch(as_text(bus).strip()) if bus is not None else None
    return tuple(int(g, 16) for g in match.groups()) if match else None  # type: ignore[return-value]


def _nvml_gpu(pynvml, handle) -> _Gpu:
    """Read one GPU and its MIG devices from NVML."""
    cc = tuple(int(c) for c in pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    uuid = pci = None
    with contextlib.suppress(Exception):  # missing: the mapping that needs it is not determined
        uuid = _uuid(pynvml.nvmlDeviceGetUUID(handle))
    with contextlib.suppress(Exception):
        pci = _pci(pynvml.nvmlDeviceGetPciInfo(handle))
    mig, migs = False, []
    with contextlib.suppress(Exception):  # NotSupported: no MIG on this GPU
        mig = int(pynvml.nvmlDeviceGetMigMode(handle)[0]) == 1
    for j in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)) if mig else 0):
        try:
            sub = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except Exception:  # NotFound: an empty slot
            continue
        name, sub_uuid = as_text(pynvml.nvmlDeviceGetName(sub)), _uuid(pynvml.nvmlDeviceGetUUID(sub))
        migs.append(_Gpu(name, cc, sub_uuid, pci, parent=uuid))
    return _Gpu(as_text(pynvml.nvmlDeviceGetName(handle)), cc, uuid, pci, mig, tuple(migs))


def nvml(read: Callable[[Any], Any]) -> Any:
    """Return `read(pynvml)` between NVML's init and shutdown (None without NVML or a driver, or where it fails)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no bindings (ImportError), or no driver: NVMLError_LibraryNotFound and friends
        return None
    try:
        return read(pynvml)
    except Exception as exc:
        _LOG.debug("NVML probe failed: %s", exc)
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_gpus() -> list[_Gpu] | None:
    """Return every GPU NVML sees (None without NVML or a driver)."""
    return nvml(lambda p: [_nvml_gpu(p, p.nvmlDeviceGetHandleByIndex(i)) for i in range(p.nvmlDeviceGetCount())])


def _alike(gpus: list[_Gpu]) -> bool:
    return len({(g.name, g.capability, g.mig) for g in gpus}) <= 1 and not any(g.mig for g in gpus)


def _unknown(why: str, gpus: list[_Gpu]) -> DeviceMappingError:
    listed = "; ".join(g.shown() for g in gpus) or "none"
    return DeviceMappingError(
        f"sm120_fp4: cannot tell which GPU CUDA numbers as each cuda:N here without initialising CUDA: {why} "
        f"(NVML lists: {listed}). Not guessing (a wrong guess verifies one GPU and serves another): {PCI_ORDER_FIX}.",
        [
            Device(CPU_INDEX, g.name, g.capability, source="nvml (unnumbered)", uuid=g.uuid, pci_bus_id=g.bus_id)
            for g in gpus
        ],
    )


def _match(entry: str, pool: list[_Gpu], what: str, gpus: list[_Gpu]) -> _Gpu | None:
    """Return the one device whose UUID starts with `entry` (CUDA accepts unique prefixes); None: invalid."""
    prefix = _uuid(entry) or ""
    hits = [g for g in pool if g.uuid is not None and prefix and g.uuid.startswith(prefix)]
    if len(hits) > 1:
        raise _unknown(f"CUDA_VISIBLE_DEVICES entry {entry!r} is a prefix of {len(hits)} {what} UUIDs", gpus)
    if not hits and any(g.uuid is None for g in pool):
        raise _unknown(
            f"NVML gives no UUID for some GPU, so CUDA_VISIBLE_DEVICES entry {entry!r} cannot be matched", gpus
        )
    return hits[0] if hits else None


def _pick(entry: str, base: Callable[[], list[_Gpu]], gpus: list[_Gpu]) -> _Gpu | None:
    """Return the device one CUDA_VISIBLE_DEVICES entry names (None: invalid, where CUDA stops)."""
    migs = [m for g in gpus for m in g.migs]
    if entry.isdigit() and entry.isascii():
        every = base()
        return every[int(entry)] if int(entry) < len(every) else None
    if entry[:4].upper() == "MIG-":
        if "/" in entry:  # MIG-GPU-<uuid>/<gi>/<ci>: the pre-R470 form
            raise _unknown(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} uses the older MIG-GPU-<uuid>/<gi>/<ci> form; "
                "name the MIG device by its MIG-<uuid> (`nvidia-smi -L`)",
                gpus,
            )
        return _match(entry, migs, "MIG device", gpus)
    if entry[:4].upper() == "GPU-":
        return _match(entry, gpus, "GPU", gpus)
    bare = _uuid(entry)
    if bare and any(g.uuid and g.uuid.startswith(bare) for g in gpus + migs):
        raise _unknown(
            f"CUDA_VISIBLE_DEVICES entry {entry!r} is a UUID without its GPU-/MIG- prefix, which "
            "CUDA does not document; write it as `nvidia-smi -L` does",
            gpus,
        )
    return None


def _cuda_order(gpus: list[_Gpu], environ) -> list[Device]:
    """Return the Devices CUDA will number, computed from NVML facts and the environment, or DeviceMappingError."""
    order = environ.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST"
    by_pci = order == "PCI_BUS_ID"
    if any(g.pci is None for g in gpus) and not _alike(gpus):
        raise _unknown("NVML gives no PCI bus id for some GPU", gpus)
    ordered = list(gpus) if any(g.pci is None for g in gpus) else sorted(gpus, key=lambda g: g.pci)
    fastest = f"CUDA_DEVICE_ORDER={order} (CUDA's default FASTEST_FIRST: its own undocumented heuristic)"

    def base() -> list[_Gpu]:
        if by_pci or _alike(gpus):
            return ordered
        raise _unknown(f"GPUs of different models with {fastest}", gpus)

    visible = environ.get("CUDA_VISIBLE_DEVICES")
    chosen = base() if visible is None else []
    for entry in [] if visible is None else (e.strip() for e in visible.split(",")):
        pick = _pick(entry, base, gpus)
        if pick is None:
            break
        if any(pick is c for c in chosen):
            raise _unknown(f"CUDA_VISIBLE_DEVICES={visible!r} names one GPU twice", gpus)
        chosen.append(pick)
    if any(g.mig for g in chosen):
        raise _unknown(
            "a chosen GPU has MIG enabled (CUDA then shows one of its MIG devices, not the GPU); "
            "name the MIG device by its MIG-<uuid> in CUDA_VISIBLE_DEVICES",
            gpus,
        )
    if any(g.parent is not None for g in chosen) and len(chosen) > 1:
        raise _unknown(
            "CUDA_VISIBLE_DEVICES names a MIG device together with other devices (CUDA enumerates a single "
            "MIG device per process in the releases documented)",
            gpus,
        )
    if not by_pci and not _alike(chosen):
        raise _unknown(f"the chosen GPUs differ, with {fastest}", gpus)
    exact = by_pci or len(chosen) <= 1  # alike GPUs in an unknown order: no UUID is claimed per ordinal
    return [
        Device(i, g.name, g.capability, uuid=g.uuid if exact else None, pci_bus_id=g.bus_id if exact else None)
        for i, g in enumerate(chosen)
    ]


def _cuda_ready() -> bool:
    torch = sys.modules.get("torch")  # never imported just to ask
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _probe_torch() -> list[Device]:
    """Return CUDA's own numbering, through torch (initialises CUDA in this process)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        found = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            pci = None
            if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
                pci = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            uuid = _uuid(getattr(props, "uuid", None))
            cc = (int(props.major), int(props.minor))
            found.append(Device(i, props.name, cc, source="torch", uuid=uuid, pci_bus_id=pci))
        return found
    except Exception as exc:  # a broken CUDA install must not break the host process
        _LOG.warning("sm120_fp4: could not list CUDA devices through torch: %s", exc)
        return []


def _probe(init_cuda: bool = False) -> list[Device]:
    # `init_cuda` without a usable CUDA: torch finds nothing, NVML is asked.
    if _cuda_ready() or init_cuda:
        found = _probe_torch()
        if found or _cuda_ready():
            return found
    gpus = _nvml_gpus()
    if gpus is None:
        return _probe_torch()
    return _cuda_order(gpus, os.environ)


def _simulated_cpu(simulate: tuple[int, int]) -> Device:
    """Return the CPU device that stands for a simulated GPU."""
    return Device(CPU_INDEX, "simulated (CPU)", simulate, simulated=True, source="simulate")


def list_devices(
    simulate: tuple[int, int] | None = None, *, refresh: bool = False, init_cuda: bool = False
) -> list[Device]:
    """Return this process's devices in CUDA's numbering, `simulate` overriding every capability (cached)."""
    # Probed again once CUDA is initialised: then CUDA's own answer counts. `init_cuda`: this process
    # is about to use CUDA anyway, so CUDA may be asked instead of computing its numbering from NVML.
    key = (None if simulate is None else f"{simulate[0]}.{simulate[1]}", _cuda_ready() or init_cuda)
    with _lock:
        if not refresh and key in _cache:
            return list(_cache[key])
        probe = _probe_override or (lambda: _probe(init_cuda))
    real = probe()
    if simulate is None:
        result = real
    elif real:
        result = [replace(d, capability=simulate, simulated=True) for d in real]
    else:
        result = [_simulated_cpu(simulate)]
    with _lock:
        _cache[key] = result
    return list(result)


def get_device(index: int | None, simulate: tuple[int, int] | None = None, *, init_cuda: bool = False) -> Device:
    """Return the Device for a CUDA ordinal (or the CPU stand-in, index -1/None, in simulation)."""
    if index == CPU_INDEX and simulate is not None:
        # In simulation, CPU tensors stand for the simulated GPU, also where real GPUs exist (they need no numbering).
        return _simulated_cpu(simulate)
    devices = list_devices(simulate, init_cuda=init_cuda)
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


def parallel_rank(module: str, groups: dict[str, str]) -> dict[str, int]:
    """Return this process's ranks from an engine's parallel-state `module` (already imported), or {} (none yet).

    `groups`: a prefix ("tp", "pp", "ep") -> the module's function returning that group (``rank_in_group``,
    ``world_size``); a group not created in this process is left out.
    """
    state = sys.modules.get(module)
    ranks: dict[str, int] = {}
    for prefix, getter in groups.items():
        try:
            group = getattr(state, getter)()
            ranks |= {f"{prefix}_rank": int(group.rank_in_group), f"{prefix}_size": int(group.world_size)}
        except Exception:  # not imported, not initialised, or not this release: no such rank
            continue
    return ranks


def rank_text(rank: dict[str, int], every: bool = False) -> str:
    """Return ``"TP rank 1/2"`` (and PP, EP ranks where their size is above 1, or `every` one), or "" for none."""
    shown = [p for p in ("tp", "pp", "ep") if f"{p}_size" in rank and (every or rank[f"{p}_size"] > 1)]
    return ", ".join(f"{p.upper()} rank {rank[p + '_rank']}/{rank[p + '_size']}" for p in shown)


def cpu_thread_binding(ranks: int, cores: list[int] | None = None) -> str:
    """Return the CPU engines' per-rank core list (``"0-7|8-15"``): this process's cores split over `ranks`."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if ranks > len(cores):  # fewer cores than ranks: they share (one each, in turn)
        groups = [[cores[r % len(cores)]] for r in range(ranks)]
    else:
        size, extra = divmod(len(cores), ranks)
        bounds = [r * size + min(r, extra) for r in range(ranks + 1)]
        groups = [cores[bounds[r] : bounds[r + 1]] for r in range(ranks)]
    # A run of cores as "a-b", others listed ("0,2,4"): the form libnuma's cpu strings (both engines) read.
    contiguous = lambda g: g == list(range(g[0], g[-1] + 1))  # noqa: E731
    return "|".join(f"{g[0]}-{g[-1]}" if contiguous(g) and len(g) > 1 else ",".join(map(str, g)) for g in groups)


def ranks_in(command: list[str], flags: dict[str, tuple[str, ...]]) -> int:
    """Return how many ranks `command` starts: the product of its parallel sizes (`flags`: a size -> its options)."""
    total = 1
    for options in flags.values():
        size = 1
        for i, arg in enumerate(command):
            name, _, value = arg.partition("=")
            if name in options:
                value = value or (command[i + 1] if i + 1 < len(command) else "1")
                size = int(value) if value.isdigit() and int(value) > 0 else 1
        total *= size
    return total
