"""The report file (``SM120_FP4_REPORT``): one JSON file holding every process's decisions and refusals.

Each write merges under a lock on the report's directory: this process's section replaces its previous one; other
processes' sections are kept if of the same run (process group and leader) or still running. A directory, or a path
with ``{pid}``, gets one file per process. The file holds ``version``, ``pid``, ``updated_at``, ``processes`` and the
``decisions`` and ``refusals``, each with ``pid`` and ``role``. One writer per process (:class:`Writer`, owned by
``serving.STATE``): a serving thread asks, a daemon thread writes; a refusal waits for it, bounded."""

from __future__ import annotations

import atexit
import errno
import glob
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import files, locks

if TYPE_CHECKING:
    from .config import Settings


VERSION = 2
_LOG = logging.getLogger("sm120_fp4")
_lock = locks.lock()
# How long a refusal (or api.decide, or the exit) waits for the writes asked so far: both lock bounds of one write.
FLUSH_S = 2 * files.LOCK_TIMEOUT_S + 1.0


def _started(pid: int) -> str | None:
    """Return when process `pid` started (clock ticks since boot), or None (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()  # field 22 of stat(5), counted after the command name
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = _started(pid)
    return started is None or now is None or now == started  # a reused pid is not the same process


def resolve(path: Path, directory: bool) -> Path:
    """Return the file to write for `path` ({pid} replaced; a directory holds one file per process)."""
    # `directory`: whether it named a directory when the settings were read (Settings.report_is_dir); one
    # that has disappeared since is an OSError, never a file created at its name.
    path = Path(str(path).replace("{pid}", str(os.getpid())))
    if directory:
        if not path.is_dir():
            raise FileNotFoundError(f"the report directory {path} no longer exists (not creating a file at its name)")
        path = path / f"sm120_fp4-{os.getpid()}.json"
    return path


def write(path: Path, section: dict, directory: bool, role: str = "worker") -> Path:
    """Merge this process's `section` into the report at `path`; return the file written (OSError: not written)."""
    target = resolve(path, directory)
    # Bounded, both the thread lock and the file lock: the writer thread's flush and the preflight wait on it.
    if not _lock.acquire(timeout=files.LOCK_TIMEOUT_S):
        raise files.LockTimeout(
            errno.EWOULDBLOCK,
            f"another thread of this process has been writing the report {target} "
            f"for more than {files.LOCK_TIMEOUT_S:g} s; not waiting longer",
        )
    try:
        _merge(target, section, role)
    finally:
        _lock.release()
    return target


def read_all(path: str | Path) -> list[tuple[str, dict]]:
    """Return (file, its JSON) of each report readable at `path`: a directory's files, every pid's for ``{pid}``."""
    path = str(path).replace("{pid}", "*")
    found = []
    for name in sorted(glob.glob(os.path.join(path, "*.json") if os.path.isdir(path) else path)):
        try:
            payload = files.read_json(Path(name), "report")
        except (OSError, ValueError):
            continue  # being replaced, or not ours to read (files.py): a report of a run, not of this command
        if isinstance(payload, dict):
            found.append((name, payload))
    return found


def _merge(target: Path, section: dict, role: str) -> None:
    """Merge this process's `section` into `target`, under the report directory's lock."""
    me = {k: v for k, v in section.items() if k not in ("decisions", "refusals")}
    group = os.getpgid(0)  # this run: the process group and when its leader started
    me |= {"pid": os.getpid(), "role": role, "run": f"{group}@{_started(group) or '?'}"}
    me["started"], me["written_at"] = _started(os.getpid()), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with files.locked_directory(target.parent, "report"):
        try:
            old = files.read_json(target, "report")
        except ValueError:
            old = None  # not JSON (a report of an older release, a torn copy): replaced
        keep = []
        if isinstance(old, dict) and old.get("version") == VERSION and isinstance(old.get("processes"), list):
            for proc in old["processes"]:
                if not isinstance(proc, dict) or (proc.get("pid"), proc.get("role")) == (me["pid"], role):
                    continue
                pid = proc.get("pid")
                if proc.get("run") == me["run"] or (isinstance(pid, int) and _alive(pid, proc.get("started"))):
                    keep.append(proc)
        kept = {(p["pid"], p.get("role")) for p in keep}

        def entries(name: str) -> list:
            mine = [{**e, "pid": me["pid"], "role": role} for e in section.get(name, [])]
            olds = old.get(name, []) if keep else []
            theirs = [e for e in olds if isinstance(e, dict) and (e.get("pid"), e.get("role")) in kept]
            return theirs + mine  # this process's last: the newest entry is at the end

        payload = {"version": VERSION, "pid": me["pid"], "updated_at": me["written_at"], "processes": keep + [me]}
        payload |= {"decisions": entries("decisions"), "refusals": entries("refusals")}
        files.write_json(target, payload, "report")


class Writer:
    """The one writer of a process's report (serving's state owns this process's): asking never waits; a daemon
    thread gathers every one of :attr:`sections` and writes."""

    # A serving thread only counts a request and wakes the thread (or starts it: the first request,
    # and the first after a fork()); each write gathers every section then, so it holds the latest
    # state. `flush` waits, bounded, for the requests made so far: a refusal, api.decide, the exit.

    def __init__(self) -> None:
        # This process's section: name -> a function returning its JSON value, called at each write (api
        # wires serving's "decisions" and "refusals", the canary's configure adds "canary").
        self.sections: dict[str, Callable[[], object]] = {}
        self._cond = threading.Condition(locks.lock())
        self._asked = self._done = 0  # requests made; requests a finished write covers
        self._pending: dict[tuple, Settings] = {}  # (path, is a directory) -> the settings naming it
        self._thread: threading.Thread | None = None

    def request(self, settings: Settings) -> None:
        """Ask for this process's report to be written to SM120_FP4_REPORT (nothing when unset); never waits."""
        if settings.report is None:
            return
        with self._cond:
            self._asked += 1
            self._pending[(str(settings.report), settings.report_is_dir)] = settings
            if self._thread is None or not self._thread.is_alive():
                if self._thread is None:
                    atexit.register(self.flush)  # the last state, before the interpreter goes (bounded)
                self._thread = threading.Thread(target=self._run, name="sm120_fp4-report", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout_s: float = FLUSH_S) -> bool:
        """Wait at most `timeout_s` for every write asked so far; return whether they are done."""
        with self._cond:
            asked = self._asked
            return self._cond.wait_for(lambda: self._done >= asked, timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._asked > self._done)
                asked, pending, self._pending = self._asked, list(self._pending.values()), {}
            for settings in pending:
                try:
                    payload = {name: section() for name, section in list(self.sections.items())}
                    write(settings.report, payload, directory=settings.report_is_dir)
                except files.LockTimeout as exc:
                    _LOG.warning("sm120_fp4: skipped a report write: %s (the next write holds the latest state)", exc)
                except Exception as exc:  # not written, or a section that cannot be gathered: logged, it goes on
                    _LOG.warning("sm120_fp4: could not write the report to %s: %s", settings.report, exc)
            with self._cond:
                self._done = asked
                self._cond.notify_all()

    def write_now(self, settings: Settings) -> bool:
        """Ask for a write and wait for it, bounded (FLUSH_S): on disk before what may stop the process; done or not."""
        self.request(settings)
        return self.flush()
