"""The files this library creates and reads (the verdict store, its lock, the report). Stdlib only.

Directories we create are 0700 and files 0600; a directory we use must be ours (or root's) and not writable by others
unless sticky, and is used through one descriptor; a file we read or replace must be a regular file of ours: a link,
FIFO, socket or device at its name is never followed, opened or renamed over (:class:`UntrustedPath`). Reads never
block. docs/operations.md says more."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Iterator

DIR_MODE, FILE_MODE = 0o700, 0o600
_OPEN = os.O_CLOEXEC | os.O_NOCTTY | os.O_NOFOLLOW | os.O_NONBLOCK


class UntrustedPath(OSError):
    """A path this library will not read, write or replace (what it is and why is in the message)."""


class LockTimeout(OSError):
    """A lock another process (or thread) held for longer than the bound: nothing was written."""


# How long a write waits for one of this library's locks: report writes run on serving threads,
# where nothing may block without a bound (past it the caller skips the write and logs it).
LOCK_TIMEOUT_S = 2.0


def _flock(fd: int, path: Path, what: str, timeout_s: float) -> None:
    """Take flock(LOCK_EX) on `fd`, waiting at most `timeout_s` (polling: flock has no timeout)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(
                    errno.EWOULDBLOCK,
                    f"the {what} {path} is locked by another process for more than {timeout_s:g} s; not waiting longer",
                ) from None
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)


_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}
_KINDS |= {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
_KINDS |= {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def kind_of(mode: int) -> str:
    """Return what a stat mode is, in words ("a regular file", "a FIFO", ...)."""
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def dir_problem(st: os.stat_result) -> str | None:
    """Return why a directory (its stat) is not trusted, or None."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o}, no sticky bit)"
    return None


def file_problem(st: os.stat_result) -> str | None:
    """Return why a file (its lstat or fstat) is not ours to read or replace, or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"is {kind_of(st.st_mode)}, not a regular file (never followed, read or replaced)"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private_dirs(path: Path) -> None:
    """Create `path` and its missing parents, each 0700 whatever the umask; leave existing ones as they are."""
    path = Path(os.path.abspath(path))
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile (another process of ours, or someone else: checked where used)
        # The umask may have taken bits away (never added any): set 0700 on what we just made,
        # through a descriptor that refuses a link swapped in since.
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, DIR_MODE)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _directory(path: Path, what: str) -> Iterator[int]:
    """Yield a descriptor of directory `path`, or raise UntrustedPath when it is not trusted."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        problem = dir_problem(os.fstat(fd))
        if problem is not None:
            raise UntrustedPath(
                errno.EPERM,
                f"not using the {what} directory {path}: it is {problem}; "
                f"make it owned by you with mode 700 (chmod 700 {path}) and check what is in it",
            )
        yield fd
    finally:
        os.close(fd)


def _check_name(dfd: int, name: str, path: Path, what: str) -> os.stat_result | None:
    """Return the lstat of `name` in the directory (None: absent); UntrustedPath when it is not ours."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    problem = file_problem(st)
    if problem is not None:
        raise UntrustedPath(errno.EPERM, f"not using the {what} {path}: it {problem}")
    return st


def write_json(path: Path, payload: dict, what: str = "file") -> None:
    """Write `payload` to `path` atomically, owner-only (the one writer of this library's JSON files)."""
    # A new 0600 file (O_EXCL, random name) in the same trusted directory, renamed over `path` only
    # when that is absent or a regular file of ours; removed on any failure.
    path = Path(path)
    with _directory(path.parent, what) as dfd:
        tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dfd)
        try:
            with os.fdopen(fd, "w") as handle:
                os.fchmod(handle.fileno(), FILE_MODE)  # whatever the umask
                json.dump(payload, handle, indent=2, sort_keys=True)
            _check_name(dfd, path.name, path, what)  # still absent or ours, right before the rename
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise


def read_json(path: Path, what: str = "file") -> object | None:
    """Return the JSON in `path` (None: absent); UntrustedPath when not trusted, ValueError when not JSON."""
    path = Path(path)
    try:
        with _directory(path.parent, what) as dfd:
            before = _check_name(dfd, path.name, path, what)
            if before is None:
                return None
            fd = os.open(path.name, os.O_RDONLY | _OPEN, dir_fd=dfd)
            with os.fdopen(fd, "rb") as handle:
                st = os.fstat(handle.fileno())
                problem = file_problem(st)
                if problem is None and (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                    problem = "was replaced while being opened"
                if problem is not None:
                    raise UntrustedPath(errno.EPERM, f"not using the {what} {path}: it {problem}")
                text = handle.read().decode()
    except FileNotFoundError:
        return None
    return json.loads(text)


@contextlib.contextmanager
def locked(path: Path, what: str = "lock file", timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file `path` (LockTimeout past `timeout_s`)."""
    # Created 0600 in a trusted directory; an existing one must be a regular file of ours (one made
    # 0666 under an old umask is set to 0600: only who can replace a lock file matters).
    path = Path(path)
    with _directory(path.parent, what) as dfd:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):  # never opened: a device may act on open
                raise UntrustedPath(errno.EPERM, f"not using the {what} {path}: it {file_problem(st)}")
        fd = os.open(path.name, os.O_RDWR | os.O_CREAT | _OPEN, FILE_MODE, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise UntrustedPath(errno.EPERM, f"not using the {what} {path}: it {file_problem(st)}")
            if stat.S_IMODE(st.st_mode) != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
            _flock(fd, path, what, timeout_s)
            yield
        finally:
            os.close(fd)


@contextlib.contextmanager
def locked_directory(folder: Path, what: str = "directory", timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive advisory lock on the trusted directory `folder` itself (LockTimeout past `timeout_s`)."""
    with _directory(Path(folder), what) as dfd:
        _flock(dfd, Path(folder), f"{what} directory", timeout_s)
        yield
