"""``sm120-fp4 bench`` through the CLI, in simulation: the table's and the JSON's structure and verdicts
(never a time: a CPU's timings say nothing about a GPU's)."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.cases import case
from helpers.children import all_zeros as zeros

from sm120_fp4 import backends, cli
from sm120_fp4.demo.checkpoint import write_checkpoint

SIM = {"SM120_FP4_SIMULATE": "12.0"}


def bench(monkeypatch, capsys, *args, env=SIM):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["bench", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bench_times_each_verified_candidate_and_bf16_and_lists_the_unsupported(monkeypatch, capsys, tmp_path):
    path = tmp_path / "bench.json"
    code, out, err = bench(
        monkeypatch, capsys, "--backend", "emulated", "--backend", "cutlass", "--sizes", "3", "1", "--json", str(path)
    )
    assert code == 0, err
    assert "| kernel | layer configuration | backend | verdict | M | time (us) | TFLOP/s | x bf16 | timing |" in out
    result = json.loads(path.read_text())
    assert result["device"]["simulated"] and result["sizes"] == [1, 3]
    rows = result["rows"]
    for family in ("dense", "moe"):
        mine = [r for r in rows if r["family"] == family]
        timed = {(r["backend"], r["m"]): r for r in mine if r["m"] is not None}
        assert set(timed) == {("emulated", 1), ("emulated", 3), ("bf16", 1), ("bf16", 3)}
        assert all(r["time_us"] > 0 and r["tflops"] > 0 and r["timing"] == "cpu" for r in timed.values())
        assert {r["verdict"] for r in timed.values()} == {"verified", "yardstick"}
        assert timed[("emulated", 1)]["vs_bf16"] > 0
        cutlass = [r for r in mine if r["backend"] == "cutlass"]
        assert len(cutlass) == 1 and cutlass[0]["m"] is None and "time_us" not in cutlass[0]
        assert cutlass[0]["verdict"].startswith("unsupported: FlashInfer kernels need a real GPU")
    assert "verifying dense backend 'emulated'" in err


@case(
    "backend faults",
    "`sm120-fp4 bench` with a candidate kernel that returns zeros (a registered backend)",
    "exit 0; the candidate is listed once with its failed verdict and not timed; the others are timed",
)
def test_bench_lists_a_candidate_that_fails_verification_and_does_not_time_it(monkeypatch, capsys, tmp_path):
    backends.register("zeros", zeros)
    path = tmp_path / "bench.json"
    code, out, err = bench(
        monkeypatch, capsys, "--backend", "zeros", "--backend", "emulated", "--sizes", "2", "--json", str(path)
    )
    assert code == 0, err
    rows = [r for r in json.loads(path.read_text())["rows"] if r["family"] == "dense"]
    failed = [r for r in rows if r["backend"] == "zeros"]
    assert len(failed) == 1 and failed[0]["m"] is None and failed[0]["verdict"].startswith("failed: ")
    assert {r["backend"] for r in rows if r["m"] == 2} == {"emulated", "bf16"}
    assert "| dense | N=256 K=512 | zeros | failed: " in out


@pytest.mark.slow
def test_bench_times_the_checkpoints_layer_configurations(monkeypatch, capsys, tmp_path):
    from sm120_fp4.sglang import model_check

    model = write_checkpoint(str(tmp_path / "model"))
    path = tmp_path / "bench.json"
    code, out, err = bench(
        monkeypatch, capsys, "--model", model, "--backend", "emulated", "--sizes", "1", "--json", str(path)
    )
    assert code == 0, err
    result = json.loads(path.read_text())
    dense, moe = model_check.discover(model).distinct()  # how `selftest --model` groups the same checkpoint
    assert sorted(result["dense"]) == sorted(f"N={sum(d.sizes)} K={d.k}" for d in dense)
    assert [c.split(" top_k=")[0] for c in result["moe"]] == [f"E={m.experts}" for m in moe]
    assert all(f"H={m.hidden} I={m.inter}" in c for m, c in zip(moe, result["moe"]))
    assert {r["config"] for r in result["rows"]} == set(result["dense"]) | set(result["moe"])


@case(
    "configuration",
    "`sm120-fp4 bench` with {what}",
    "exit code 2 before anything runs; stderr names the option and the value",
)
@pytest.mark.parametrize(
    "what, args, said",
    [
        ("a batch size of 0", ("--sizes", "0"), "--sizes 0 is not a batch size"),
        ("an unknown backend", ("--backend", "nope"), "--backend 'nope' is not a known backend; accepted: "),
        (
            "a --model that is not a directory",
            ("--model", "/nonexistent/model"),
            "--model '/nonexistent/model' is not a directory",
        ),
        (
            "a --json path in a missing folder",
            ("--json", "/nonexistent/dir/b.json"),
            "--json '/nonexistent/dir/b.json'",
        ),
    ],
)
def test_bench_refuses_bad_options(monkeypatch, capsys, what, args, said):
    code, out, err = bench(monkeypatch, capsys, *args)
    assert code == 2 and said in err and out == ""


@case(
    "configuration",
    "`sm120-fp4 bench --plot PNG` where matplotlib is not installed",
    "exit code 2 before anything runs; stderr says --plot needs matplotlib",
)
def test_bench_plot_without_matplotlib_is_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it fails, as where it is not installed
    code, out, err = bench(monkeypatch, capsys, "--plot", str(tmp_path / "b.png"), "--sizes", "1")
    assert code == 2 and "--plot needs matplotlib" in err and out == ""


def test_bench_without_a_12x_gpu_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.delenv("SM120_FP4_SIMULATE", raising=False)
    code, out, err = bench(monkeypatch, capsys, "--sizes", "1", env={})
    assert code == 0 and "no compute-capability 12.x GPU visible; nothing to measure" in err and out == ""
