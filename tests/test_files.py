"""The files this library creates and reads -- the verdict store, its lock, the report -- against
another user, odd umasks and special files, through the public entry
points: the settings from the environment, decide(), `sm120-fp4 selftest` in a new process.

This machine runs the tests as root: "another user" is a chown to uid 12345 (root may do that)."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from pathlib import Path

import pytest
from helpers.cases import case
from helpers.common import SIM_ENV
from helpers.procs import Popen, background, clean_env
from helpers.workers import workers_in_process

import sm120_fp4
from sm120_fp4 import verdicts
from sm120_fp4.config import Settings, load_settings
from sm120_fp4.errors import ConfigError

OTHER = 12345  # another user's uid
SIM = Settings(simulate="12.0", backends=("emulated",))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _planted_crash(store: Path) -> None:
    """A verdict file saying `emulated` crashed on this (simulated) device: what a planter writes."""
    device = sm120_fp4.devices.get_device(None, (12, 0))
    entry = {
        "key": verdicts.device_key(device),
        "family": "dense",
        "backend": "emulated",
        "verdict": "crashed",
        "reason": "planted",
        "recorded_at": "2020-01-01T00:00:00",
    }
    store.write_text(json.dumps({"version": 1, "verdicts": [entry]}))


def _cli_selftest(monkeypatch, **env: str) -> int:
    """`sm120-fp4 selftest` in this process, its workers too (helpers.workers)."""
    from sm120_fp4 import cli

    for name, value in {**SIM_ENV, **env}.items():
        monkeypatch.setenv(name, value)
    with workers_in_process():
        return cli.main(["selftest"])


# ---- created owner-only, whatever the umask ----------------------------------------------------


def _selftest_under_umask_000(folder: Path) -> Popen:
    """`sm120-fp4 selftest` in a new process under umask 000 (its workers inherit it), HOME holding
    no .cache yet."""
    home = folder / "home"
    return Popen(
        ["sh", "-c", 'umask 000 && exec "$@"', "sh", sys.executable, "-m", "sm120_fp4", "selftest"],
        clean_env(**SIM_ENV, HOME=str(home), XDG_CACHE_HOME=""),
        folder,
    )


@case(
    "files and trust",
    "`sm120-fp4 selftest` under umask 000 with HOME holding no .cache yet (the default verdict store)",
    "~/.cache and ~/.cache/sm120_fp4 are created 0700, verdicts.json and its lock 0600",
)
@background(_selftest_under_umask_000)
def test_the_default_store_is_created_owner_only_under_umask_000(background, background_job):
    rc, _, err = background
    assert rc == 0, err
    cache = background_job.folder / "home" / ".cache"
    store = cache / "sm120_fp4"
    assert _mode(cache) == 0o700 and _mode(store) == 0o700
    assert _mode(store / "verdicts.json") == 0o600 and _mode(store / "verdicts.json.lock") == 0o600
    assert json.loads((store / "verdicts.json").read_text())["verdicts"][0]["verdict"] == "passed"


@pytest.mark.parametrize("umask", [0o000, 0o777])
def test_a_new_store_directory_is_0700_and_the_file_0600(tmp_path, umask):
    store = tmp_path / "a" / "b" / "verdicts.json"
    previous = os.umask(umask)
    try:
        verdicts.record(store, {"gpu": "x"}, "dense", "emulated", verdicts.PASSED, None)
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "a") == 0o700 and _mode(tmp_path / "a" / "b") == 0o700
    assert _mode(store) == 0o600 and _mode(store.with_name("verdicts.json.lock")) == 0o600


# ---- never trusted: another user's directory or file, one writable by others ---------------------


def _untrusted(tmp_path: Path, how: str) -> Path:
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    store = folder / "verdicts.json"
    _planted_crash(store)
    if how == "directory owned by another user":
        os.chown(folder, OTHER, OTHER)
    elif how == "directory writable by others (0777)":
        os.chmod(folder, 0o777)
    elif how == "file owned by another user":
        os.chown(store, OTHER, OTHER)
    elif how == "file writable by others (0666)":
        os.chmod(store, 0o666)
    return store


UNTRUSTED = [
    "directory owned by another user",
    "directory writable by others (0777)",
    "file owned by another user",
    "file writable by others (0666)",
]


@case(
    "files and trust",
    "verdict store with a planted `crashed` entry for the only candidate, in a {how}; a serving process decides",
    "the store is not read (one warning names it and why): the candidate is self-tested and serves; nothing is written there",
)
@pytest.mark.parametrize("how", UNTRUSTED)
def test_an_untrusted_store_is_neither_read_nor_written(tmp_path, monkeypatch, caplog, how):
    store = _untrusted(tmp_path, how)
    before = store.read_bytes()
    monkeypatch.setenv("SM120_FP4_VERDICTS", str(store))
    caplog.set_level(logging.WARNING, "sm120_fp4")
    decision = sm120_fp4.decide(settings=load_settings(simulate="12.0", backends="emulated"))
    assert decision.backend == "emulated" and decision.verified and "emulated" not in decision.rejected
    assert any(
        "not reading the verdict file" in r.getMessage()
        and ("uid 12345" in r.getMessage() or "writable by others" in r.getMessage())
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    with pytest.raises(OSError, match="not using the verdict"):
        verdicts.record(store, {"gpu": "x"}, "dense", "emulated", verdicts.PASSED, None)
    assert store.read_bytes() == before


@case(
    "files and trust",
    "`sm120-fp4 selftest` with SM120_FP4_VERDICTS in a directory owned by another user, holding a planted `crashed` entry",
    "exit 0: stderr says the store is neither read nor recorded there (owner named); the candidate is self-tested, not skipped",
)
def test_selftest_reports_an_untrusted_store_and_ignores_it(tmp_path, monkeypatch, capsys):
    store = _untrusted(tmp_path, "directory owned by another user")
    code = _cli_selftest(monkeypatch, SM120_FP4_VERDICTS=str(store))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "neither read nor recorded" in err and "owned by uid 12345" in err, err
    assert "| emulated | True |" in out


def test_a_sticky_world_writable_directory_is_trusted_for_our_own_files(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)  # like /tmp: nobody else can remove or rename our entries
    store = folder / "verdicts.json"
    verdicts.record(store, {"gpu": "x"}, "dense", "emulated", verdicts.CRASHED, "why")
    assert verdicts.load(store)[0]["verdict"] == "crashed"
    os.chown(store, OTHER, OTHER)  # but a file there that is not ours is not
    assert verdicts.load(store) == []


# ---- never blocking on, following or replacing a special file -----------------------------------


def _plant(path: Path, kind: str, victim: Path) -> None:
    if kind == "FIFO":
        os.mkfifo(path, 0o666)
    elif kind == "symlink":
        path.symlink_to(victim)
    else:
        raise ValueError(kind)


@case(
    "files and trust",
    "a {kind} planted at the verdict file (or at its lock) after start-up; a serving process decides and `record` runs",
    "nothing blocks: the file is not read (warning), the lock is refused (OSError naming it); a link's target is never created or written",
)
@pytest.mark.parametrize("kind", ["FIFO", "symlink"])
@pytest.mark.parametrize("where", ["verdict file", "lock"])
def test_a_planted_special_file_never_blocks_or_is_followed(tmp_path, monkeypatch, caplog, kind, where):
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    store = folder / "verdicts.json"
    victim = tmp_path / "victim.json"
    monkeypatch.setenv("SM120_FP4_VERDICTS", str(store))
    settings = load_settings(simulate="12.0", backends="emulated")  # read before the plant
    _plant(store if where == "verdict file" else store.with_name("verdicts.json.lock"), kind, victim)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert sm120_fp4.decide(settings=settings).backend == "emulated"
    with pytest.raises(OSError, match="is (a FIFO|a symbolic link)"):
        verdicts.record(store, {"gpu": "x"}, "dense", "emulated", verdicts.PASSED, None)
    assert not victim.exists()
    if where == "verdict file":
        assert any(
            f"it is {'a FIFO' if kind == 'FIFO' else 'a symbolic link'}" in r.getMessage() for r in caplog.records
        )
        assert stat.S_ISFIFO(os.lstat(store).st_mode) if kind == "FIFO" else store.is_symlink()


SPECIAL = {"/dev/null": "a character device", "/dev/stdout": "a symbolic link"}


@case(
    "files and trust",
    "SM120_FP4_{which}={path} (a device node or a link to one)",
    "ConfigError at start naming the variable and what the path is (`sm120-fp4 selftest`: exit 2); the device is never replaced by a file",
)
@pytest.mark.parametrize("which", ["REPORT", "VERDICTS"])
@pytest.mark.parametrize("path", list(SPECIAL))
def test_a_special_file_is_not_accepted_as_report_or_store(monkeypatch, capsys, which, path):
    from sm120_fp4 import cli

    before = os.lstat(path)
    monkeypatch.setenv(f"SM120_FP4_{which}", path)
    with pytest.raises(ConfigError, match=f"SM120_FP4_{which}='{path}' is not accepted.*{SPECIAL[path]}"):
        load_settings()
    for name, value in SIM_ENV.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["selftest"]) == 2 and SPECIAL[path] in capsys.readouterr().err
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)


@case(
    "files and trust",
    "a FIFO or another user's file planted at the report path after start-up (or a report directory owned by another user)",
    "the report is not written there (one warning says why); nothing blocks; the planted file is untouched; the decision stands",
)
@pytest.mark.parametrize("plant", ["FIFO", "another user's file", "directory owned by another user"])
def test_the_report_never_replaces_what_is_not_ours(tmp_path, caplog, plant):
    folder = tmp_path / "logs"
    folder.mkdir()
    path = folder / "report.json"
    settings = Settings(simulate="12.0", report=str(path), selftest="off")
    if plant == "FIFO":
        os.mkfifo(path)
    elif plant == "another user's file":
        path.write_text("theirs")
        os.chown(path, OTHER, OTHER)
    else:
        os.chown(folder, OTHER, OTHER)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert sm120_fp4.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert any("could not write the report" in r.getMessage() for r in caplog.records)
    if plant == "FIFO":
        assert stat.S_ISFIFO(os.lstat(path).st_mode)
    elif plant == "another user's file":
        assert path.read_text() == "theirs"
    else:
        assert not path.exists()


# ---- no home directory ---------------------------------------------------------------------------


@case(
    "files and trust",
    "HOME={home!r}, XDG_CACHE_HOME unset or relative (the default verdict store)",
    "never /.cache: the password database's home of this user is used; with none usable there is no default store (one warning: set SM120_FP4_VERDICTS)",
)
@pytest.mark.parametrize("home", ["", "relative/dir", "/"])
def test_an_empty_or_odd_home_never_puts_the_store_at_the_root(monkeypatch, caplog, home):
    import pwd

    monkeypatch.setenv("HOME", home)
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")  # relative: not a base directory (XDG)
    path = load_settings().verdicts_path
    real = pwd.getpwuid(os.geteuid()).pw_dir
    assert path == Path(real) / ".cache" / "sm120_fp4" / "verdicts.json" and not str(path).startswith("/.cache")

    class NoHome:
        pw_dir = "/"

    monkeypatch.setattr(pwd, "getpwuid", lambda uid: NoHome)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert load_settings().verdicts_path is None
    assert any("no verdict store" in r.getMessage() and "SM120_FP4_VERDICTS" in r.getMessage() for r in caplog.records)


@case(
    "files and trust",
    "a crash recorded in the verdict store under flashinfer_jit_cache_sm120f {before}; then {after} is installed",
    "a serving process skips the candidate under the version it crashed with, and self-tests it (it serves) under "
    "another: FlashInfer's kernel packages are part of the verdict's key",
)
@pytest.mark.parametrize("before, after", [("0.7.2+cu130", "0.7.1+cu130")])
def test_a_crash_verdict_holds_only_for_the_kernel_packages_it_was_seen_with(tmp_path, monkeypatch, before, after):
    from helpers.plugins import installed_package

    from sm120_fp4 import versions
    from sm120_fp4.errors import RefusedToServe

    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(installed_package(site, "flashinfer_jit_cache_sm120f", before)))
    versions.clear_cache()
    store = tmp_path / "verdicts.json"
    _planted_crash(store)
    monkeypatch.setenv("SM120_FP4_VERDICTS", str(store))
    settings = load_settings(simulate="12.0", backends="emulated")
    with pytest.raises(RefusedToServe, match="crashed the self-test process"):
        sm120_fp4.decide(settings=settings)
    for info in site.iterdir():  # pip install flashinfer_jit_cache_sm120f==AFTER
        for file in info.iterdir():
            file.unlink()
        info.rmdir()
    installed_package(site, "flashinfer_jit_cache_sm120f", after)
    versions.clear_cache()
    decision = sm120_fp4.decide(settings=settings)
    assert decision.backend == "emulated" and decision.verified
    versions.clear_cache()
