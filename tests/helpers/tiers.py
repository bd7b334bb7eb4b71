"""Test tiers: which tests start a subprocess (mark `subprocess`) or a real SGLang server (mark `server`).

conftest.py marks every collected test from what it uses, so that a new test cannot forget the mark:
a background job (`@background`: a subprocess; a heavy one: a real server), or a function that starts a
process -- the helpers of procs.py, `subprocess`, `os.fork`, `multiprocessing` -- named by the test, by a
fixture it uses, or by a function of the tests that either calls (followed through the test modules and
helpers, not into the library). What this cannot see (a library call that starts workers, such as an
in-process `cli.main(["selftest"])`) gets an explicit `@pytest.mark.subprocess`; `Guard` fails a test
that started a Python interpreter, a fork or a multiprocessing child without the mark, naming the mark.

The inner loop is `python -m pytest -m "not slow and not subprocess"` (docs/development.md; `slow` is explicit).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import subprocess
import sys
import types

from . import procs

# Each module whose use starts a process, with the names of it that do.
_STARTING = {
    subprocess: {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    os: {"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "spawnv", "spawnve", "execv", "execve"},
    multiprocessing: {"Process", "get_context", "Pool"},
    procs: {"run_cli", "run_python", "Popen", "Spawned", "python", "with_repo_pth"},
}
_STARTERS = {
    id(getattr(module, name)) for module, names in _STARTING.items() for name in names if hasattr(module, name)
}


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names `code` and the functions nested in it (lambdas too) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _ours(fn: object) -> bool:
    """A function of the test suite (a test module, conftest or tests/helpers), not of the library."""
    module = getattr(fn, "__module__", "") or ""
    return module.startswith(("test_", "helpers", "conftest"))


def starts_processes(fn: object, seen: set[int] | None = None) -> bool:
    """Whether `fn`, or a function of the tests it names, starts a process."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    seen = set() if seen is None else seen
    if code is None or id(fn) in seen:
        return False
    seen.add(id(fn))
    names = _names(code)
    for name in names:
        obj = fn.__globals__.get(name, sys.modules.get(name))  # a module imported inside the function too
        if obj is None:
            continue
        if id(obj) in _STARTERS or (isinstance(obj, types.ModuleType) and names & _STARTING.get(obj, set())):
            return True
        # A function of the tests named directly, or as an attribute of a test module (procs.something()); a
        # decorated one (a context manager) through what it wraps.
        if isinstance(obj, types.ModuleType) and obj.__name__.startswith("helpers"):
            called = [getattr(obj, n) for n in names if callable(getattr(obj, n, None))]
        else:
            called = [obj]
        for f in called:
            f = inspect.unwrap(f) if isinstance(f, types.FunctionType) else f
            if isinstance(f, types.FunctionType) and _ours(f) and starts_processes(f, seen):
                return True
    return False


def tiers(item) -> set[str]:
    """The tier marks `item` needs, from its background job, its function and its fixtures."""
    fn = getattr(item, "function", None)
    marks: set[str] = set()
    if getattr(fn, "background_job", None) is not None:
        marks.add("subprocess")
        if getattr(fn, "background_heavy", False):
            marks.add("server")  # heavy jobs are real-server starts
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    functions = [fn] + [d.func for defs in fixtures.values() for d in defs if _ours(d.func)]
    if any(starts_processes(f) for f in functions if f is not None):
        marks.add("subprocess")
    if "server" in marks or item.get_closest_marker("server") is not None:
        marks.add("subprocess")
    return marks


def _python(argv) -> bool:
    """Whether a Popen argv starts a Python interpreter (seconds of CPU each: what the inner loop avoids).
    Quick tool calls that libraries make on their own, some only at their first import (ldconfig,
    lscpu, nvcc --version, git, patch), are not counted: which test meets them depends on the order."""
    first = argv if isinstance(argv, (str, bytes, os.PathLike)) else (argv[0] if argv else "")
    first = os.fsdecode(first).split()[0] if os.fsdecode(first).strip() else ""
    return first == sys.executable or os.path.basename(first).startswith("python")


class Guard:
    """Records a Python interpreter, fork or multiprocessing child started during a test from outside a
    background job (while it is in place)."""

    def __init__(self):
        self.started: list[str] = []

    def _from_a_background_job(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is procs.Queued.start_and_finish.__code__:
                return True
            frame = frame.f_back
        return False

    def wrap(self, what: str, original, counted=lambda *args: True):
        def recording(*args, **kwargs):
            if counted(*args) and not self._from_a_background_job():
                self.started.append(what)
            return original(*args, **kwargs)

        return recording

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(
            subprocess.Popen,
            "_execute_child",
            self.wrap(
                "a Python interpreter", subprocess.Popen._execute_child, lambda popen, argv, *rest: _python(argv)
            ),
        )
        monkeypatch.setattr(os, "fork", self.wrap("os.fork", os.fork))
        monkeypatch.setattr(
            multiprocessing.process.BaseProcess,
            "start",
            self.wrap("multiprocessing", multiprocessing.process.BaseProcess.start),
        )
