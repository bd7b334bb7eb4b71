"""Each setting's parser (a ValueError says what is accepted), and the default verdict file."""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from pathlib import Path

from ..errors import capped, describe, say_once

ENV_PREFIX = "SM120_FP4_"
AUTO = "auto"
OFF = "off"
# ASCII only ([0-9], never \d): "١٢.٠" or a fullwidth "１２.０" is not a capability, whatever int() makes of it.
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*", re.ASCII)
_CAPABILITY = re.compile(r"([0-9]{1,2})\.([0-9])", re.ASCII)
_SECONDS = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_ASCII_SPACE = " \t"
# Each duration's (least, most, unit): a period of 1e-320 s overflows the scheduler's arithmetic, and
# threading refuses timeouts near 2**63 ns; a canary slice holds the serving thread (a second is too long).
_DAY_S = 86400.0
DURATIONS: dict[str, tuple[float, float, str]] = {
    "selftest_timeout": (1.0, _DAY_S, "seconds"),
    "canary": (0.1, _DAY_S, "seconds"),
    "canary_slice_ms": (0.001, 1000.0, "milliseconds"),
}


def capability_list(text: str) -> tuple[tuple[int, int], ...]:
    """Return the (major, minor) pairs of a space-separated list such as "12.0 12.1"."""
    return tuple((int(c.split(".")[0]), int(c.split(".")[1])) for c in text.split())


# What SM120_FP4_SIMULATE may pretend: the capabilities this library serves, and NVIDIA's other CUDA
# GPUs' (where SGLang is left untouched).
SERVED_CAPABILITIES = capability_list("12.0 12.1")
OTHER_CAPABILITIES = capability_list("7.0 7.2 7.5 8.0 8.6 8.7 8.9 9.0 10.0 10.1 10.3 11.0")


def _home() -> tuple[str | None, str]:
    """Return this user's home directory (absolute, not /) and its source, or (None, why not)."""
    # An empty or relative $HOME (as some service managers start processes) is not a home: the
    # password database is asked instead, as the shell does when HOME is unset.
    home = os.environ.get("HOME")
    why = "HOME is unset" if home is None else f"HOME={home!r} is not an absolute path"
    if home and os.path.isabs(home) and home.rstrip("/"):
        return home, "HOME"
    try:
        import pwd

        entry = pwd.getpwuid(os.geteuid()).pw_dir
    except (ImportError, KeyError):
        return None, f"{why}, and this user (uid {os.geteuid()}) has no entry in the password database"
    if entry and os.path.isabs(entry) and entry.rstrip("/") and os.path.isdir(entry):
        return entry, "the password database"
    gives = f"the password database gives {entry!r} for uid {os.geteuid()} (not an existing directory other than /)"
    return None, f"{why}, and {gives}"


def default_verdicts_path() -> Path | None:
    """Return the default verdict file under the XDG cache or ~/.cache, or None (warned once) without a home."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "sm120_fp4" / "verdicts.json"
    home, why = _home()
    if home is None:
        say_once(
            logging.WARNING,
            f"sm120_fp4: no verdict store: {why} (and XDG_CACHE_HOME is not an absolute path); crashes seen by "
            "`sm120-fp4 selftest` are not remembered. Set SM120_FP4_VERDICTS to a file path (or off)",
        )
        return None
    return Path(home) / ".cache" / "sm120_fp4" / "verdicts.json"


def on_filesystem(check):
    """Run a setting's filesystem check, turning OSError or ValueError into the setting's own error."""
    try:
        return check()
    except (OSError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.errno in errno.errorcode:
            reason = f"{errno.errorcode[exc.errno]}: {exc.strerror}"
        else:
            reason = f"{type(exc).__name__}: {exc}"
        raise ValueError(f"accepted: a path the filesystem can check (checking it failed with {reason})") from None


def _not_special(path: Path, accepted: str) -> None:
    """Raise ValueError when `path` exists and is not a regular file (never written, followed or replaced)."""
    from ..files import kind_of

    st = on_filesystem(lambda: os.lstat(path) if os.path.lexists(path) else None)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ValueError(
            f"accepted: {accepted} ({describe(str(path))} is {kind_of(st.st_mode)}, which is never "
            "written, followed or replaced)"
        )


def _number(value: object) -> float | None:
    """Return a setting's number from an int, float or ASCII-digit string (not "١٢", "1_000", "inf"), else None."""
    if isinstance(value, str):
        return float(value) if _SECONDS.fullmatch(value) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def duration(field: str, value: object, prefix: str = "") -> float:
    """Return duration setting `field`'s value within its DURATIONS bounds, else raise ValueError."""
    least, most, unit = DURATIONS[field]
    number = _number(value)
    if number is None or not least <= number <= most:
        raise ValueError(f"accepted: {prefix}{least:g} <= {unit} <= {most:g}, in ASCII digits")
    return number


