"""Settings: keyword arguments > ``SM120_FP4_*`` environment variables > defaults.

Every value is checked when the settings are built (``install()`` or CLI start): a bad one raises
:class:`~sm120_fp4.errors.ConfigError` naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import difflib
import errno
import logging
import os
import re
import stat
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, PrivateAttr, ValidationError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .errors import ConfigError, capped, describe
from .toggle import TOGGLE_VAR, parse_toggle

__all__ = [
    "Settings",
    "load_settings",
    "ENV_PREFIX",
    "TOGGLE_VAR",
    "env_name",
    "AUTO",
    "default_verdicts_path",
    "flashinfer_overrides",
    "flashinfer_problem",
    "check_flashinfer_env",
]

_LOG = logging.getLogger("sm120_fp4")
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


def _capability_list(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(c.split(".")[0]), int(c.split(".")[1])) for c in text.split())


# What SM120_FP4_SIMULATE may pretend: the capabilities this library serves, and NVIDIA's other CUDA
# GPUs' (where SGLang is left untouched).
SERVED_CAPABILITIES = _capability_list("12.0 12.1")
OTHER_CAPABILITIES = _capability_list("7.0 7.2 7.5 8.0 8.6 8.7 8.9 9.0 10.0 10.1 10.3 11.0")
_ignored_logged: set[str] = set()


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
    return (
        None,
        f"{why}, and the password database gives {entry!r} for uid {os.geteuid()} (not an existing directory other than /)",
    )


def default_verdicts_path() -> Path | None:
    """Return the default verdict file under the XDG cache or ~/.cache, or None (warned once) without a home."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "sm120_fp4" / "verdicts.json"
    home, why = _home()
    if home is None:
        _warn_once(
            f"sm120_fp4: no verdict store: {why} (and XDG_CACHE_HOME is not an absolute path); crashes seen by "
            "`sm120-fp4 selftest` are not remembered. Set SM120_FP4_VERDICTS to a file path (or off)"
        )
        return None
    return Path(home) / ".cache" / "sm120_fp4" / "verdicts.json"


def _warn_once(message: str) -> None:
    if message not in _ignored_logged:
        _ignored_logged.add(message)
        _LOG.warning("%s", message)


def _filesystem(check, value: object):
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
    from .files import kind_of

    st = _filesystem(lambda: os.lstat(path) if os.path.lexists(path) else None, str(path))
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


def _duration(field: str, value: object, prefix: str = "") -> float:
    """Return duration setting `field`'s value within its DURATIONS bounds, else raise ValueError."""
    least, most, unit = DURATIONS[field]
    number = _number(value)
    if number is None or not least <= number <= most:
        raise ValueError(f"accepted: {prefix}{least:g} <= {unit} <= {most:g}, in ASCII digits")
    return number


def _capabilities(capabilities: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{major}.{minor}" for major, minor in capabilities)


def _parse_backends(value: object) -> object:
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


def _parse_simulate(value: object) -> object:
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


def _parse_report(value: object) -> object:
    if isinstance(value, str) and not value.strip():
        raise ValueError("accepted: a file or directory path (unset for no report)")
    if isinstance(value, (str, Path)):
        # Checked now, not when a serving worker first writes the report.
        path = Path(str(value).replace("{pid}", "0"))

        def usable() -> Path | None:
            folder = path if path.is_dir() else path.parent
            return folder if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK) else None

        if _filesystem(usable, value) is None:
            raise ValueError(
                f"accepted: a file in an existing, writable directory, or such a directory "
                f"({describe(str(path.parent))} is not one)"
            )
        if not _filesystem(path.is_dir, value):
            _not_special(path, "a regular file, a new path, or a directory (or a link to one)")
    return value


def _parse_verdicts(value: object) -> object:
    if value is None or value == OFF:
        return value
    if isinstance(value, str) and value.strip(_ASCII_SPACE).lower() == OFF:
        # Values are lower case, as every other setting's: "OFF" is not a file named OFF.
        raise ValueError("accepted: off in lower case for no verdict store, or a file path")
    if not isinstance(value, (str, Path)) or not str(value).strip() or "\x00" in str(value):
        raise ValueError("accepted: a file path, or off (unset: the default under the user's cache directory)")
    if _filesystem(Path(value).is_dir, value):
        raise ValueError(f"accepted: a file path, not a directory ({describe(str(value))} is one)")
    _not_special(Path(value), "a regular file or a new path, or off for no verdict store")
    return str(value)


