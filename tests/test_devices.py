"""Which GPUs exist and their capability: mocked probes, NVML numbering, simulation, the cache."""

from __future__ import annotations

import sys

import pytest

from helpers.common import fake_devices
from sm120_fp4 import devices
from sm120_fp4.devices import Device


@pytest.mark.parametrize("cc", [(12, 0), (12, 1), (9, 0), (10, 0)])
def test_mocked_capabilities_are_reported_as_probed(cc):
    with fake_devices(("GPU", cc), ("GPU", cc)):
        found = devices.list_devices()
    assert [d.capability for d in found] == [cc, cc]
    assert [d.index for d in found] == [0, 1]
    assert all(not d.simulated for d in found)
    assert devices.is_sm12x(cc) == (cc[0] == 12)


def test_no_gpu_lists_nothing_and_simulation_supplies_a_cpu_device():
    with fake_devices():
        assert devices.list_devices() == []
        sim = devices.list_devices((12, 1))
        with pytest.raises(LookupError, match="SM120_FP4_SIMULATE=12.0"):
            devices.get_device(None)
    assert len(sim) == 1 and sim[0].index == -1 and sim[0].capability == (12, 1) and sim[0].simulated
    assert "sm_121, simulated" in sim[0].label() and not sim[0].is_cuda and sim[0].torch_device.type == "cpu"


def test_simulation_overrides_every_real_capability():
    with fake_devices(("NVIDIA H200", (9, 0)), ("NVIDIA H200", (9, 0))):
        sim = devices.list_devices((12, 0))
    assert [(d.index, d.capability, d.simulated) for d in sim] == [(0, (12, 0), True), (1, (12, 0), True)]


def test_get_device_finds_an_ordinal_or_names_what_is_visible():
    with fake_devices(("A", (12, 0)), ("B", (12, 1))):
        assert devices.get_device(1).name == "B" and devices.get_device(None).name == "A"
        with pytest.raises(LookupError, match=r"no device with index 7; visible: \[\"cuda:0 'A' \(sm_120\)\""):
            devices.get_device(7)
        # In simulation, CPU tensors stand for the simulated GPU even where real GPUs exist.
        cpu = devices.get_device(-1, (12, 0))
        assert (cpu.index, cpu.capability, cpu.simulated) == (-1, (12, 0), True)


def test_results_are_cached_until_refresh_or_a_new_probe():
    calls = []

    def probe():
        calls.append(1)
        return [Device(0, "GPU", (12, 0))]

    with devices.use_probe(probe):
        devices.list_devices()
        devices.list_devices()
        assert len(calls) == 1
        devices.list_devices(refresh=True)
        assert len(calls) == 2
    with fake_devices(("other", (9, 0))):
        assert devices.list_devices()[0].name == "other", "use_probe clears the cache"


def test_label_and_sm():
    d = Device(3, "RTX PRO 6000", (12, 0))
    assert d.sm == 120 and d.is_cuda and d.label() == "cuda:3 'RTX PRO 6000' (sm_120)"
    assert d.key == (3, (12, 0), False)


class FakeNvml:
    gpus = [("GPU-A", (12, 0)), ("GPU-B", (9, 0)), ("GPU-C", (12, 1))]

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return self.gpus[h][0].encode()  # older pynvml returns bytes
    def nvmlDeviceGetCudaComputeCapability(self, h): return self.gpus[h][1]


def test_nvml_numbering_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    found = devices.list_devices(refresh=True)
    assert [(d.index, d.name, d.capability, d.source) for d in found] == [
        (0, "GPU-C", (12, 1), "nvml"),
        (1, "GPU-A", (12, 0), "nvml"),
    ]


def test_nvml_stops_at_the_first_invalid_visible_ordinal_as_cuda_does(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,9,0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert [d.name for d in devices.list_devices(refresh=True)] == ["GPU-B"]


@pytest.mark.parametrize("visible, order", [("GPU-uuid-1", "PCI_BUS_ID"), ("1,0", None)])
def test_nvml_is_not_asked_when_its_numbering_may_differ_from_cudas(monkeypatch, visible, order):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if order is None:
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    monkeypatch.setattr(devices, "_probe_torch", lambda: ["torch"])
    assert devices.list_devices(refresh=True) == ["torch"]


def test_a_broken_nvml_falls_back_to_torch(monkeypatch):
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML: driver not loaded")

    monkeypatch.setitem(sys.modules, "pynvml", Broken())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_probe_torch", lambda: ["torch"])
    assert devices.list_devices(refresh=True) == ["torch"]
