"""``Settings``: keyword arguments > ``SM120_FP4_*`` environment variables > defaults."""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, PrivateAttr, ValidationError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..errors import ConfigError, describe, say_once
from ..toggle import TOGGLE_VAR, parse_toggle
from . import values
from .values import AUTO, ENV_PREFIX, OFF

# Each parser runs on the raw value, before pydantic's own type check.
_Backends = Annotated[tuple[str, ...] | Literal["auto"], NoDecode, BeforeValidator(values.parse_backends)]

# What each setting means: Field descriptions, the README table's last column.
_MEANING = {
    "toggle": "Master switch for deployment manifests: 1 or on activates in every process, 0 or off makes every install a no-op.",
    "enable": "auto: patch only where a 12.x GPU is visible; on: patch on any GPU; off: never patch.",
    "backends": "Ordered candidate backends (FlashInfer names, humming, emulated, or registered names), comma-separated; auto: the order known to work for each GPU's compute capability (docs/operations.md).",
    "moe_backends": "Ordered candidate NVFP4 fused-MoE backends (FlashInfer's cutlass, humming, emulated, or names registered with register_moe), comma-separated; auto: cutlass, then humming on 12.x (docs/operations.md).",
    "moe_fallback": "emulated: serve NVFP4 MoE layers with the slow pure-PyTorch emulation instead of refusing.",
    "selftest": "strict: refuse to serve when no backend verifies; warn: log and serve; off: skip the test.",
    "fallback": "emulated: serve with the slow pure-PyTorch emulation instead of refusing.",
    "unsupported_release": "An SGLang release outside the range this library supports, with the library asked for on a 12.x GPU (nothing of SGLang is patched or verified there): refuse: `launch` and `selftest` refuse to start (exit 2) under SELFTEST=strict, and say so with exit 3 otherwise; serve-unverified: `launch` starts the server anyway, its NVFP4 layers served unverified (docs/operations.md).",
    "selftest_timeout": "Seconds one candidate's whole self-test may take (a first FlashInfer call JIT-compiles for minutes); past it the candidate is rejected as hung.",
    "select": "first: the first candidate that verifies; fastest: time every verified candidate at the served batch sizes (again after the engine's autotune), serve the fastest, or one per batch-size range where each is faster by at least 3% there.",
    "simulate": "Pretend every device has this capability (e.g. 12.0); supplies a CPU device when there is no GPU.",
    "report": "Write the JSON report here: one file merging every process of the run ({pid} is replaced; a directory, or a link to one, gets one file per process); a regular file or a new path, never a device, FIFO or link (docs/operations.md).",
    "verdicts": "The verdict file `sm120-fp4 selftest`/`launch` record each candidate's outcome in (crashes included) and workers read to skip a candidate that crashed; unset: $XDG_CACHE_HOME/sm120_fp4/verdicts.json (~/.cache/...; none without a home directory); off: none. Owner-only, and never read or written where another user could change it (docs/operations.md).",
    "canary": "The serving canary: off, or a period in seconds; every period each scheduler re-verifies one verified layer configuration per kernel (dense, MoE), one run per idle point (docs/operations.md).",
    "canary_action": "What a canary failure does: exit (write the refusal to the report and the log, stop the process non-zero so an orchestrator restarts it) or log (log once per configuration, count it, keep serving).",
    "canary_slice_ms": "Milliseconds of GPU time one canary run may hold the serving thread at an idle point: a run over it caps its configuration's larger batch sizes below the one it checked (listed in status); the smallest decode and larger sizes always run.",
}


