"""Subprocesses: run one now (`run_python`, `run_cli`), or start one in the background at session
start (`@background(...)`, collected by the `background` fixture of conftest.py).

Spawned interpreters that import torch or SGLang cost seconds of CPU each; background jobs of every
selected test start together right after collection and run while the in-process tests do.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

TIMEOUT = 240
PACKAGE = Path(__file__).resolve().parents[2] / "sm120_fp4"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any SM120_FP4* variable, plus `extra`; one thread per child."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SM120_FP4")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)
    return env


def run_python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(**(env or {})), cwd=cwd, timeout=TIMEOUT)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m sm120_fp4 ARGS`, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "sm120_fp4", *args], capture_output=True, text=True, env=clean_env(**(env or {})), timeout=TIMEOUT)


def ours(text: str) -> list[str]:
    """The lines this library wrote (every message of ours starts with 'sm120_fp4')."""
    return [line for line in text.splitlines() if line.startswith("sm120_fp4")]


def broken_copy(root: Path, corrupt: str) -> Path:
    """A copy of the package under `root` with one module truncated mid-file (a half-written install)."""
    shutil.copytree(PACKAGE, root / "sm120_fp4", ignore=shutil.ignore_patterns("__pycache__"))
    target = root / "sm120_fp4" / corrupt
    target.write_text(target.read_text()[:300])
    return root


def fake_sglang(root: Path) -> Path:
    """An empty `sglang` package under `root`: the bootstrap hooks the import of any `sglang`."""
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    return root


# ---- background jobs -------------------------------------------------------------------------

class Popen:
    """A subprocess whose output goes to files (no pipe fills up while nobody reads it)."""

    def __init__(self, args: list[str], env: dict[str, str], folder: Path, cwd: Path | None = None, merge: bool = False,
                 group: bool = False, timeout: float | None = None):
        """`merge`: stderr goes into stdout, in the order written (stderr then reads as empty). `group`: the
        child leads a process group of its own, and kill() ends the whole group (a server and its workers).
        `timeout`: how long wait() waits, whatever the caller asks (a real server starts in minutes)."""
        self.out, self.err = folder / "stdout", folder / "stderr"
        self.group, self.timeout = group, timeout
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT if merge else err,
                                         stdin=subprocess.DEVNULL, start_new_session=group)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        rc = self.proc.wait(self.timeout or timeout)
        return rc, self.out.read_text(), self.err.read_text()

    def kill(self) -> None:
        if self.group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Spawned:
    """A `spawn` child started the way SGLang starts its schedulers; `target(stderr_path)` runs in it."""

    def __init__(self, target: Callable[[str], None], env: dict[str, str], folder: Path):
        self.err = folder / "stderr"
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)  # the child inherits the environment at start()
        try:
            self.proc = multiprocessing.get_context("spawn").Process(target=target, args=(str(self.err),))
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        self.proc.join(timeout)
        return self.proc.exitcode, "", self.err.read_text() if self.err.exists() else ""

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def python(code: str, folder: Path, cwd: Path | None = None, **env: str) -> Popen:
    """A background `python -c code` in clean_env(**env)."""
    return Popen([sys.executable, "-c", code], clean_env(**env), folder, cwd)


REPO = PACKAGE.parent
PTH = PACKAGE / "_pth" / "sm120_fp4.pth"


def with_repo_pth(code: str, folder: Path, cwd: Path | None = None, **env: str) -> Popen:
    """A background `python -S -c code` that processes this repository's `.pth` line first (as
    site-packages would; the environment's installed copy may be older), then the normal site."""
    site_dir = folder / "pth-site"
    site_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(PTH, site_dir / "sm120_fp4.pth")
    prelude = f"import site; site.addsitedir({str(site_dir)!r}); site.main()\n"
    env.setdefault("PYTHONPATH", str(REPO))
    return Popen([sys.executable, "-S", "-c", prelude + code], clean_env(**env), folder, cwd)


def background(start: Callable[..., object]):
    """Start `start(folder, **params)` at session start for each selected case of the decorated test.

    `folder` is an empty directory for the job; `params` are the case's parameters. The test gets
    `(returncode, stdout, stderr)` from the `background` fixture.
    """

    def mark(fn):
        fn.background_job = start
        return fn

    return mark
