"""Which GPUs exist and their capability: mocked probes, NVML numbering, simulation, the cache."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.cases import case
from helpers.common import fake_devices
from helpers.nvml import A6000, PRO6000, fake_pynvml

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


# ---- CUDA's numbering, from NVML facts (no GPU here: a stand-in pynvml) ---------------------

B, A = PRO6000["uuid"], A6000["uuid"]
ALIKE = [PRO6000, {**PRO6000, "uuid": "GPU-bbbb3333-0000-0000-0000-000000000003", "bus": "00000000:41:00.0"}]
MIG = {
    **PRO6000,
    "mig": [
        ("MIG-dddd4444-0000-0000-0000-000000000004", "NVIDIA RTX PRO 6000 Blackwell MIG 1g.24gb"),
        ("MIG-eeee5555-0000-0000-0000-000000000005", "NVIDIA RTX PRO 6000 Blackwell MIG 1g.24gb"),
    ],
}
# NVML lists the PRO 6000 (bus 02) before the A6000 (bus 01): NVML's index order promises nothing.
MIXED = [PRO6000, A6000]


def _nvml(monkeypatch, gpus, order=None, visible=None):
    devices.clear_cache()  # a fixture may have listed the devices already
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus))
    for name, value in (("CUDA_DEVICE_ORDER", order), ("CUDA_VISIBLE_DEVICES", visible)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


MAPPED = {
    # (gpus, CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES) -> [(name, capability, uuid)] per CUDA ordinal
    "PCI_BUS_ID, all visible: by bus id, not NVML's index": (MIXED, "PCI_BUS_ID", None, [(A6000, A), (PRO6000, B)]),
    "PCI_BUS_ID, indices 1,0": (MIXED, "PCI_BUS_ID", "1,0", [(PRO6000, B), (A6000, A)]),
    "PCI_BUS_ID, 1,9,0 (CUDA stops at the invalid 9)": (MIXED, "PCI_BUS_ID", "1,9,0", [(PRO6000, B)]),
    "PCI_BUS_ID, 0,-1,1 (stops at -1)": (MIXED, "PCI_BUS_ID", "0,-1,1", [(A6000, A)]),
    "PCI_BUS_ID, UUIDs in the order given": (MIXED, "PCI_BUS_ID", f"{B},{A}", [(PRO6000, B), (A6000, A)]),
    "FASTEST_FIRST, one GPU by a UUID prefix": (MIXED, None, "GPU-bbbb", [(PRO6000, B)]),
    "FASTEST_FIRST, lower-case prefix": (MIXED, "FASTEST_FIRST", "gpu-aaaa1111", [(A6000, A)]),
    "empty CUDA_VISIBLE_DEVICES: no GPU": (MIXED, None, "", []),
    "no such UUID: invalid, nothing after it": (MIXED, "PCI_BUS_ID", "GPU-ffff,0", []),
    "FASTEST_FIRST over identical GPUs: facts per ordinal, no UUID claimed": (
        ALIKE,
        None,
        None,
        [(PRO6000, None), (PRO6000, None)],
    ),
    "one MIG device by its MIG UUID": (
        MIXED[1:] + [MIG],
        None,
        "MIG-dddd",
        [({**PRO6000, "name": MIG["mig"][0][1]}, "dddd4444-0000-0000-0000-000000000004")],
    ),
}


@case(
    "devices",
    "CUDA numbering computed from NVML: {what}",
    "each cuda:N is the GPU CUDA numbers N (name, capability, UUID where it is certain)",
)
@pytest.mark.parametrize("what", list(MAPPED))
def test_cuda_numbering_from_nvml(monkeypatch, what):
    gpus, order, visible, expected = MAPPED[what]
    _nvml(monkeypatch, gpus, order, visible)
    found = devices.list_devices(refresh=True)
    assert [(d.index, d.name, d.capability, d.uuid) for d in found] == [
        (i, gpu["name"], gpu["cc"], None if uuid is None else uuid.lower().removeprefix("gpu-"))
        for i, (gpu, uuid) in enumerate(expected)
    ]


UNKNOWN = {
    "mixed GPUs, CUDA_DEVICE_ORDER unset (FASTEST_FIRST)": (MIXED, None, None, "GPUs of different models"),
    "mixed GPUs, FASTEST_FIRST, index 1": (MIXED, "FASTEST_FIRST", "1", "GPUs of different models"),
    "mixed GPUs, FASTEST_FIRST, both by UUID": (MIXED, None, f"{B},{A}", "the chosen GPUs differ"),
    "an ambiguous UUID prefix": (ALIKE, None, "GPU-bbbb", "is a prefix of 2 GPU UUIDs"),
    "one GPU named twice": (MIXED, "PCI_BUS_ID", "1,1", "names one GPU twice"),
    "a MIG-enabled GPU, CUDA_VISIBLE_DEVICES unset": ([A6000, MIG], "PCI_BUS_ID", None, "has MIG enabled"),
    "two MIG devices": ([MIG], None, "MIG-dddd,MIG-eeee", "a MIG device together with other devices"),
    "the old MIG-GPU-<uuid>/<gi>/<ci> form": ([MIG], None, f"MIG-{B}/1/0", "older MIG-GPU"),
    "a UUID without its GPU- prefix": (MIXED, "PCI_BUS_ID", "bbbb2222", "without its GPU-/MIG- prefix"),
}


@case(
    "devices",
    "CUDA numbering not determined from NVML: {what}, CUDA not initialised",
    "DeviceMappingError naming the problem and the fix (CUDA_DEVICE_ORDER=PCI_BUS_ID or UUIDs); never a guess",
)
@pytest.mark.parametrize("what", list(UNKNOWN))
def test_an_undetermined_numbering_fails_closed(monkeypatch, what):
    gpus, order, visible, why = UNKNOWN[what]
    _nvml(monkeypatch, gpus, order, visible)
    with pytest.raises(devices.DeviceMappingError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID") as raised:
        devices.list_devices(refresh=True)
    assert why in str(raised.value) and "Not guessing" in str(raised.value)
    assert {d.name for d in raised.value.candidates} == {g["name"] for g in gpus}  # what may be visible


class _Props:
    def __init__(self, gpu):
        self.name, (self.major, self.minor) = gpu["name"], gpu["cc"]
        self.uuid = gpu["uuid"].removeprefix("GPU-")  # torch prints CUDA's UUID without the prefix
        self.pci_domain_id, self.pci_bus_id, self.pci_device_id = 0, int(gpu["bus"].split(":")[1], 16), 0


def _torch_cuda(monkeypatch, order, initialised=True):
    """torch.cuda as a CUDA build would answer, numbering `order` (CUDA's own FASTEST_FIRST choice)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(order))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(order[i]))


@case(
    "devices",
    "mixed GPUs with FASTEST_FIRST (an sm_86 GPU in PCI slot 0, the RTX PRO 6000 in slot 1) once CUDA is initialised (a serving worker at its first layer)",
    "cuda:0 is the PRO 6000 (sm_120), as CUDA numbers it: decided and served as sm_120, never as the sm_86 GPU",
)
def test_once_cuda_is_initialised_its_own_numbering_counts(monkeypatch):
    from sm120_fp4 import deciding, serving
    from sm120_fp4.config import Settings

    _nvml(monkeypatch, MIXED)
    _torch_cuda(monkeypatch, [PRO6000, A6000])  # CUDA put the fastest, the PRO 6000, first
    found = devices.list_devices(refresh=True)
    assert [(d.index, d.capability, d.uuid, d.source) for d in found] == [
        (0, (12, 0), B.removeprefix("GPU-"), "torch"),
        (1, (8, 6), A.removeprefix("GPU-"), "torch"),
    ]
    decision = serving.decide(0, ["emulated"], settings=Settings(selftest="off"))
    assert decision.device.startswith("cuda:0 'NVIDIA RTX PRO 6000") and decision.capability == "12.0"
    assert deciding.serves(devices.get_device(0), Settings()) and not deciding.serves(devices.get_device(1), Settings())


def test_a_process_about_to_use_cuda_asks_cuda_when_nvml_cannot_tell(monkeypatch):
    _nvml(monkeypatch, MIXED)
    _torch_cuda(monkeypatch, [PRO6000, A6000], initialised=False)
    with pytest.raises(devices.DeviceMappingError):
        devices.list_devices(refresh=True)  # the CLI parent: never initialises CUDA
    assert [d.capability for d in devices.list_devices(refresh=True, init_cuda=True)] == [(12, 0), (8, 6)]


def test_a_broken_nvml_falls_back_to_torch(monkeypatch):
    broken = fake_pynvml(MIXED)

    def fail():
        raise RuntimeError("NVML: driver not loaded")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_probe_torch", lambda: ["torch"])
    assert devices.list_devices(refresh=True) == ["torch"]


def test_uuid_spellings_compare_equal():
    assert devices.same_uuid("GPU-ABCD-1", "abcd-1") and devices.same_uuid("MIG-x", "mig-X")
    assert not devices.same_uuid(None, None) and not devices.same_uuid("GPU-a", "GPU-b")


# ---- through the public entry points: the CLI, install() ------------------------------------


@case(
    "devices",
    "`sm120-fp4 selftest` on a mixed box (sm_86 GPU in PCI slot 0, RTX PRO 6000 in slot 1), CUDA_DEVICE_ORDER unset",
    "exit 2 before any self-test: CUDA's FASTEST_FIRST numbering is not known without CUDA; the message says to set CUDA_DEVICE_ORDER=PCI_BUS_ID",
)
def test_selftest_refuses_to_guess_the_numbering_of_a_mixed_box(monkeypatch, capsys):
    from sm120_fp4 import cli

    _nvml(monkeypatch, MIXED)
    assert cli.main(["selftest"]) == 2
    err = capsys.readouterr().err
    assert "GPUs of different models" in err and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in err and "self-testing" not in err, (
        err
    )


@case(
    "devices",
    "install() on the mixed box: CUDA_DEVICE_ORDER={order}",
    "PCI_BUS_ID: cuda:0 is the sm_86 GPU and cuda:1 the sm_120 one; unset: installed (a 12.x GPU may be visible) and status() says the numbering is known only through CUDA, never a guessed one",
)
@pytest.mark.parametrize("order", ["PCI_BUS_ID", "unset"])
def test_install_maps_a_mixed_box_as_cuda_numbers_it(monkeypatch, sglang_unpatched, order):
    import sm120_fp4

    _nvml(monkeypatch, MIXED, None if order == "unset" else order)
    status = sm120_fp4.install()
    assert status.installed, status.message
    if order == "PCI_BUS_ID":
        assert status.devices == [
            "cuda:0 'NVIDIA RTX A6000' (sm_86)",
            "cuda:1 'NVIDIA RTX PRO 6000 Blackwell Workstation Edition' (sm_120)",
        ]
    else:
        assert "cannot tell which GPU" in status.devices[0]


@case(
    "devices",
    "a self-test worker told the wrong GPU UUID for its --device (the parent's numbering differs from this process's)",
    "exit 2: the worker names both GPUs and does not self-test the other one",
)
def test_a_worker_refuses_a_gpu_other_than_the_one_named(monkeypatch, capsys):
    from sm120_fp4 import cli

    _nvml(monkeypatch, MIXED, "PCI_BUS_ID")
    monkeypatch.setenv("SM120_FP4_VERDICTS", "off")
    assert cli.main(["_selftest-worker", "--device", "1", "--uuid", A]) == 2
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["usage"] and "not self-testing a GPU other than the one named" in result["message"]
    assert B.removeprefix("GPU-") in result["message"] and A in result["message"]


# ---- several ranks of one engine on this machine's CPU cores ------------------------------------------------------


@pytest.mark.parametrize(
    "ranks, cores, binding",
    [
        (2, [0, 1], "0|1"),
        (2, [0, 1, 2, 3, 4], "0-2|3-4"),  # the spare core to the first rank
        (2, [0, 2, 4, 6], "0,2|4,6"),  # cores not in a run: listed
        (3, [0, 1], "0|1|0"),  # fewer cores than ranks: shared, one each in turn
        (1, [3, 4, 5], "3-5"),
    ],
)
def test_the_cpu_ranks_binding_splits_the_cores_into_one_group_per_rank(ranks, cores, binding):
    assert devices.cpu_thread_binding(ranks, cores) == binding


def test_the_ranks_a_command_starts_are_the_product_of_its_parallel_sizes():
    flags = {"tp": ("--tp", "--tp-size"), "pp": ("--pp-size",)}
    assert devices.ranks_in(["serve", "--tp", "2", "--pp-size=2"], flags) == 4
    assert devices.ranks_in(["serve", "--tp", "1", "--tp-size", "4"], flags) == 4  # the last one given, as argparse
    assert devices.ranks_in(["serve", "--tp"], flags) == 1 and devices.ranks_in(["serve"], flags) == 1
    assert devices.rank_text({"tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1}) == "TP rank 1/2"
    assert devices.rank_text({"tp_rank": 0, "tp_size": 1}) == "" and devices.rank_text({}) == ""