# Each parser runs on the raw value, before pydantic's own type check.
_Backends = Annotated[tuple[str, ...] | Literal["auto"], NoDecode, BeforeValidator(_parse_backends)]


def _canary(value: object) -> object:
    return OFF if value == OFF else _duration("canary", value, "off, or the period in seconds: ")


class Settings(BaseSettings):
    """Everything the library can be told; see README for the table of variables."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, extra="forbid", frozen=True, populate_by_name=True
    )

    toggle: Annotated[bool | None, BeforeValidator(parse_toggle)] = Field(
        None,
        validation_alias=AliasChoices("toggle", TOGGLE_VAR),
        description="Master switch for deployment manifests: 1 or on activates in every process, 0 or off makes every install a no-op.",
    )
    enable: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: patch only where a 12.x GPU is visible; on: patch on any GPU; off: never patch."
    )
    backends: _Backends = Field(
        AUTO,
        description="Ordered candidate backends (FlashInfer names, humming, emulated, or registered names), comma-separated; "
        "auto: the order known to work for each GPU's compute capability (docs/operations.md).",
    )
    moe_backends: _Backends = Field(
        AUTO,
        description="Ordered candidate NVFP4 fused-MoE backends (FlashInfer's cutlass, humming, emulated, or names registered with "
        "register_moe), comma-separated; auto: cutlass, then humming on 12.x (docs/operations.md).",
    )
    moe_fallback: Literal["none", "emulated"] = Field(
        "none", description="emulated: serve NVFP4 MoE layers with the slow pure-PyTorch emulation instead of refusing."
    )
    selftest: Literal["strict", "warn", "off"] = Field(
        "strict",
        description="strict: refuse to serve when no backend verifies; warn: log and serve; off: skip the test.",
    )
    fallback: Literal["none", "emulated"] = Field(
        "none", description="emulated: serve with the slow pure-PyTorch emulation instead of refusing."
    )
    unsupported_release: Literal["refuse", "serve-unverified"] = Field(
        "refuse",
        description="An SGLang release outside the range this library supports, with the library asked for on a 12.x "
        "GPU (nothing of SGLang is patched or verified there): refuse: `launch` and `selftest` refuse to start (exit 2) "
        "under SELFTEST=strict, and say so with exit 3 otherwise; serve-unverified: `launch` starts the server anyway, "
        "its NVFP4 layers served unverified (docs/operations.md).",
    )
    selftest_timeout: Annotated[float, BeforeValidator(lambda v: _duration("selftest_timeout", v))] = Field(
        900.0,
        description="Seconds one candidate's whole self-test may take (a first FlashInfer call JIT-compiles for minutes); past it the candidate is rejected as hung.",
    )
    select: Literal["first", "fastest"] = Field(
        "first",
        description="first: the first candidate that verifies; fastest: time every verified candidate (the self-test's shapes, then each layer configuration's served calls at its serving batch sizes), take the fastest.",
    )
    simulate: Annotated[str | None, BeforeValidator(_parse_simulate)] = Field(
        None,
        description="Pretend every device has this capability (e.g. 12.0); supplies a CPU device when there is no GPU.",
    )
    report: Annotated[Path | None, BeforeValidator(_parse_report)] = Field(
        None,
        description="Write the JSON report here: one file merging every process of the run ({pid} is replaced; a directory, "
        "or a link to one, gets one file per process); a regular file or a new path, never a device, FIFO or link (docs/operations.md).",
    )
    verdicts: Annotated[str | None, BeforeValidator(_parse_verdicts)] = Field(
        None,
        description="The verdict file `sm120-fp4 selftest`/`launch` record each candidate's outcome in (crashes included) "
        "and workers read to skip a candidate that crashed; unset: $XDG_CACHE_HOME/sm120_fp4/verdicts.json "
        "(~/.cache/...; none without a home directory); off: none. Owner-only, and never read or written where another "
        "user could change it (docs/operations.md).",
    )
    canary: Annotated[float | Literal["off"], BeforeValidator(_canary)] = Field(
        OFF,
        description="The serving canary: off, or a period in seconds; every period each scheduler re-verifies one "
        "verified layer configuration per kernel (dense, MoE), one run per idle point (docs/operations.md).",
    )
    canary_action: Literal["exit", "log"] = Field(
        "exit",
        description="What a canary failure does: exit (write the refusal to the report and the log, stop the process "
        "non-zero so an orchestrator restarts it) or log (log once per configuration, count it, keep serving).",
    )
    canary_slice_ms: Annotated[float, BeforeValidator(lambda v: _duration("canary_slice_ms", v))] = Field(
        5.0,
        description="Milliseconds of GPU time one canary run may hold the serving thread at an idle point: a run "
        "over it caps its configuration's larger batch sizes below the one it checked (listed in status); the "
        "smallest decode and larger sizes always run.",
    )
    _report_is_dir: bool = PrivateAttr(False)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(exc, values) from None

    def model_post_init(self, context: Any) -> None:
        # Whether the report names a directory is fixed now: if it disappears later, the writer warns
        # instead of creating a file at the directory's name.
        if self.report is not None:
            path = Path(str(self.report).replace("{pid}", "0"))
            self._report_is_dir = bool(_filesystem(path.is_dir, self.report))

    @property
    def report_is_dir(self) -> bool:
        """Return whether the report named a directory (or a link to one) when the settings were read."""
        return self._report_is_dir

    @property
    def verdicts_path(self) -> Path | None:
        """Return the verdict file, or None when SM120_FP4_VERDICTS=off."""
        if self.verdicts == OFF:
            return None
        return Path(self.verdicts) if self.verdicts is not None else default_verdicts_path()

    @property
    def canary_period(self) -> float | None:
        """Return the serving canary's period in seconds, or None when SM120_FP4_CANARY=off."""
        return None if self.canary == OFF else float(self.canary)

    @property
    def simulated_capability(self) -> tuple[int, int] | None:
        return None if self.simulate is None else _capability_list(self.simulate)[0]

    @property
    def active(self) -> bool:
        """Return False when the master toggle or ENABLE switches the library off."""
        return self.toggle is not False and self.enable != OFF


