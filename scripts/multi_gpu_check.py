"""The per-GPU preflight, device mapping and workers on every GPU of one host, run for real.

Usage (on a machine with CUDA GPUs, from the repo root; the package and its dependencies importable):
    python scripts/multi_gpu_check.py OUT_DIR
Writes OUT_DIR/multi_gpu.json (every figure below) and prints a summary; exit 0 when every check
holds. With one GPU it runs the same scenarios on that GPU (what one GPU can show: the fault then
sits on GPU 0); with N GPUs on all N. The GPUs are simulated as 12.0 (SM120_FP4_SIMULATE=12.0):
FlashInfer's FP4 kernels do not run on a non-Blackwell GPU, so `emulated` (dense and MoE) is the
verified backend; everything else -- workers, device mapping, reports, NCCL, graphs -- is real.

1. `sm120-fp4 selftest --json` over all GPUs and over GPU 0 alone: wall times (the per-GPU workers
   run concurrently: all GPUs within 1.5x of one), each worker's device UUID and PCI bus id in the
   one report (SM120_FP4_REPORT), one decision per (family, GPU).
2. Device mapping: CUDA_VISIBLE_DEVICES reversed, as UUIDs, and unset with CUDA_DEVICE_ORDER
   FASTEST_FIRST and PCI_BUS_ID: the UUID sm120_fp4 maps each index to equals torch's for it.
3. One spawned process per GPU, as SGLang starts its tensor-parallel workers (spawn, SM120_FP4=1,
   a torch.distributed NCCL group of all of them): each decides and verifies its own GPU, serves
   the dense and the MoE front inside a captured CUDA graph (replayed on new inputs, equal to the
   oracle), runs one canary pass, and the group all-reduces its verdicts.
4. A backend wrong on the last GPU only (an entry-point backend, as a real kernel would be found):
   that GPU's worker refuses, the others verify, `launch` does not start the command, the report
   names that GPU.
5. With two GPUs or more, real SGLang servers at TP=N through `launch` (tests/helpers/tp_server.py, as the CPU
   suite's tests/test_tp_servers.py runs them at TP=2): one serves with every rank's layers verified (the report
   lists them per rank, each process with its `rank`); one with a kernel wrong on TP rank 1 only exits non-zero
   before its port opens, and `launch`'s output, the report and the refusal name `TP rank 1/N`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.plugins import distribution

PLUGIN = '''
import os


def wrong_on_gpu(a, b, a_sf, b_sf, alpha, dtype, out):
    """The emulated result, negated on the GPU named by MULTI_GPU_FAULT (a fault on one GPU only)."""
    from sm120_fp4.backends import emulated_mm_fp4
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if a.get_device() == int(os.environ.get("MULTI_GPU_FAULT", "-2")):
        out.neg_()
    return out
'''


def plugin_site(root: Path) -> Path:
    """`wrong-on-gpu` as an installed distribution's entry point (group sm120_fp4.backends)."""
    return distribution(
        root, "multi_gpu_plugins", PLUGIN, "[sm120_fp4.backends]\nwrong-on-gpu = multi_gpu_plugins:wrong_on_gpu\n"
    )


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("SM120_FP4")}
    out.update({"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated", "SM120_FP4_MOE_BACKENDS": "emulated"})
    out.update(extra)
    return out


def run(cmd: list[str], **extra: str) -> tuple[int, str, str, float]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(**extra), timeout=900)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start


def gpus() -> list[dict]:
    import torch

    return [
        {
            "index": i,
            "name": torch.cuda.get_device_name(i),
            "uuid": str(torch.cuda.get_device_properties(i).uuid),
            "pci": f"{torch.cuda.get_device_properties(i).pci_bus_id:02x}",
        }
        for i in range(torch.cuda.device_count())
    ]


def selftests(out: Path, count: int) -> dict:
    """Scenario 1: the preflight over all GPUs, then over GPU 0 alone; the one report."""
    result = {}
    for label, args in (("all", []), ("gpu0", ["--device", "0"])):
        report = out / f"report-{label}.json"
        rc, stdout, stderr, wall = run(
            [sys.executable, "-m", "sm120_fp4", "selftest", "--json", *args], SM120_FP4_REPORT=str(report)
        )
        data = json.loads(report.read_text()) if report.exists() else {}
        decisions = data.get("decisions", [])
        result[label] = {
            "rc": rc,
            "wall_s": round(wall, 2),
            "stderr_tail": stderr[-1500:],
            "decisions": [
                {
                    "device": d.get("device"),
                    "uuid": d.get("device_uuid"),
                    "pci": d.get("device_pci_bus_id"),
                    "backend": d.get("backend"),
                    "family": d.get("family"),
                    "verified": d.get("verified"),
                }
                for d in decisions
            ],
        }
    one, every = result["gpu0"]["wall_s"], result["all"]["wall_s"]
    result["concurrent"] = {
        "ratio_all_over_one": round(every / one, 2) if one else None,
        "ok": count == 1 or every <= 1.5 * one,
    }
    return result