class Settings(BaseSettings):
    """Everything the library can be told; see README for the table of variables."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, extra="forbid", frozen=True, populate_by_name=True
    )

    toggle: Annotated[bool | None, BeforeValidator(parse_toggle)] = Field(
        None, validation_alias=AliasChoices("toggle", TOGGLE_VAR), description=_MEANING["toggle"]
    )
    enable: Literal["auto", "on", "off"] = Field("auto", description=_MEANING["enable"])
    backends: _Backends = Field(AUTO, description=_MEANING["backends"])
    moe_backends: _Backends = Field(AUTO, description=_MEANING["moe_backends"])
    moe_fallback: Literal["none", "emulated"] = Field("none", description=_MEANING["moe_fallback"])
    selftest: Literal["strict", "warn", "off"] = Field("strict", description=_MEANING["selftest"])
    fallback: Literal["none", "emulated"] = Field("none", description=_MEANING["fallback"])
    unsupported_release: Literal["refuse", "serve-unverified"] = Field(
        "refuse", description=_MEANING["unsupported_release"]
    )
    selftest_timeout: Annotated[float, BeforeValidator(lambda v: values.duration("selftest_timeout", v))] = Field(
        900.0, description=_MEANING["selftest_timeout"]
    )
    select: Literal["first", "fastest"] = Field("first", description=_MEANING["select"])
    simulate: Annotated[str | None, BeforeValidator(values.parse_simulate)] = Field(
        None, description=_MEANING["simulate"]
    )
    report: Annotated[Path | None, BeforeValidator(values.parse_report)] = Field(None, description=_MEANING["report"])
    verdicts: Annotated[str | None, BeforeValidator(values.parse_verdicts)] = Field(
        None, description=_MEANING["verdicts"]
    )
    canary: Annotated[float | Literal["off"], BeforeValidator(values.parse_canary)] = Field(
        OFF, description=_MEANING["canary"]
    )
    canary_action: Literal["exit", "log"] = Field("exit", description=_MEANING["canary_action"])
    canary_slice_ms: Annotated[float, BeforeValidator(lambda v: values.duration("canary_slice_ms", v))] = Field(
        5.0, description=_MEANING["canary_slice_ms"]
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
            self._report_is_dir = bool(values.on_filesystem(path.is_dir))

    @property
    def report_is_dir(self) -> bool:
        """Return whether the report named a directory (or a link to one) when the settings were read."""
        return self._report_is_dir

    @property
    def verdicts_path(self) -> Path | None:
        """Return the verdict file, or None when SM120_FP4_VERDICTS=off."""
        if self.verdicts == OFF:
            return None
        return Path(self.verdicts) if self.verdicts is not None else values.default_verdicts_path()

    @property
    def canary_period(self) -> float | None:
        """Return the serving canary's period in seconds, or None when SM120_FP4_CANARY=off."""
        return None if self.canary == OFF else float(self.canary)

    @property
    def simulated_capability(self) -> tuple[int, int] | None:
        return None if self.simulate is None else values.capability_list(self.simulate)[0]

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
        lines.append(f"{where}{describe(err.get('input'), 200)} is not accepted; {msg}")
    return ConfigError("invalid sm120_fp4 settings:\n  " + "\n  ".join(lines))


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
        hints.append(f"{name}={describe(environ[name], 200)}" + (f" (did you mean {close[0]}?)" if close else ""))
    more = f", and {len(unknown) - 8} more" if len(unknown) > 8 else ""
    raise ConfigError(
        f"unknown sm120_fp4 environment variable(s): {', '.join(hints)}{more}; accepted: {', '.join(sorted(known))}"
    )


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
            ignored = f"sm120_fp4: the library is off (SM120_FP4=0); ignoring the other settings, among them: {exc}"
            say_once(logging.WARNING, ignored)
        return Settings.model_construct(toggle=False)
    _check_unknown_env(dict(os.environ))
    return Settings(**overrides)


def sources(settings_kwargs: dict[str, Any]) -> dict[str, str]:
    """Return where each setting's value came from: 'keyword', the environment variable, or 'default'."""
    return {
        f: "keyword" if f in settings_kwargs else f"env {env_name(f)}" if env_name(f) in os.environ else "default"
        for f in Settings.model_fields
    }