def env_name(field: str) -> str:
    """Return the environment variable that sets `field`."""
    return TOGGLE_VAR if field == "toggle" else ENV_PREFIX + field.upper()


def _config_error(exc: ValidationError, kwargs: dict[str, Any]) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = str(err["loc"][0]) if err["loc"] else "?"
        field = "toggle" if loc == TOGGLE_VAR else loc
        if field not in Settings.model_fields:
            close = difflib.get_close_matches(field, list(Settings.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown setting {field!r}{hint}; accepted: {', '.join(Settings.model_fields)}")
            continue
        where = f"keyword {field}=" if field in kwargs else f"{env_name(field)}="
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}{_shown(err.get('input'))} is not accepted; {msg}")
    return ConfigError("invalid sm120_fp4 settings:\n  " + "\n  ".join(lines))


def _shown(value: object, limit: int = 200) -> str:
    """Return a rejected value's repr, cut at `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _check_unknown_env(environ: dict[str, str]) -> None:
    known = {env_name(f) for f in Settings.model_fields}
    # Names are upper case: pydantic would read sm120_fp4_selftest too, but the start-up bootstrap
    # and spawned workers read SM120_FP4 exactly, so a wrong-case name is an error, not a synonym.
    unknown = sorted(
        k for k in environ if (k.upper().startswith(ENV_PREFIX) or k.upper() == TOGGLE_VAR) and k not in known
    )
    if not unknown:
        return
    hints = []
    for name in unknown[:8]:
        upper = name.upper()
        close = [upper] if upper in known else difflib.get_close_matches(upper, sorted(known), n=1)
        hints.append(f"{name}={_shown(environ[name])}" + (f" (did you mean {close[0]}?)" if close else ""))
    more = f", and {len(unknown) - 8} more" if len(unknown) > 8 else ""
    raise ConfigError(
        f"unknown sm120_fp4 environment variable(s): {', '.join(hints)}{more}; accepted: {', '.join(sorted(known))}"
    )


# FlashInfer's fp4_quantize and cutlass_fused_moe read FLASHINFER_NVFP4_* knobs (4over6 block scales, scales
# clamped at 256) when called as SGLang calls them; the oracle models the standard recipe only, so any such
# name (a future one too) makes results unverifiable. The quantizer's launch knobs change how the same recipe
# runs, not the recipe, and every check runs with them set.
FLASHINFER_PREFIX = "FLASHINFER_NVFP4_"
FLASHINFER_LAUNCH_KNOBS = frozenset({"FLASHINFER_NVFP4_PER_TOKEN_THREADS", "FLASHINFER_NVFP4_QUANTIZE_USE_TMA"})


def flashinfer_overrides(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Return every FLASHINFER_NVFP4_* variable set that may change FlashInfer's FP4 recipe, by name."""
    environ = os.environ if environ is None else environ
    return {
        k: environ[k]
        for k in sorted(environ)
        if k.upper().startswith(FLASHINFER_PREFIX) and k.upper() not in FLASHINFER_LAUNCH_KNOBS
    }


def flashinfer_problem(environ: dict[str, str] | None = None) -> str | None:
    """Return why FlashInfer's FP4 results cannot be verified in this environment, or None."""
    found = flashinfer_overrides(environ)
    if not found:
        return None
    shown = ", ".join(f"{k}={_shown(v, 60)}" for k, v in found.items())
    return (
        f"{shown} set: this changes FlashInfer's FP4 quantization recipe (fp4_quantize, the activation quantizer "
        f"SGLang calls, and cutlass_fused_moe read the {FLASHINFER_PREFIX}* variables: 4over6 block scales, block "
        "scales clamped at 256), which this library's oracle does not model, so no NVFP4 result could be verified; "
        f"unset {', '.join(found)} (or turn this library off: {TOGGLE_VAR}=0)"
    )


def check_flashinfer_env(environ: dict[str, str] | None = None) -> None:
    """Raise ConfigError where FlashInfer's own NVFP4 knobs are set."""
    problem = flashinfer_problem(environ)
    if problem is not None:
        raise ConfigError(f"sm120_fp4 cannot verify FlashInfer's FP4 results here: {problem}")


def _toggled_off(overrides: dict[str, Any]) -> bool:
    """Return whether the master toggle (keyword toggle, else env SM120_FP4) is off."""
    raw = overrides["toggle"] if "toggle" in overrides else os.environ.get(TOGGLE_VAR)
    try:
        return parse_toggle(raw) is False
    except ValueError:
        return False  # garbage in the toggle itself: named by the full validation


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from keyword overrides and the environment, rejecting unknown variables."""
    # Off means off: with the toggle off every other setting is ignored (logged once), so that the
    # refusal's own advice ("turn this library off: SM120_FP4=0") always works.
    if _toggled_off(overrides):
        try:
            _check_unknown_env(dict(os.environ))
            Settings(**overrides)
        except ConfigError as exc:
            _warn_once(f"sm120_fp4: the library is off (SM120_FP4=0); ignoring the other settings, among them: {exc}")
        return Settings.model_construct(toggle=False)
    _check_unknown_env(dict(os.environ))
    return Settings(**overrides)


def sources(settings_kwargs: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Return where each setting's value came from: 'keyword', the environment variable, or 'default'."""
    environ = os.environ if environ is None else environ
    return {
        f: "keyword" if f in settings_kwargs else f"env {env_name(f)}" if env_name(f) in environ else "default"
        for f in Settings.model_fields
    }


_ACCEPTED = {
    "toggle": "`1`, `on`, `0`, `off`",
    "backends": "`auto` or comma-separated names",
    "moe_backends": "`auto` or comma-separated names",
    "simulate": "`MAJOR.MINOR`: `12.0`, `12.1`, or another NVIDIA GPU's (7.0 to 11.0; SGLang left untouched)",
    "report": "a path",
    "verdicts": "a file path, or `off`",
    **{
        f: ("`off`, or " if f == "canary" else "")
        + f"{unit}, {least:g} <= {unit[0] if unit == 'seconds' else 'ms'} <= {most:g}"
        for f, (least, most, unit) in DURATIONS.items()
    },
}


def _accepted(field: str) -> str:
    choices = typing.get_args(Settings.model_fields[field].annotation)
    if field not in _ACCEPTED and choices and all(isinstance(c, str) for c in choices):
        return ", ".join(f"`{c}`" for c in choices)
    return _ACCEPTED.get(field, "")


def settings_table() -> str:
    """Return the README's table of every setting, generated from Settings."""
    from .tables import markdown_table

    rows = []
    for field, info in Settings.model_fields.items():
        default = info.default
        shown = "unset" if default is None else ",".join(default) if isinstance(default, tuple) else str(default)
        rows.append((f"`{env_name(field)}`", f"`{shown}`", _accepted(field), info.description))
    return "\n".join(markdown_table(("variable", "default", "accepted", "meaning"), rows))
