"""Settings: keyword > environment > default, every value checked when read, errors that name the
variable (or keyword), the value and what is accepted."""

from __future__ import annotations

import pytest
from helpers.cases import case
from helpers.common import SIM, SIM_ENV, assert_not_patched

import sm120_fp4
from sm120_fp4.config import Settings, env_name, load_settings, sources
from sm120_fp4.errors import ConfigError


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """install() is the entry point under test: SGLang starts and ends unpatched."""


# ---- precedence and the parsed values ----------------------------------------------------------


def test_defaults_when_nothing_is_set():
    s = load_settings()
    assert (s.toggle, s.enable, s.backends, s.selftest, s.fallback, s.select, s.simulate, s.report) == (
        None,
        "auto",
        "auto",
        "strict",
        "none",
        "first",
        None,
        None,
    )
    assert s.active and s.simulated_capability is None


def test_a_keyword_beats_the_environment_which_beats_the_default(monkeypatch):
    monkeypatch.setenv("SM120_FP4_SELECT", "fastest")
    monkeypatch.setenv("SM120_FP4_BACKENDS", "b12x, emulated")
    s = load_settings(select="first")
    assert s.select == "first" and s.backends == ("b12x", "emulated")  # names are stripped
    assert sources({"select": "first"})["select"] == "keyword"
    assert sources({})["backends"] == "env SM120_FP4_BACKENDS" and sources({})["fallback"] == "default"


@pytest.mark.parametrize(
    "value, toggle", [("1", True), ("on", True), ("0", False), ("off", False), (1, True), (0, False)]
)
def test_the_toggle_accepts_exactly_1_on_0_off(value, toggle):
    s = Settings(toggle=value)
    assert s.toggle is toggle and s.active is toggle


def test_enable_off_or_toggle_off_makes_the_settings_inactive(monkeypatch):
    assert not Settings(enable="off").active
    monkeypatch.setenv("SM120_FP4", "0")
    assert not load_settings().active


def test_the_canary_is_off_by_default_or_a_period_in_seconds():
    s = load_settings()
    assert (s.canary, s.canary_period, s.canary_action, s.canary_slice_ms) == ("off", None, "exit", 5.0)
    s = Settings(canary="0.5", canary_action="log", canary_slice_ms="2.5")
    assert (s.canary_period, s.canary_action, s.canary_slice_ms) == (0.5, "log", 2.5)


def test_simulate_is_parsed_into_a_capability():
    assert Settings(simulate="12.1").simulated_capability == (12, 1)
    assert Settings(simulate="9.0").simulated_capability == (9, 0)


def test_report_may_be_a_directory_or_a_file_with_pid(tmp_path):
    assert Settings(report=str(tmp_path)).report == tmp_path
    assert str(Settings(report=str(tmp_path / "r-{pid}.json")).report).endswith("r-{pid}.json")


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(Exception):
        s.select = "fastest"


def test_env_name_of_each_field():
    assert env_name("toggle") == "SM120_FP4" and env_name("selftest") == "SM120_FP4_SELFTEST"


# ---- garbage: an error at install(), nothing patched (reliability, issue item 1) --------------