MAPPING = """
import json, torch
from sm120_fp4 import devices
rows = []
for d in devices.list_devices((12, 0)):
    rows.append({"index": d.index, "ours": getattr(d, "uuid", None), "torch": str(torch.cuda.get_device_properties(d.index).uuid)})
print(json.dumps(rows))
"""


def mapping(all_gpus: list[dict]) -> dict:
    """Scenario 2: the UUID sm120_fp4 gives each index against torch's, for every numbering."""
    uuids = [f"GPU-{g['uuid']}" for g in all_gpus]
    variants = {
        "reversed": {"CUDA_VISIBLE_DEVICES": ",".join(str(g["index"]) for g in reversed(all_gpus))},
        "uuids": {"CUDA_VISIBLE_DEVICES": ",".join(reversed(uuids))},
        "unset fastest-first": {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
        "unset pci": {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    }
    result = {}
    for name, extra in variants.items():
        base = {k: v for k, v in extra.items()}
        e = env(**base)
        if "CUDA_VISIBLE_DEVICES" not in base:
            e.pop("CUDA_VISIBLE_DEVICES", None)
        proc = subprocess.run([sys.executable, "-c", MAPPING], capture_output=True, text=True, env=e, timeout=300)
        try:
            rows = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            rows = []
        same = bool(rows) and all(
            r["ours"] is not None and str(r["ours"]).removeprefix("GPU-") == r["torch"].removeprefix("GPU-")
            for r in rows
        )
        result[name] = {"env": base, "rows": rows, "matched": same, "stderr_tail": proc.stderr[-800:]}
    return result


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """Scenario 3, one tensor-parallel-like worker (spawned): install, decide, verify, capture, canary."""
    import torch
    import torch.distributed as dist

    os.environ.update(SM120_FP4="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    facts: dict = {"rank": rank}
    try:
        import sm120_fp4
        from sm120_fp4 import canary, dispatch, nvfp4, serving
        from sm120_fp4.config import load_settings

        sm120_fp4.install()
        settings = load_settings()
        router = dispatch.Router(settings)
        dense, moe = router.ensure(rank), router.ensure(rank, "moe")
        facts["routes"] = {"dense": serving.routes().get(rank), "moe": serving.routes("moe").get(rank)}
        facts["device_uuid"] = str(torch.cuda.get_device_properties(rank).uuid)
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(16, 512, device="cuda", generator=gen)
        w = torch.randn(256, 512, device="cuda", generator=gen) * 0.05
        gx, gw = nvfp4.global_scale(x), nvfp4.global_scale(w)
        qx, sx = nvfp4.quantize(x, gx)
        qw, sw = nvfp4.quantize(w, gw)
        args = [qx, qw.T, sx, sw.T, (1 / (gx * gw)).reshape(1)]
        front = router.make_dispatch(lambda *a, **k: (_ for _ in ()).throw(AssertionError("original called")))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                front(*args, torch.bfloat16, backend="cutlass")
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = front(*args, torch.bfloat16, backend="cutlass")
        graph.replay()
        torch.cuda.synchronize()
        facts["dense_graph_equal_oracle"] = bool(torch.equal(static, nvfp4.reference_mm_fp4(*args)))
        facts["moe_decided"] = moe is not None
        facts["dense_decided"] = dense is not None
        flag = torch.tensor([1.0 if facts["dense_graph_equal_oracle"] and facts["moe_decided"] else 0.0], device="cuda")
        dist.all_reduce(flag)
        facts["group_ok"] = float(flag.item()) == world
        facts["canary"] = canary.status().model_dump(mode="json") if hasattr(canary, "status") else None
    except Exception as exc:
        facts["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        Path(out, f"worker-{rank}.json").write_text(json.dumps(facts, default=str))
        dist.destroy_process_group()


def workers(out: Path, count: int) -> dict:
    import torch.multiprocessing as mp

    os.environ.update(SM120_FP4_SIMULATE="12.0", SM120_FP4_BACKENDS="emulated", SM120_FP4_MOE_BACKENDS="emulated")
    start = time.perf_counter()
    mp.start_processes(_worker, args=(count, 29517, str(out)), nprocs=count, start_method="spawn", join=True)
    facts = [json.loads((out / f"worker-{r}.json").read_text()) for r in range(count)]
    return {
        "wall_s": round(time.perf_counter() - start, 2),
        "workers": facts,
        "ok": all(f.get("group_ok") and f.get("dense_graph_equal_oracle") and "error" not in f for f in facts),
    }


def fault(out: Path, count: int) -> dict:
    """Scenario 4: wrong on the last GPU only; selftest refuses that one, launch does not start."""
    site = plugin_site(out / "plugins")
    bad = count - 1
    extra = dict(
        SM120_FP4_BACKENDS="wrong-on-gpu",
        MULTI_GPU_FAULT=str(bad),
        PYTHONPATH=f"{site}:{os.environ.get('PYTHONPATH', '')}",
    )
    report = out / "report-fault.json"
    rc, stdout, stderr, wall = run(
        [sys.executable, "-m", "sm120_fp4", "selftest", "--json"], SM120_FP4_REPORT=str(report), **extra
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    refusals, decisions = data.get("refusals", []), data.get("decisions", [])
    lrc, lout, lerr, lwall = run(
        [sys.executable, "-m", "sm120_fp4", "launch", "--", sys.executable, "-c", "print('LAUNCHED')"], **extra
    )
    return {
        "selftest_rc": rc,
        "refused_devices": [r.get("device") for r in refusals],
        "verified_devices": [d.get("device") for d in decisions if d.get("verified")],
        "launch_rc": lrc,
        "launched": "LAUNCHED" in lout,
        "wall_s": round(wall, 2),
        "stderr_tail": stderr[-1500:],
        "ok": rc == 1
        and lrc != 0
        and "LAUNCHED" not in lout
        and any(f"cuda:{bad}" in str(r.get("device")) or str(bad) in str(r.get("device")) for r in refusals),
    }


def tp_servers(out: Path, count: int) -> dict:
    """Scenario 5: SGLang at TP=count on the GPUs: served (each rank's layers), then refused on TP rank 1 only."""
    from helpers.tp_server import run as tp_run

    result = {}
    for scenario in ("served", "rank1-zeros"):
        folder = out / f"tp-{scenario}"
        folder.mkdir(exist_ok=True)
        r = tp_run("sglang", scenario, folder, gpus=count)
        procs = [p for report in r["reports"] for p in report["processes"] if "tp_rank" in (p.get("rank") or {})]
        refusals = [x for report in r["reports"] for x in report.get("refusals", [])]
        result[scenario] = {
            "port_opened": r["port_opened"],
            "returncode": r["returncode"],
            "start_s": r.get("start_s"),
            "ranks": sorted(p["rank"]["tp_rank"] for p in procs),
            "refusal_ranks": [x.get("rank") for x in refusals],
            "launcher": r["launcher"],
            "log_tail": r["log"][-1500:],
        }
    said = f"TP rank 1/{count}"
    result["ok"] = (
        result["served"]["port_opened"]
        and result["served"]["ranks"] == list(range(count))
        and not result["rank1-zeros"]["port_opened"]
        and result["rank1-zeros"]["returncode"] not in (0, None)
        and any(said in line for line in result["rank1-zeros"]["launcher"])
        and any((x or {}).get("tp_rank") == 1 for x in result["rank1-zeros"]["refusal_ranks"])
    )
    return result


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "multi-gpu-results").resolve()
    out.mkdir(parents=True, exist_ok=True)
    found = gpus()
    if not found:
        print("no CUDA GPU visible: nothing to run")
        return 2
    summary = {"gpus": found}
    for name, step in (
        ("selftest", lambda: selftests(out, len(found))),
        ("mapping", lambda: mapping(found)),
        ("workers", lambda: workers(out, len(found))),
        ("fault", lambda: fault(out, len(found))),
        *([("tp_servers", lambda: tp_servers(out, len(found)))] if len(found) >= 2 else []),
    ):
        try:
            summary[name] = step()
        except Exception as exc:
            summary[name] = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
        (out / "multi_gpu.json").write_text(json.dumps(summary, indent=2, default=str))
    ok = {
        "selftest": summary["selftest"].get("all", {}).get("rc") == 0
        and summary["selftest"].get("concurrent", {}).get("ok", False),
        "mapping": all(v.get("matched") for v in summary["mapping"].values())
        if "error" not in summary["mapping"]
        else False,
        "workers": summary["workers"].get("ok", False),
        "fault": summary["fault"].get("ok", False),
        **({"tp_servers": summary["tp_servers"].get("ok", False)} if "tp_servers" in summary else {}),
    }
    summary["ok"] = ok
    (out / "multi_gpu.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(ok), f"({len(found)} GPU(s); details in {out / 'multi_gpu.json'})")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
