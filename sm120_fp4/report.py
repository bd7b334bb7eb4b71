"""The report file (``SM120_FP4_REPORT``): one JSON file holding every process's decisions and refusals.

Several processes write one report: the tensor-parallel scheduler processes SGLang spawns, and the
preflight of ``sm120-fp4 launch``, whose process becomes the server (``exec``). Each write is a
merge under a lock (an advisory lock on the report's directory): this process's section replaces its previous one, and the
sections of the other processes of the same run (same process group and group leader) are kept,
whether those processes are still running or have exited -- a worker that refused and exited keeps
its refusal in the report. Sections of earlier runs are dropped unless their process is still
running. A directory (``SM120_FP4_REPORT=/logs``) gets one file per process instead, as does a
path with ``{pid}``.

The file::

    {"version": 2, "pid": <last writer>, "updated_at": ...,
     "processes": [{"pid", "role", "run", "started", "written_at", ... what the role adds}],
     "decisions": [... each with "pid" and "role"], "refusals": [... each with "pid" and "role"]}

Written through files.write_json (the one atomic writer): 0600, in a trusted directory, never over
a link or special file. :func:`update` writes this process's section from :data:`sections`
(:mod:`sm120_fp4.api` wires serving's ``decisions`` and ``refusals``, the serving canary adds ``canary``).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import files, locks

if TYPE_CHECKING:
    from .config import Settings

__all__ = ["write", "resolve", "update", "sections", "VERSION"]

VERSION = 2
_LOG = logging.getLogger("sm120_fp4")
_lock = locks.lock()
_update_lock = locks.lock()

# This process's section of the report: name -> a function returning its JSON-serialisable value,
# called whenever the report is written (api wires serving's "decisions" and "refusals", the
# serving canary adds "canary").
sections: dict[str, Callable[[], object]] = {}


def _started(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None (gone, or no /proc)."""
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


def _run() -> str:
    """This run: the process group and when its leader started (a restarted container's pid 1 is another run)."""
    group = os.getpgid(0)
    return f"{group}@{_started(group) or '?'}"


def resolve(path: Path, directory: bool | None) -> Path:
    """The file to write for `path` ({pid} replaced; a directory holds one file per process).

    `directory` says whether the path named a directory when the settings were read (a link to a
    directory is that directory): a directory that has disappeared since is an OSError, never a
    file created at its name. None: decide now (a real directory, not a link)."""
    path = Path(str(path).replace("{pid}", str(os.getpid())))
    if directory is None:
        directory = path.is_dir() and not path.is_symlink()
    if directory:
        if not path.is_dir():
            raise FileNotFoundError(f"the report directory {path} no longer exists (not creating a file at its name)")
        path = path / f"sm120_fp4-{os.getpid()}.json"
    return path


def write(path: Path, section: dict, directory: bool | None = None, role: str = "worker") -> Path:
    """Merge this process's `section` (``decisions``, ``refusals`` and any other keys) into the
    report at `path` and return the file written. OSError (files.UntrustedPath among them) when it
    cannot be written; the previous report is then intact."""
    target = resolve(path, directory)
    # Bounded, both the thread lock and the file lock: this runs on serving threads.
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


def _merge(target: Path, section: dict, role: str) -> None:
    """write()'s merge of this process's `section` into `target`, under the report directory's lock."""
    me = {
        **{k: v for k, v in section.items() if k not in ("decisions", "refusals")},
        "pid": os.getpid(),
        "role": role,
        "run": _run(),
        "started": _started(os.getpid()),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
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
            theirs = [
                e
                for e in (old.get(name, []) if keep else [])
                if isinstance(e, dict) and (e.get("pid"), e.get("role")) in kept
            ]
            return theirs + mine  # this process's last: the newest entry is at the end

        payload = {
            "version": VERSION,
            "pid": me["pid"],
            "updated_at": me["written_at"],
            "processes": keep + [me],
            "decisions": entries("decisions"),
            "refusals": entries("refusals"),
        }
        files.write_json(target, payload, "report")


def update(settings: Settings) -> None:
    """Write the report file now (SM120_FP4_REPORT; nothing when unset) with every one of
    :data:`sections`, gathered and written under one lock: the newest report holds the latest state,
    whichever thread writes last. A write that fails is logged, never raised: a report is evidence,
    not a reason to stop a verified worker."""
    if settings.report is None:
        return
    if not _update_lock.acquire(timeout=files.LOCK_TIMEOUT_S):  # never an unbounded wait on a serving thread
        _LOG.warning(
            "sm120_fp4: skipped a report write to %s: another thread of this process has been writing it for "
            "more than %g s (the next write holds the latest state)",
            settings.report,
            files.LOCK_TIMEOUT_S,
        )
        return
    try:
        payload = {name: section() for name, section in list(sections.items())}
        try:
            write(settings.report, payload, directory=settings.report_is_dir)
        except files.LockTimeout as exc:
            _LOG.warning("sm120_fp4: skipped a report write: %s (the next write holds the latest state)", exc)
        except OSError as exc:
            _LOG.warning("sm120_fp4: could not write the report to %s: %s", settings.report, exc)
    finally:
        _update_lock.release()
