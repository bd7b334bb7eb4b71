"""The serving canary's place in SGLang (sm120_fp4/sglang/idle.py, the idle specs of targets.py, the
wiring in sglang.attach): the scheduler loop's idle point of each release, patched only with the
canary on, restored by uninstall(); the canary refused at start-up where it could not run."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types

import pytest
import torch
from helpers.cases import case

import sm120_fp4
from sm120_fp4 import serving
from sm120_fp4.demo import synthetic
from sm120_fp4.errors import ConfigError, RefusedToServe
from sm120_fp4.sglang import idle, layers, targets
from sm120_fp4.sglang.release import MODEL_RUNNER, SCHEDULER, sglang_version

pytest.importorskip(
    "sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang (scripts/setup_env.sh)"
)


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test starts and ends with SGLang unpatched."""


def test_the_idle_hook_runs_the_canary_first_then_sglangs_idle_work():
    calls = []

    def on_idle(self, *args):
        calls.append(("sglang", self, args))
        return "sglang's result"

    def run(stream):
        with stream():
            calls.append(("canary",))

    hooked = idle.make_idle_hook(on_idle, run)
    scheduler = types.SimpleNamespace(enable_overlap=False)
    assert hooked(scheduler) == "sglang's result" and hooked.__wrapped__ is on_idle
    assert calls == [("canary",), ("sglang", scheduler, ())]


def test_a_refusal_raised_by_the_canary_leaves_the_idle_point():
    done = []

    def refuse(stream):
        raise RefusedToServe("while serving: ...")

    hooked = idle.make_idle_hook(lambda self: done.append(self), refuse)
    with pytest.raises(RefusedToServe, match="while serving"):
        hooked(types.SimpleNamespace())
    assert done == [], "SGLang's idle work is not reached: the loop stops"


def test_the_serving_stream_is_the_current_one_unless_sglang_overlaps_on_a_cuda_stream(monkeypatch):
    for scheduler in (
        types.SimpleNamespace(),
        types.SimpleNamespace(enable_overlap=True, forward_stream="cpu stream"),
        types.SimpleNamespace(enable_overlap=False, forward_stream=object()),
    ):
        assert isinstance(idle.serving_stream(scheduler), contextlib.nullcontext), "the loop's own stream stays"
    if not torch.cuda.is_available():
        # The CPU run: a stand-in for CUDA's stream type and torch.cuda.stream (which needs a device), recording
        # which stream is entered and when it is left, as the GPU run below checks on a real stream.
        entered = []

        class Stream:
            pass

        @contextlib.contextmanager
        def stream(which):
            entered.append(which)
            yield
            entered.append("left")

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        forward = Stream()
        with idle.serving_stream(types.SimpleNamespace(enable_overlap=True, forward_stream=forward)):
            assert entered == [forward], "an overlapping scheduler's forward stream is current inside"
        assert entered == [forward, "left"], "and left after"
        with idle.serving_stream(types.SimpleNamespace(enable_overlap=False, forward_stream=forward)):
            assert entered == [forward, "left"], "no overlap: the forward stream is not entered"
    else:  # the GPU run: an overlapping scheduler's forward stream is entered
        forward = torch.cuda.Stream()
        overlapped = types.SimpleNamespace(enable_overlap=True, forward_stream=forward)
        with idle.serving_stream(overlapped):
            assert torch.cuda.current_stream() == forward
        assert torch.cuda.current_stream() != forward
        with idle.serving_stream(types.SimpleNamespace(enable_overlap=False, forward_stream=forward)):
            assert torch.cuda.current_stream() != forward, "no overlap: the forward stream is not entered"


def test_every_supported_release_has_exactly_one_idle_point():
    from sm120_fp4.versions import version_in

    releases = ["0.5.8", "0.5.10.post1", "0.5.11", "0.5.12.post1", "0.5.13", "0.5.23"]
    found = {v: [s.name for s in targets.idle_specs(print) if version_in(v, s.versions)] for v in releases}
    assert all(len(names) == 1 for names in found.values()), found
    assert targets.idle_spec(print, "0.5.24") is None and targets.idle_spec(print, "0.5.7") is None


def test_the_idle_point_is_patched_only_with_the_canary_on_and_uninstall_restores_it():
    scheduler = pytest.importorskip(SCHEDULER)
    spec = targets.idle_spec(print)
    owner = getattr(scheduler, spec.attribute.split(".")[0])
    original = owner.__dict__[spec.attribute.split(".")[1]]
    status = sm120_fp4.install(simulate="12.0", backends="emulated")
    assert (
        spec.name not in {p.name for p in status.patches} and owner.__dict__[spec.attribute.split(".")[1]] is original
    )
    sm120_fp4.uninstall()
    status = sm120_fp4.install(simulate="12.0", backends="emulated", canary="60")
    assert {p.name: p.state for p in status.patches}[spec.name] == "applied"
    patched = owner.__dict__[spec.attribute.split(".")[1]]
    assert patched is not original and patched.__wrapped__ is original and patched.__sm120_fp4_patch__ == spec.name
    assert status.canary.idle_point == f"{spec.module}.{spec.attribute}"
    sm120_fp4.uninstall()
    assert owner.__dict__[spec.attribute.split(".")[1]] is original


