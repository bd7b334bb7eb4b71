"""sm120_fp4.sglang.simulation without SGLang: the import-time stand-in for a CUDA-only kernel
package that is installed but cannot load (SGLang 0.5.8-0.5.10 bring sgl_kernel; on a CPU it fails
on libcuda/libnvrtc). Each case runs in a fresh interpreter: the stand-in lives in sys.meta_path
and sys.modules, which a test process must not share.
"""

from __future__ import annotations

import json

import pytest
from helpers.cases import case
from helpers.procs import REPO, background, python

PACKAGE_INIT = "from . import helper\nraise ImportError('libnvrtc.so.12: cannot open shared object file')\n"

CHILD = """
import json, sys
sys.path.insert(0, {site!r})
import sm120_fp4
out = {{}}
sm120_fp4.install(simulate="12.0", backends="emulated", enable="on")
import sgl_kernel
from sgl_kernel import silu_and_mul
from sgl_kernel.scalar_type import scalar_types
out["stand_in"] = getattr(sgl_kernel, "__sm120_fp4_stand_in__", False)
out["nested"] = repr(scalar_types.uint4b8)
out["half_loaded_left"] = "sgl_kernel.helper" in sys.modules
try:
    silu_and_mul(1)
    out["call"] = "returned"
except NotImplementedError as exc:
    out["call"] = str(exc)
out["ledger"] = {{p.name: p.state for p in sm120_fp4.status().patches if p.name == "sim-kernel-package"}}
sm120_fp4.uninstall()
out["after_uninstall"] = sorted(n for n in sys.modules if n.startswith("sgl_kernel"))
out["finders_left"] = [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("sm120_fp4")]
try:
    import sgl_kernel
    out["reimport"] = "imported"
except ImportError as exc:
    out["reimport"] = str(exc)
try:
    import not_installed_kernel_package
except ImportError:
    pass
print(json.dumps(out))
"""


def _kernel_child(folder, installed: bool):
    site = folder / "site"
    if installed:
        (site / "sgl_kernel").mkdir(parents=True)
        (site / "sgl_kernel" / "__init__.py").write_text(PACKAGE_INIT)
        (site / "sgl_kernel" / "helper.py").write_text("X = 1\n")
    else:
        site.mkdir(parents=True)
    return python(CHILD.format(site=str(site)), folder, cwd=folder, PYTHONPATH=str(REPO))


