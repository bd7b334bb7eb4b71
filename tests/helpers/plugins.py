"""A throw-away distribution with sm120_fp4 backends as entry points (groups sm120_fp4.backends and
sm120_fp4.moe_backends), for children that must find backends the way spawned workers do."""

from __future__ import annotations

from pathlib import Path

MODULE = '''
import os, signal, time


def crash(a, b, a_sf, b_sf, alpha, dtype, out):
    """Dies as an illegal memory access does: the process is gone (FlashInfer #3170)."""
    os.kill(os.getpid(), signal.SIGSEGV)


def zeros(a, b, a_sf, b_sf, alpha, dtype, out):
    out.zero_()
    return out


def good(a, b, a_sf, b_sf, alpha, dtype, out):
    from sm120_fp4.backends import emulated_mm_fp4
    return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)


def late(a, b, a_sf, b_sf, alpha, dtype, out):
    """Takes 30 s, then gives the right result: far past a 6 s self-test bound, so the serving thread
    is still inside the call when the watchdog's bound and grace are over (it sleeps: a spinning
    stand-in would only take a core from the other tests)."""
    time.sleep(30)
    return good(a, b, a_sf, b_sf, alpha, dtype, out)


def only_sm121(device):
    return device.capability == (12, 1), "only on sm_121"


good121 = lambda *args: good(*args)  # noqa: E731
good121.is_supported = only_sm121


def moe_crash(*args):
    os.kill(os.getpid(), signal.SIGSEGV)


def moe_zeros(*args):
    out = args[-1]
    out.zero_()
    return out


def hang(a, b, a_sf, b_sf, alpha, dtype, out):
    """Writes its process id to $TEST_HANG_MARK, then blocks like a hung kernel (until killed)."""
    with open(os.environ.get("TEST_HANG_MARK", "hanging"), "w") as mark:
        mark.write(str(os.getpid()))
    time.sleep(600)


def _rank():
    """This process's rank among a server's ranks (0 outside one: the preflight, a one-rank server)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank1_zeros(a, b, a_sf, b_sf, alpha, dtype, out):
    """Right on every rank but rank 1, where it returns zeros: a kernel broken on one GPU of several."""
    good(a, b, a_sf, b_sf, alpha, dtype, out)
    return out.zero_() if _rank() == 1 else out


def rank1_hang(a, b, a_sf, b_sf, alpha, dtype, out):
    """Right on every rank but rank 1, where it hangs (as `hang`)."""
    if _rank() == 1:
        hang(a, b, a_sf, b_sf, alpha, dtype, out)
    return good(a, b, a_sf, b_sf, alpha, dtype, out)


def oom(a, b, a_sf, b_sf, alpha, dtype, out):
    """Dies as the out-of-memory killer kills: SIGKILL."""
    os.kill(os.getpid(), signal.SIGKILL)


def oom_once(a, b, a_sf, b_sf, alpha, dtype, out):
    """SIGKILL the first time (no ./oom-once mark yet), the right result after."""
    if not os.path.exists("oom-once"):
        open("oom-once", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return good(a, b, a_sf, b_sf, alpha, dtype, out)
'''

ENTRY_POINTS = """[sm120_fp4.backends]
crash = sm120_fp4_test_plugins:crash
zeros = sm120_fp4_test_plugins:zeros
good = sm120_fp4_test_plugins:good
good121 = sm120_fp4_test_plugins:good121
late = sm120_fp4_test_plugins:late
missing = sm120_fp4_no_such_module:fn
hang = sm120_fp4_test_plugins:hang
oom = sm120_fp4_test_plugins:oom
oom-once = sm120_fp4_test_plugins:oom_once
rank1-zeros = sm120_fp4_test_plugins:rank1_zeros
rank1-hang = sm120_fp4_test_plugins:rank1_hang

[sm120_fp4.moe_backends]
moe-crash = sm120_fp4_test_plugins:moe_crash
moe-zeros = sm120_fp4_test_plugins:moe_zeros
"""


def distribution(root: Path, module: str, source: str, entry_points: str) -> Path:
    """`root` holding module `module` (its `source`) and a dist-info whose entry_points.txt is
    `entry_points`, as an installed distribution has them; put `root` on PYTHONPATH."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{module}-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return root


def plugin_site(root: Path) -> Path:
    """`root` holding this module's backends as an installed distribution; put it on PYTHONPATH."""
    return distribution(root, "sm120_fp4_test_plugins", MODULE, ENTRY_POINTS)


def installed_package(root: Path, name: str, version: str) -> Path:
    """`root` holding a dist-info of distribution `name` at `version` (no code), as pip leaves one; on sys.path,
    importlib.metadata finds it installed."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root