# (variable, garbage value, a piece of what is accepted that the error must show)
ENV_GARBAGE = [
    ("SM120_FP4", "yes", "1, on, 0, off"),
    ("SM120_FP4", "ON", "1, on, 0, off"),
    ("SM120_FP4", "", "1, on, 0, off"),
    ("SM120_FP4_ENABLE", "On", "'auto', 'on' or 'off'"),
    ("SM120_FP4_ENABLE", " on", "'auto', 'on' or 'off'"),
    ("SM120_FP4_ENABLE", "", "'auto', 'on' or 'off'"),
    ("SM120_FP4_SELFTEST", "STRICT", "'strict', 'warn' or 'off'"),
    ("SM120_FP4_SELFTEST", "1", "'strict', 'warn' or 'off'"),
    ("SM120_FP4_FALLBACK", "cutlass", "'none' or 'emulated'"),
    ("SM120_FP4_SELECT", "fast", "'first' or 'fastest'"),
    ("SM120_FP4_BACKENDS", "", "lower-case backend names"),
    ("SM120_FP4_BACKENDS", "Cutlass", "lower-case backend names"),
    ("SM120_FP4_BACKENDS", "cutlass,,b12x", "lower-case backend names"),
    ("SM120_FP4_BACKENDS", "cutlass,cutlass", "each backend named once"),
    ("SM120_FP4_BACKENDS", "cutlas", "known: cutlass"),
    ("SM120_FP4_SIMULATE", "12", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "twelve", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "12.0.1", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "12.0\n", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "0.0", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "100.0", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "-12.0", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "\u0661\u0662.\u0660", "MAJOR.MINOR"),  # Arabic-Indic digits
    ("SM120_FP4_SIMULATE", "\uff11\uff12.\uff10", "MAJOR.MINOR"),  # fullwidth digits
    ("SM120_FP4_SELFTEST_TIMEOUT", "\u0661\u0660", "ASCII digits"),
    ("SM120_FP4_SELFTEST_TIMEOUT", "1_000", "ASCII digits"),
    ("SM120_FP4_SELFTEST_TIMEOUT", " 9", "ASCII digits"),
    ("SM120_FP4_SELFTEST_TIMEOUT", "inf", "ASCII digits"),
    ("SM120_FP4_SELFTEST_TIMEOUT", "1e300", "<= 86400"),
    ("SM120_FP4_SELFTEST_TIMEOUT", "0.5", "1 <= seconds <= 86400"),
    ("SM120_FP4_SELFTEST_TIMEOUT", "1e-320", "1 <= seconds <= 86400"),
    ("SM120_FP4_BACKENDS", "cutlass\u2003", "lower-case backend names"),  # a Unicode space is not stripped
    ("SM120_FP4_REPORT", "/tmp/" + "x" * 300 + "/r.json", "ENAMETOOLONG"),
    ("SM120_FP4_REPORT", "/tmp/" + "x" * 300, "ENAMETOOLONG"),
    ("SM120_FP4_VERDICTS", "", "a file path"),
    ("SM120_FP4_VERDICTS", "/tmp", "not a directory"),
    ("SM120_FP4_REPORT", "", "a file or directory path"),
    ("SM120_FP4_REPORT", "/nonexistent-sm120/report.json", "existing, writable directory"),
    ("SM120_FP4_CANARY", "on", "off, or the period in seconds"),
    ("SM120_FP4_CANARY", "0", "off, or the period in seconds"),
    ("SM120_FP4_CANARY", "60s", "off, or the period in seconds"),
    ("SM120_FP4_CANARY", "1e6", "0.1 <= seconds <= 86400"),
    ("SM120_FP4_CANARY", "1e-320", "0.1 <= seconds <= 86400"),
    ("SM120_FP4_CANARY", "0.01", "0.1 <= seconds <= 86400"),
    ("SM120_FP4_CANARY_ACTION", "raise", "'exit' or 'log'"),
    ("SM120_FP4_CANARY_SLICE_MS", "0", "0.001 <= milliseconds <= 1000"),
    ("SM120_FP4_CANARY_SLICE_MS", "1e-9", "0.001 <= milliseconds <= 1000"),
    ("SM120_FP4_CANARY_SLICE_MS", "5000", "0.001 <= milliseconds <= 1000"),
    ("SM120_FP4_SELFTES", "strict", "did you mean SM120_FP4_SELFTEST"),
    ("sm120_fp4_selftest", "off", "did you mean SM120_FP4_SELFTEST"),
    ("Sm120_Fp4", "1", "did you mean SM120_FP4"),
]


@case(
    "configuration",
    "env {variable}={value} at install()",
    "ConfigError naming the variable, the value and what is accepted; nothing patched",
)
@pytest.mark.parametrize("variable, value, accepted", ENV_GARBAGE, ids=[f"{v}={x[:40]!r}" for v, x, _ in ENV_GARBAGE])
def test_garbage_in_an_environment_variable_is_an_error_at_install(monkeypatch, variable, value, accepted):
    monkeypatch.setenv(variable, value)
    if variable != "SM120_FP4_SIMULATE":
        for name, setting in SIM_ENV.items():
            if name != variable:
                monkeypatch.setenv(name, setting)
    with pytest.raises(ConfigError) as err:
        sm120_fp4.install()
    message = str(err.value)
    assert variable in message and repr(value)[:150] in message and accepted in message, message
    assert not sm120_fp4.status().installed
    assert_not_patched()


FLASHINFER_KNOBS = [
    ("FLASHINFER_NVFP4_4OVER6", "1"),
    ("FLASHINFER_NVFP4_4OVER6_E4M3_USE_256", "1"),
    ("FLASHINFER_NVFP4_4OVER6_ERR_MODE", "MSE"),
    ("FLASHINFER_NVFP4_4OVER6_ERR_USE_FAST_MATH", "true"),
    ("FLASHINFER_NVFP4_SCALE_RECIPE", "anything"),  # a knob of a later FlashInfer: the same refusal
]