@case(
    "own failures",
    "install(simulate) on a CPU, sgl_kernel installed but failing to load (libnvrtc missing), then `from sgl_kernel import ...` as SGLang 0.5.8 does unguarded",
    "the import succeeds with a stand-in whose names (and their attributes) raise NotImplementedError when called, never compute; in the ledger; uninstall() removes it and the real ImportError is back",
)
@background(lambda folder: _kernel_child(folder, installed=True))
def test_an_installed_kernel_package_that_cannot_load_gets_a_stand_in_that_raises(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    out = json.loads(stdout)
    assert out["stand_in"] is True and "uint4b8" in out["nested"]
    assert not out["half_loaded_left"], "the real package's half-loaded submodules are dropped"
    assert "sgl_kernel.silu_and_mul is CUDA-only" in out["call"] and "never a result" in out["call"]
    assert out["ledger"] == {"sim-kernel-package": "applied"}
    assert out["after_uninstall"] == [] and out["finders_left"] == []
    assert "libnvrtc" in out["reimport"]
    assert "cannot load here (ImportError: libnvrtc.so.12" in stderr


@case(
    "own failures",
    "install(simulate) on a CPU, no sgl_kernel installed, then `import sgl_kernel`",
    "ImportError as without this library (SGLang's guarded imports take their no-kernel branch); no stand-in, nothing in the ledger",
)
@background(lambda folder: _kernel_child(folder, installed=False))
def test_a_kernel_package_that_is_not_installed_stays_not_installed(background):
    rc, stdout, stderr = background
    assert rc != 0 and "ModuleNotFoundError: No module named 'sgl_kernel'" in stderr
    assert "stand-in" not in stderr


UNDO_FAILS = """
import json, logging, sys
records = []
logging.getLogger('sm120_fp4').addHandler(type('H', (logging.Handler,), {'emit': lambda self, r: records.append(r.getMessage())})())
import torch
import sm120_fp4
sm120_fp4.install(simulate='12.0', backends='emulated')
import sglang.srt.layers.quantization.modelopt_quant  # the CPU kernel for sglang::fp4_gemm is registered here
destroy = torch.library.Library._destroy  # the undo step holds it bound: change what it runs
def broken(self):
    raise RuntimeError('boom')
code, destroy.__code__ = destroy.__code__, broken.__code__
status = sm120_fp4.uninstall()
destroy.__code__ = code
left = [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith('sm120_fp4')]
print(json.dumps([status.installed, [r for r in records if 'undoing' in r], left]))
"""


@case(
    "own failures",
    "uninstall() in simulation while one stand-in's undo step fails (RuntimeError)",
    "one warning names the step and the error; every other stand-in is still undone; uninstall completes",
)
@background(lambda folder: python(UNDO_FAILS, folder, cwd=folder, PYTHONPATH=str(REPO)))
def test_a_failing_undo_step_is_said_and_the_rest_still_undone(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    installed, said, left = json.loads(stdout.strip().splitlines()[-1])
    assert not installed and left == []
    assert len(said) == 1 and "Library._destroy" in said[0] and "RuntimeError: boom" in said[0], said


OP_GPU_ONLY = """
import json
import sm120_fp4
sm120_fp4.install(simulate="12.0", backends="emulated", enable="on")
import sglang.srt.layers.quantization.modelopt_quant
entry = next(p for p in sm120_fp4.status().patches if p.name == "sim-fp4-gemm-cpu-kernel")
print(json.dumps([entry.state, entry.reason]))
"""


@background(lambda folder: python(OP_GPU_ONLY, folder, cwd=folder, PYTHONPATH=str(REPO)))
def test_the_fp4_gemm_op_registered_for_the_gpu_only_gets_a_cpu_kernel(background):
    """SGLang's register_custom_op registers sglang::fp4_gemm for the GPU only: the simulation registers its Python
    body for CPU, and the ledger says so."""
    rc, stdout, stderr = background
    assert rc == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1]) == ["applied", None]


NCCL_CHILD = """
import json, os, sys
import sm120_fp4
sm120_fp4.install(simulate="12.0", backends="emulated", enable="on")
from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator
from sglang.srt.distributed.utils import StatelessProcessGroup
out = {}
try:  # rank 0 of two, as each CPU rank of a TP=2 server builds it
    comm = PyNcclCommunicator(StatelessProcessGroup(rank=0, world_size=2, store=None), device="cpu")
    out["communicator"] = {"available": comm.available, "disabled": comm.disabled}
except Exception as exc:
    out["communicator"] = f"{type(exc).__name__}: {exc}"
entry = next(p for p in sm120_fp4.status().patches if p.name == "sim-cpu-engine-nccl-off")
out["ledger"] = [entry.state, entry.reason]
print(json.dumps(out))
"""


@case(
    "configuration",
    "install(simulate) with SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1), then SGLang builds its NCCL communicator "
    "for a TP rank of two (a CUDA-build torch finds libnccl); and the same with the operator's SGLANG_NCCL_SO_PATH",
    "the communicator is built disabled (SGLang's own non-GPU branch: the ranks all-reduce over gloo), in the "
    "ledger as applied; with the operator's SGLANG_NCCL_SO_PATH the stand-in stays out and says why",
)
@pytest.mark.parametrize("operator_path", [False, True], ids=["library", "operator"])
@background(
    lambda folder, operator_path: python(
        NCCL_CHILD,
        folder,
        cwd=folder,
        PYTHONPATH=str(REPO),
        SGLANG_USE_CPU_ENGINE="1",
        **({"SGLANG_NCCL_SO_PATH": str(folder / "operator-nccl.so")} if operator_path else {}),
    )
)
def test_sglangs_nccl_communicator_is_off_for_its_cpu_engine_unless_the_operator_set_its_path(
    background, operator_path
):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    if operator_path:
        assert out["ledger"] == ["skipped", "not needed: the operator's SGLANG_NCCL_SO_PATH is left as set"]
    else:
        assert out == {"communicator": {"available": False, "disabled": True}, "ledger": ["applied", None]}