# ---- refused at start-up, never silently off ---------------------------------------------------


@case(
    "configuration",
    "SM120_FP4_CANARY=60 on an SGLang release whose scheduler loop has no idle point the library knows",
    "install() raises ConfigError naming the variable, the release and the idle points known; nothing patched",
)
def test_a_release_without_an_idle_point_refuses_the_canary_at_install(monkeypatch):
    legacy = [s for s in targets.idle_specs(print) if s.versions == ">=0.5.8,<0.5.11"]
    monkeypatch.setattr(targets, "idle_specs", lambda run: [dataclasses.replace(s, make=None) for s in legacy])
    with pytest.raises(
        ConfigError,
        match=rf"SM120_FP4_CANARY=60 is not available with SGLang {sglang_version()}: its "
        r"scheduler loop has no idle point .*SchedulerRuntimeCheckerMixin.self_check_during_idle",
    ):
        sm120_fp4.install(simulate="12.0", backends="emulated", canary="60")
    assert not sm120_fp4.status().installed


@case(
    "configuration",
    "`sm120-fp4 launch` with SM120_FP4_CANARY=60 and SM120_FP4_SELFTEST=off",
    "exit code 2 before the preflight, naming both settings; the command is not started",
)
def test_launch_refuses_a_canary_that_could_not_run_before_the_preflight(tmp_path, monkeypatch, capsys):
    from sm120_fp4 import cli

    marker = tmp_path / "started"
    for name, value in {"SM120_FP4_CANARY": "60", "SM120_FP4_SELFTEST": "off", "SM120_FP4_SIMULATE": "12.0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli.launch, "_spawn", lambda *args: pytest.fail(f"exec {args}"))  # never this process replaced
    code = cli.main(["launch", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "SM120_FP4_CANARY=60" in err and "SM120_FP4_SELFTEST=off" in err and "not starting" in err
    assert "self-testing" not in err and not marker.exists()


def _model_runner_with_warmup(captured):
    """SGLang's model runner, as the warm-up tests stand it in: its graph-capture step (this release's name)."""
    from helpers.common import release_specs

    specs = release_specs()
    name = (specs.get("post-warmup-recheck") or specs["post-warmup-recheck-legacy"]).attribute.split(".")[1]
    module = types.ModuleType(MODEL_RUNNER)

    def init_graphs(self, capture_decode_cuda_graph=True):
        self.decode_cuda_graph_runner = self.graph_runner = types.SimpleNamespace(capture_bs=list(captured))

    module.ModelRunner = type("ModelRunner", (), {name: init_graphs})
    return module, name


@case(
    "own failures",
    "SM120_FP4_CANARY on, but the scheduler's idle point could not be patched (its method missing in this process)",
    "the scheduler refuses to serve after warm-up, naming the idle hook and why it is not in place: the canary is never silently off",
)
def test_warmup_refuses_when_the_idle_hook_is_not_in_place(monkeypatch):
    spec = targets.idle_spec(print)
    monkeypatch.setitem(sys.modules, spec.module, types.ModuleType(spec.module))  # no Scheduler in it
    runner, name = _model_runner_with_warmup([1, 2, 4])
    monkeypatch.setitem(sys.modules, MODEL_RUNNER, runner)
    sm120_fp4.install(simulate="12.0", backends="emulated", canary="60")
    layers.build_modelopt_layer(synthetic.make_checkpoint(96, 160))
    with pytest.raises(
        RefusedToServe,
        match=rf"(?s)SM120_FP4_CANARY=60 is on, but the serving canary's idle hook "
        rf"\({spec.module}\.{spec.attribute}.*not found.*nothing would run the canary",
    ):
        getattr(runner.ModelRunner(), name)()


def test_warmup_hands_the_captured_graph_sizes_to_the_canary(monkeypatch):
    pytest.importorskip(SCHEDULER)
    runner, name = _model_runner_with_warmup([1, 2, 4, 48])
    monkeypatch.setitem(sys.modules, MODEL_RUNNER, runner)
    sm120_fp4.install(simulate="12.0", backends="emulated", canary="60")
    layers.build_modelopt_layer(synthetic.make_checkpoint(96, 160))
    getattr(runner.ModelRunner(), name)()
    assert serving.STATE.canary._captured == {1, 2, 4, 48}
