"""`sm120-fp4 doctor` shows the vLLM side: its release, whether it is supported, the plugin and every patch target."""

from __future__ import annotations

import json

import pytest
from helpers import vllm_layers

pytestmark = pytest.mark.skipif(vllm_layers.available() is not None, reason=str(vllm_layers.available()))

from sm120_fp4 import cli  # noqa: E402


def test_doctor_shows_vllms_release_plugin_and_targets(capsys):
    assert cli.main(["doctor", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    section = report["engines"]["vllm"]
    assert section["supported"] and section["version"].startswith("0.3")
    assert section["plugin_entry_point"] == ["sm120_fp4 -> sm120_fp4.bootstrap:load_vllm_plugin"]
    applies = {t["name"]: t["applies"] for t in section["targets"]}
    assert applies["vllm-flashinfer-scaled-fp4-mm-alias"] and applies["vllm-post-warmup-recheck"]
    assert cli.main(["doctor", "--quick"]) == 0
    assert "### vLLM patch targets" in capsys.readouterr().out


def test_doctor_lists_vllm_plugins_without_the_library_as_a_problem(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin")
    assert cli.main(["doctor", "--quick", "--json", "--strict"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any("VLLM_PLUGINS='other_plugin' does not name sm120_fp4" in p for p in problems), problems
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin,sm120_fp4")
    cli.main(["doctor", "--quick", "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert not any("VLLM_PLUGINS" in p for p in problems), problems
