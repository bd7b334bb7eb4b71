"""Small fixed-shape computations of the checks (launch-bound), captured once per key and replayed from
CUDA graphs; what does not fit runs eagerly. One pool per device, inputs within BUDGET_BYTES (LRU)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from typing import Callable, TypeVar

import torch

_LOG = logging.getLogger("sm120_fp4")
T = TypeVar("T")

MAX_INPUT_BYTES = 8 << 20  # a call whose inputs are larger runs eagerly (it is not launch-bound)
BUDGET_BYTES = 64 << 20  # the graphs' input buffers kept per device, at most
CAPTURE_AT = 4  # captured at its fourth use: a full check (a size twice in a row, then again) never pays for one
_SEEN_LIMIT = 4096  # keys counted before their second use, per device (then counted afresh)


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], outputs: tuple, size: int) -> None:
        self.graph, self.inputs, self.outputs, self.size = graph, inputs, outputs, size


class _Device:
    """The graphs of one CUDA device: their shared pool, the lock around a replay and its reading."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool = None
        self.stream: torch.cuda.Stream | None = None  # every capture on one side stream: the pool's blocks are reused
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: dict[tuple, int] = {}  # uses of a key not (yet) captured
        self.eager: set[tuple] = set()  # keys whose capture failed
        self.replays = 0
        self.captures = 0


_devices: dict[int, _Device] = {}
_devices_lock = threading.Lock()
_thread = threading.local()  # .no_capture: this thread is inside no_capture()


@contextlib.contextmanager
def no_capture():
    """Capture nothing in :func:`run` on this thread within it (a key with a graph still replays)."""
    previous = getattr(_thread, "no_capture", False)
    _thread.no_capture = True
    try:
        yield
    finally:
        _thread.no_capture = previous


def captures_allowed() -> bool:
    """Return False inside :func:`no_capture` on this thread."""
    return not getattr(_thread, "no_capture", False)


def _eligible(inputs: tuple[torch.Tensor, ...]) -> int | None:
    """Return the CUDA device index where a graph may run these inputs, else None."""
    if not inputs or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
        return None
    index = inputs[0].device.index
    if any(t.device.index != index for t in inputs):
        return None
    if sum(t.numel() * t.element_size() for t in inputs) > MAX_INPUT_BYTES:
        return None
    return None if torch.cuda.is_current_stream_capturing() else index


def run(
    name: str, fn: Callable[..., tuple], inputs: tuple[torch.Tensor, ...], read: Callable[[tuple], T], extra: tuple = ()
) -> T:
    """Return ``read(fn(*inputs))``, from a CUDA graph of `fn` where one fits."""
    # `fn`: pure, returns a tuple of tensors, no host sync; `extra`: its constants (part of the key).
    index = _eligible(inputs)
    if index is None:
        return read(fn(*inputs))
    with _devices_lock:
        dev = _devices.setdefault(index, _Device())
    key = (name, extra) + tuple((tuple(t.shape), t.stride(), t.dtype) for t in inputs)
    with dev.lock:
        graph = dev.graphs.get(key)
        if graph is None and key not in dev.eager:
            uses = dev.seen.get(key, 0)
            if uses >= CAPTURE_AT - 1 and captures_allowed():
                graph = _capture(dev, key, fn, inputs)
            else:
                if len(dev.seen) >= _SEEN_LIMIT:
                    dev.seen.clear()
                dev.seen[key] = uses + 1
        if graph is not None:
            dev.graphs.move_to_end(key)
            with torch.cuda.device(index):  # the graph's device current: replay runs on its current stream
                for buffer, value in zip(graph.inputs, inputs):
                    buffer.copy_(value)
                graph.graph.replay()
                dev.replays += 1
                return read(graph.outputs)
    return read(fn(*inputs))


def _capture(dev: _Device, key: tuple, fn: Callable[..., tuple], inputs: tuple[torch.Tensor, ...]) -> _Graph | None:
    """Capture `fn` over buffers shaped like `inputs` (on a side stream, in the device's pool)."""
    dev.seen.pop(key, None)
    device = inputs[0].device
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        if dev.stream is None:
            dev.stream = torch.cuda.Stream(device)
        side = dev.stream
        try:
            buffers = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in inputs]
            for buffer, value in zip(buffers, inputs):
                buffer.copy_(value)
            fn(*buffers)  # outside capture first: whatever fn makes once (its device constants) exists before
            if dev.pool is None:
                dev.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                graph.capture_begin(pool=dev.pool, capture_error_mode="thread_local")
                try:
                    outputs = fn(*buffers)
                finally:
                    graph.capture_end()
        except Exception as exc:
            dev.eager.add(key)
            _LOG.debug("sm120_fp4: %s runs eagerly (capture failed: %s: %s)", key[0], type(exc).__name__, exc)
            return None
        finally:
            current.wait_stream(side)
        size = sum(b.numel() * b.element_size() for b in buffers)
        entry = _Graph(graph, buffers, tuple(outputs), size)
        dev.graphs[key] = entry
        dev.captures += 1
        while sum(g.size for g in dev.graphs.values()) > BUDGET_BYTES and len(dev.graphs) > 1:
            dev.graphs.popitem(last=False)
        return entry


def clear() -> None:
    """Drop every graph and every count."""
    with _devices_lock:
        devices = list(_devices.values())
        _devices.clear()
    for dev in devices:
        with dev.lock:
            dev.graphs.clear()
            dev.seen.clear()


def stats() -> dict[int, dict[str, int]]:
    """Return per CUDA device index: graphs kept, their input bytes, captures and replays."""
    with _devices_lock:
        devices = dict(_devices)
    found = {}
    for i, d in devices.items():
        found[i] = {"graphs": len(d.graphs), "input_bytes": sum(g.size for g in d.graphs.values())}
        found[i] |= {"captures": d.captures, "replays": d.replays}
    return found