@case(
    "configuration",
    "FlashInfer's own FP4 knob {variable}={value} set at install()",
    "ConfigError naming the variable and its value, saying it changes FlashInfer's FP4 quantization recipe "
    "and to unset it; nothing patched; status() shows the variable",
)
@pytest.mark.parametrize("variable, value", FLASHINFER_KNOBS, ids=[v for v, _ in FLASHINFER_KNOBS])
def test_flashinfer_fp4_knobs_are_refused_at_install_naming_the_variable(monkeypatch, variable, value):
    for name, setting in SIM_ENV.items():
        monkeypatch.setenv(name, setting)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        sm120_fp4.install()
    message = str(err.value)
    assert f"{variable}={value!r}" in message and "changes FlashInfer's FP4 quantization recipe" in message, message
    assert f"unset {variable}" in message and "SM120_FP4=0" in message
    status = sm120_fp4.status()
    assert not status.installed and status.flashinfer_overrides == {variable: value}
    assert_not_patched()
    monkeypatch.delenv(variable)
    assert sm120_fp4.install().installed and sm120_fp4.status().flashinfer_overrides == {}


@case(
    "configuration",
    "FlashInfer's quantizer launch knob {variable}={value} set at install()",
    "installed: it changes how the standard recipe runs, not the recipe, and every check runs with it set",
)
@pytest.mark.parametrize(
    "variable, value", [("FLASHINFER_NVFP4_PER_TOKEN_THREADS", "64"), ("FLASHINFER_NVFP4_QUANTIZE_USE_TMA", "1")]
)
def test_flashinfer_launch_knobs_are_verified_not_refused(monkeypatch, variable, value):
    for name, setting in SIM_ENV.items():
        monkeypatch.setenv(name, setting)
    monkeypatch.setenv(variable, value)
    assert sm120_fp4.install().installed and sm120_fp4.status().flashinfer_overrides == {}


@case(
    "configuration",
    "FLASHINFER_NVFP4_4OVER6={value} (a value FlashInfer reads as off: only exactly 1 turns 4over6 on) at install()",
    "installed: the standard recipe runs, the one the oracle models; a recipe knob beside it is still refused",
)
@pytest.mark.parametrize("value", ["0", "", "false", "off", "1 ", "01"])
def test_flashinfer_4over6_switched_off_is_accepted(monkeypatch, value):
    for name, setting in SIM_ENV.items():
        monkeypatch.setenv(name, setting)
    monkeypatch.setenv("FLASHINFER_NVFP4_4OVER6", value)
    assert sm120_fp4.install().installed and sm120_fp4.status().flashinfer_overrides == {}
    sm120_fp4.uninstall()
    monkeypatch.setenv("FLASHINFER_NVFP4_4OVER6_E4M3_USE_256", "1")
    with pytest.raises(ConfigError, match="FLASHINFER_NVFP4_4OVER6_E4M3_USE_256='1'"):
        sm120_fp4.install()


KEYWORD_GARBAGE = [
    ("simulate", 12, "MAJOR.MINOR"),
    ("simulate", 12.05, "MAJOR.MINOR"),
    ("simulate", 99.9, "MAJOR.MINOR the library knows"),
    ("canary", 1e-320, "0.1 <= seconds <= 86400"),
    ("canary", float("inf"), "0.1 <= seconds <= 86400"),
    ("selftest_timeout", float("nan"), "1 <= seconds <= 86400"),
    ("canary_slice_ms", -1, "0.001 <= milliseconds <= 1000"),
    ("backends", [], "comma-separated list"),
    ("backends", ("emulated", 3), "lower-case backend names"),
    ("selftest", None, "'strict', 'warn' or 'off'"),
    ("enable", True, "'auto', 'on' or 'off'"),
    ("toggle", "true", "1, on, 0, off"),
    ("report", "  ", "a file or directory path"),
    ("selftes", "strict", "did you mean 'selftest'"),
]


@case(
    "configuration",
    "keyword install({keyword}={value})",
    "ConfigError naming the keyword, the value and what is accepted",
)
@pytest.mark.parametrize("keyword, value, accepted", KEYWORD_GARBAGE, ids=[f"{k}={v!r}" for k, v, _ in KEYWORD_GARBAGE])
def test_garbage_in_a_keyword_is_an_error_at_install(keyword, value, accepted):
    with pytest.raises(ConfigError) as err:
        sm120_fp4.install(**{**SIM, keyword: value})
    message = str(err.value)
    assert keyword in message and accepted in message, message
    if keyword != "selftes":
        assert f"keyword {keyword}={value!r}" in message, message
    assert_not_patched()