def _capabilities(capabilities: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in capabilities)


def parse_backends(value: object) -> object:
    if value == AUTO:
        return AUTO
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError("accepted: a comma-separated list of backend names, e.g. cutlass,b12x, or auto")
    names = tuple(n.strip(_ASCII_SPACE) if isinstance(n, str) else n for n in names)
    bad = [n for n in names if not isinstance(n, str) or not _NAME.fullmatch(n)]
    if bad:
        raise ValueError(
            f"accepted: lower-case backend names (ASCII) such as cutlass,b12x,emulated; bad entries {capped(bad)}"
        )
    if len(set(names)) != len(names):
        raise ValueError("accepted: each backend named once")
    return names


def parse_simulate(value: object) -> object:
    if value is None:
        return None
    if isinstance(value, float):
        value = repr(value)  # 12.0 -> "12.0", as the variable is written; 12.05 stays ambiguous (rejected)
    # fullmatch: re's `$` also matches before a trailing newline ("12.0\n" is not a capability).
    match = _CAPABILITY.fullmatch(value) if isinstance(value, str) else None
    if not match or (int(match.group(1)), int(match.group(2))) not in SERVED_CAPABILITIES + OTHER_CAPABILITIES:
        raise ValueError(
            f"accepted: a compute capability MAJOR.MINOR the library knows: {_capabilities(SERVED_CAPABILITIES)} "
            f"(patched and verified), or another NVIDIA GPU's ({_capabilities(OTHER_CAPABILITIES)}: SGLang "
            "is left untouched, as on such a GPU)"
        )
    return value


def parse_report(value: object) -> object:
    if isinstance(value, str) and not value.strip():
        raise ValueError("accepted: a file or directory path (unset for no report)")
    if isinstance(value, (str, Path)):
        # Checked now, not when a serving worker first writes the report.
        path = Path(str(value).replace("{pid}", "0"))

        def usable() -> Path | None:
            folder = path if path.is_dir() else path.parent
            return folder if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK) else None

        if on_filesystem(usable) is None:
            raise ValueError(
                f"accepted: a file in an existing, writable directory, or such a directory "
                f"({describe(str(path.parent))} is not one)"
            )
        if not on_filesystem(path.is_dir):
            _not_special(path, "a regular file, a new path, or a directory (or a link to one)")
    return value


def parse_verdicts(value: object) -> object:
    if value is None or value == OFF:
        return value
    if isinstance(value, str) and value.strip(_ASCII_SPACE).lower() == OFF:
        # Values are lower case, as every other setting's: "OFF" is not a file named OFF.
        raise ValueError("accepted: off in lower case for no verdict store, or a file path")
    if not isinstance(value, (str, Path)) or not str(value).strip() or "\x00" in str(value):
        raise ValueError("accepted: a file path, or off (unset: the default under the user's cache directory)")
    if on_filesystem(Path(value).is_dir):
        raise ValueError(f"accepted: a file path, not a directory ({describe(str(value))} is one)")
    _not_special(Path(value), "a regular file or a new path, or off for no verdict store")
    return str(value)


def parse_canary(value: object) -> object:
    return OFF if value == OFF else duration("canary", value, "off, or the period in seconds: ")
