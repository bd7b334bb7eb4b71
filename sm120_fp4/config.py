"""Settings: keyword arguments > ``SM120_FP4_*`` environment variables > defaults.

Every value is checked when the settings are built (at ``install()`` or CLI start), never at the
first request: a bad value raises :class:`~sm120_fp4.errors.ConfigError` naming the variable, the
value and what is accepted. Values are case-sensitive, lower case, as documented.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .bootstrap import TOGGLE_VAR, parse_toggle
from .errors import ConfigError

__all__ = ["Settings", "load_settings", "ENV_PREFIX", "TOGGLE_VAR", "env_name"]

ENV_PREFIX = "SM120_FP4_"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_CAPABILITY = re.compile(r"^(\d{1,2})\.(\d)$")


class Settings(BaseSettings):
    """Everything the library can be told; see README for the table of variables."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, extra="forbid", frozen=True, populate_by_name=True
    )

    toggle: bool | None = Field(
        None,
        validation_alias=AliasChoices("toggle", TOGGLE_VAR),
        description="Master switch for deployment manifests: 1 or on activates in every process, 0 or off makes every install a no-op.",
    )
    enable: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: patch only where a 12.x GPU is visible; on: patch on any GPU; off: never patch."
    )
    backends: Annotated[tuple[str, ...], NoDecode] = Field(
        ("cutlass", "b12x"),
        description="Ordered candidate backends (FlashInfer names, emulated, or registered names), comma-separated.",
    )
    moe_backends: Annotated[tuple[str, ...], NoDecode] = Field(
        ("cutlass",),
        description="Ordered candidate NVFP4 fused-MoE backends (FlashInfer's cutlass, emulated, or names registered with register_moe), comma-separated.",
    )
    moe_fallback: Literal["none", "emulated"] = Field(
        "none", description="emulated: serve NVFP4 MoE layers with the slow pure-PyTorch emulation instead of refusing."
    )
    selftest: Literal["strict", "warn", "off"] = Field(
        "strict", description="strict: refuse to serve when no backend verifies; warn: log and serve; off: skip the test."
    )
    fallback: Literal["none", "emulated"] = Field(
        "none", description="emulated: serve with the slow pure-PyTorch emulation instead of refusing."
    )
    selftest_timeout: float = Field(
        900.0,
        description="Seconds one candidate's whole self-test may take (a first FlashInfer call JIT-compiles for minutes); past it the candidate is rejected as hung.",
    )
    select: Literal["first", "fastest"] = Field(
        "first", description="first: the first candidate that verifies; fastest: time every verified candidate, take the fastest."
    )
    simulate: str | None = Field(
        None, description="Pretend every device has this capability (e.g. 12.0); supplies a CPU device when there is no GPU."
    )
    report: Path | None = Field(
        None, description="Write this process's JSON report here ({pid} is replaced; a directory gets one file per process)."
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(exc, values) from None

    @field_validator("toggle", mode="before")
    @classmethod
    def _parse_toggle(cls, value: object) -> object:
        return parse_toggle(value)

    @field_validator("backends", "moe_backends", mode="before")
    @classmethod
    def _parse_backends(cls, value: object) -> object:
        names = value.split(",") if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not names:
            raise ValueError("accepted: a comma-separated list of backend names, e.g. cutlass,b12x")
        names = tuple(n.strip() if isinstance(n, str) else n for n in names)
        bad = [n for n in names if not isinstance(n, str) or not _NAME.fullmatch(n)]
        if bad:
            raise ValueError(f"accepted: lower-case backend names such as cutlass,b12x,emulated; bad entries {bad}")
        if len(set(names)) != len(names):
            raise ValueError("accepted: each backend named once")
        return names

    @field_validator("selftest_timeout", mode="before")
    @classmethod
    def _parse_timeout(cls, value: object) -> object:
        try:
            seconds = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        except ValueError:
            seconds = None
        if isinstance(value, str) and not value.isascii():
            seconds = None
        if seconds is None or not 0 < seconds < float("inf"):
            raise ValueError("accepted: a positive number of seconds, e.g. 900")
        return seconds

    @field_validator("simulate", mode="before")
    @classmethod
    def _parse_simulate(cls, value: object) -> object:
        if value is None:
            return None
        # fullmatch: re's `$` also matches before a trailing newline ("12.0\n" is not a capability).
        match = _CAPABILITY.fullmatch(value) if isinstance(value, str) else None
        if not match or not 1 <= int(match.group(1)) <= 99:
            raise ValueError("accepted: a compute capability MAJOR.MINOR such as 12.0 or 12.1")
        return value

    @field_validator("report", mode="before")
    @classmethod
    def _parse_report(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            raise ValueError("accepted: a file or directory path (unset for no report)")
        if isinstance(value, (str, Path)):
            # Checked now, not when the first decision writes the report in a serving worker.
            path = Path(str(value).replace("{pid}", "0"))
            folder = path if path.is_dir() else path.parent
            if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                raise ValueError(f"accepted: a file in an existing, writable directory, or such a directory ({folder} is not one)")
        return value

    @property
    def simulated_capability(self) -> tuple[int, int] | None:
        if self.simulate is None:
            return None
        major, minor = self.simulate.split(".")
        return int(major), int(minor)

    @property
    def active(self) -> bool:
        """False when the master toggle or ENABLE switches the library off."""
        return self.toggle is not False and self.enable != "off"


def env_name(field: str) -> str:
    """The environment variable that sets `field`."""
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
        lines.append(f"{where}{err.get('input')!r} is not accepted; {msg}")
    return ConfigError("invalid sm120_fp4 settings:\n  " + "\n  ".join(lines))


def _check_unknown_env(environ: dict[str, str]) -> None:
    known = {env_name(f) for f in Settings.model_fields}
    # Names are upper case: pydantic would read sm120_fp4_selftest too, but the start-up bootstrap
    # and spawned workers read SM120_FP4 exactly, so a wrong-case name is an error, not a synonym.
    unknown = sorted(
        k for k in environ if (k.upper().startswith(ENV_PREFIX) or k.upper() == TOGGLE_VAR) and k not in known
    )
    if unknown:
        hints = []
        for name in unknown:
            close = [name.upper()] if name.upper() in known else difflib.get_close_matches(name.upper(), sorted(known), n=1)
            hints.append(f"{name}={environ[name]!r}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError(
            "unknown sm120_fp4 environment variable(s): " + ", ".join(hints) + "; accepted: " + ", ".join(sorted(known))
        )


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from keyword overrides and the environment, rejecting unknown variables."""
    _check_unknown_env(dict(os.environ))
    return Settings(**overrides)


def sources(settings_kwargs: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Where each setting's value came from: 'keyword', the environment variable, or 'default'."""
    environ = os.environ if environ is None else environ
    out = {}
    for field in Settings.model_fields:
        if field in settings_kwargs:
            out[field] = "keyword"
        elif env_name(field) in environ:
            out[field] = f"env {env_name(field)}"
        else:
            out[field] = "default"
    return out


def _accepted(field: str) -> str:
    import typing

    annotation = Settings.model_fields[field].annotation
    choices = [a for a in typing.get_args(annotation) if a is not type(None)]
    if field == "toggle":
        return "`1`, `on`, `0`, `off`"
    if choices and all(isinstance(c, str) for c in choices):
        return ", ".join(f"`{c}`" for c in choices)
    return {"backends": "comma-separated names", "moe_backends": "comma-separated names", "simulate": "`MAJOR.MINOR`, e.g. `12.0`", "report": "a path",
            "selftest_timeout": "seconds > 0"}.get(field, "")


def settings_table() -> str:
    """The README's table of every setting, generated from Settings (a test keeps README in sync)."""
    rows = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for field, info in Settings.model_fields.items():
        default = info.default
        shown = "unset" if default is None else ",".join(default) if isinstance(default, tuple) else str(default)
        rows.append(f"| `{env_name(field)}` | `{shown}` | {_accepted(field)} | {info.description} |")
    return "\n".join(rows)