@case(
    "configuration",
    "keyword install(simulate=12.0) (a float), or simulate=12.1",
    "accepted as the variable's string 12.0 / 12.1 would be: the same capability, installed",
)
@pytest.mark.parametrize("value", [12.0, 12.1])
def test_a_float_capability_is_accepted_where_it_is_unambiguous(value):
    status = sm120_fp4.install(**{**SIM, "simulate": value})
    assert status.installed, status.message
    assert status.settings["simulate"] == str(value)
    sm120_fp4.uninstall()


# ---- off means off (issue: following the refusal's advice SM120_FP4=0 must always work) --------

OFF_WAYS = {
    "env SM120_FP4=0": ({"SM120_FP4": "0"}, {}),
    "env SM120_FP4=off": ({"SM120_FP4": "off"}, {}),
    "install(toggle=0)": ({}, {"toggle": 0}),
    "install(toggle=False)": ({}, {"toggle": False}),
    "install(toggle='off') over env SM120_FP4=1": ({"SM120_FP4": "1"}, {"toggle": "off"}),
}


@case(
    "configuration",
    "{way} with stale bad values (SM120_FP4_SELFTEST=bogus, SM120_FP4_SIMULATE=twelve, an unknown SM120_FP4_FOO)",
    "install() is a no-op: no error, nothing patched, status says disabled; the ignored values are logged once",
)
@pytest.mark.parametrize("way", list(OFF_WAYS))
def test_off_means_off_whatever_else_is_set(monkeypatch, caplog, way):
    env, kwargs = OFF_WAYS[way]
    for name, value in {
        **env,
        "SM120_FP4_SELFTEST": "bogus",
        "SM120_FP4_SIMULATE": "twelve",
        "SM120_FP4_FOO": "1",
    }.items():
        monkeypatch.setenv(name, value)
    from sm120_fp4 import errors

    monkeypatch.setattr(errors, "_said", set())  # the once-per-process warnings' record
    first = sm120_fp4.install(**kwargs)
    second = sm120_fp4.install(**kwargs)
    assert not first.installed and not second.installed and "disabled" in first.message
    assert_not_patched()
    logged = [r.getMessage() for r in caplog.records if "ignoring the other settings" in r.getMessage()]
    assert len(logged) == 1 and "SM120_FP4_FOO" in logged[0], logged


@case(
    "configuration",
    "install(toggle=1) (an int, as the message lists 1 as accepted)",
    "accepted: installs as toggle='1' does",
)
def test_an_int_toggle_is_accepted_by_install():
    status = sm120_fp4.install(toggle=1, **SIM)
    assert status.installed and status.settings["toggle"] is True


@case(
    "configuration",
    "SM120_FP4_SELFTEST=warn together with SM120_FP4_{which}=emulated at install()",
    "one warning at install() says the emulated fallback wins (nothing is served unverified)",
)
@pytest.mark.parametrize("which", ["FALLBACK", "MOE_FALLBACK"])
def test_install_says_once_that_the_emulated_fallback_beats_selftest_warn(monkeypatch, caplog, which):
    monkeypatch.setenv("SM120_FP4_SELFTEST", "warn")
    monkeypatch.setenv(f"SM120_FP4_{which}", "emulated")
    sm120_fp4.install(**SIM)
    lines = [r.getMessage() for r in caplog.records if "wins" in r.getMessage()]
    assert len(lines) == 1 and f"SM120_FP4_{which}=emulated wins" in lines[0], lines


HUGE = ",".join(f"nope{i}" for i in range(20000))


@case(
    "configuration",
    "{what} (20,000 entries) at install()",
    "ConfigError under 2 KB that shows the first entries and says 'and N more'",
)
@pytest.mark.parametrize(
    "what",
    [
        "SM120_FP4_BACKENDS of 20,000 unknown names",
        "SM120_FP4_BACKENDS of 20,000 malformed names",
        "20,000 unknown SM120_FP4_* variables",
    ],
)
def test_error_messages_are_bounded_whatever_the_input(monkeypatch, what):
    if "unknown names" in what:
        monkeypatch.setenv("SM120_FP4_BACKENDS", HUGE)
    elif "malformed" in what:
        monkeypatch.setenv("SM120_FP4_BACKENDS", HUGE.upper())
    else:
        for i in range(20000):
            monkeypatch.setenv(f"SM120_FP4_X{i}", "1")
    with pytest.raises(ConfigError) as err:
        sm120_fp4.install(simulate="12.0")
    message = str(err.value)
    assert len(message) < 2048 and "more" in message, (len(message), message[:500])
