"""vLLM's plugin entry point (group vllm.general_plugins), through vLLM's own loader: inert unless SM120_FP4 is on."""

from __future__ import annotations

import pytest
from helpers import vllm_layers

pytestmark = pytest.mark.skipif(vllm_layers.available() is not None, reason=str(vllm_layers.available()))

from helpers.cases import case  # noqa: E402

import sm120_fp4  # noqa: E402


@pytest.fixture(autouse=True)
def _uninstalled():
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()
    yield
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()


def _load_general_plugins(monkeypatch) -> None:
    """vLLM's loader, as each vLLM process calls it (once: its flag reset for this call)."""
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()


def test_the_plugin_is_declared_in_vllms_general_plugins_group():
    from importlib.metadata import entry_points

    [ours] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "sm120_fp4"]
    assert ours.value == "sm120_fp4.bootstrap:load_vllm_plugin"


@case(
    "configuration",
    "vLLM loads its general plugins with SM120_FP4 unset",
    "the plugin does nothing: nothing installed, nothing patched",
)
def test_the_plugin_is_inert_without_the_toggle(monkeypatch):
    _load_general_plugins(monkeypatch)
    status = sm120_fp4.status()
    assert not status.installed and not status.patches


def test_the_plugin_installs_with_the_toggle_on(monkeypatch):
    monkeypatch.setenv("SM120_FP4", "1")
    monkeypatch.setenv("SM120_FP4_SIMULATE", "12.0")
    monkeypatch.setenv("SM120_FP4_BACKENDS", "emulated")
    _load_general_plugins(monkeypatch)
    status = sm120_fp4.status()
    assert status.installed and status.message.startswith("installed (vllm ")
    assert "vllm-flashinfer-scaled-fp4-mm-alias" in {p.name for p in status.patches}


@case(
    "configuration",
    "vLLM loads its general plugins with SM120_FP4=1 and an invalid setting (SM120_FP4_BACKENDS=nonesuch)",
    "the plugin raises the ConfigError naming the setting out of vLLM's loader: the process stops, never serves unverified",
)
def test_a_bad_setting_stops_vllms_plugin_loader(monkeypatch):
    from sm120_fp4.errors import ConfigError

    monkeypatch.setenv("SM120_FP4", "1")
    monkeypatch.setenv("SM120_FP4_BACKENDS", "nonesuch")
    with pytest.raises(ConfigError, match="nonesuch"):
        _load_general_plugins(monkeypatch)


@case(
    "configuration",
    "SM120_FP4_CANARY on in a vLLM process (vLLM's plugin loader), where vLLM 0.32-0.34 has no idle "
    "point the library uses",
    "the plugin raises the ConfigError naming SM120_FP4_CANARY=off: that vLLM process stops",
)
def test_the_canary_is_refused_where_vllm_serves_not_merely_because_vllm_is_installed(monkeypatch):
    from sm120_fp4.errors import ConfigError

    # install() itself (SGLang may be what serves this process) accepts the canary with vLLM installed ...
    status = sm120_fp4.install(simulate="12.0", backends="emulated", canary=60)
    assert status.installed
    sm120_fp4.uninstall()
    # ... vLLM's own process does not.
    monkeypatch.setenv("SM120_FP4", "1")
    monkeypatch.setenv("SM120_FP4_SIMULATE", "12.0")
    monkeypatch.setenv("SM120_FP4_BACKENDS", "emulated")
    monkeypatch.setenv("SM120_FP4_CANARY", "60")
    with pytest.raises(ConfigError, match="SM120_FP4_CANARY=off"):
        _load_general_plugins(monkeypatch)
