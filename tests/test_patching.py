"""The generic patch engine (sm120_fp4.patching), with standard-library modules as its targets: a copy of
`json` of its own (imported already) and `colorsys` (imported only when a test imports it)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import types

import pytest

from sm120_fp4.patching import Patcher, PatchSpec


def _json_of_its_own() -> types.ModuleType:
    """Return a copy of the json package loaded under a name of its own (its own functions and classes): the
    standard one is every thread's, and other tests' background jobs write JSON in this process while these
    tests patch it."""
    found = importlib.util.find_spec("json")
    name = "sm120_fp4_tests_json"
    copy = importlib.util.spec_from_file_location(
        name, found.origin, submodule_search_locations=found.submodule_search_locations
    )
    module = importlib.util.module_from_spec(copy)
    sys.modules[name] = module
    copy.loader.exec_module(module)
    return module


json = _json_of_its_own()
LEDGER = dict(why="test", upstream="none", remove_when="never")


def spec(name="dumps", module=json.__name__, attribute="dumps", **kwargs) -> PatchSpec:
    def make(original):
        def replacement(*args, **kw):
            return "patched:" + original(*args, **kw)

        replacement.__wrapped__ = original
        return replacement

    return PatchSpec(name=name, module=module, attribute=attribute, **{"make": make, **LEDGER, **kwargs})


def states(patcher: Patcher) -> dict[str, tuple[str, str | None]]:
    return {e.name: (e.state, e.reason) for e in patcher.ledger()}


@pytest.fixture
def patcher():
    """A Patcher whose patches are removed after the test, whatever it did."""
    p = Patcher()
    yield p
    p.remove_all()


@pytest.fixture
def late_colorsys():
    """`colorsys` not imported at the start (so hooks fire on its import), and forgotten afterwards."""
    saved = sys.modules.pop("colorsys", None)
    yield
    sys.modules.pop("colorsys", None)
    if saved is not None:
        sys.modules["colorsys"] = saved


# ---- apply, idempotence, exact undo -------------------------------------------------------------


def test_a_patch_on_an_imported_module_applies_at_once_and_undoes_to_the_same_object(patcher):
    original = json.dumps
    patcher.add([spec()])
    assert json.dumps([1]) == "patched:[1]" and json.dumps.__sm120_fp4_patch__ == "dumps"
    (entry,) = patcher.ledger()
    assert (entry.name, entry.module, entry.attribute, entry.state, entry.reason, entry.why) == (
        "dumps",
        json.__name__,
        "dumps",
        "applied",
        None,
        "test",
    )
    patcher.remove_all()
    assert json.dumps is original and patcher.ledger() == []


def test_adding_an_applied_patch_again_keeps_one_layer(patcher):
    original = json.dumps
    patcher.add([spec()])
    first = json.dumps
    patcher.add([spec()])
    assert json.dumps is first and first.__wrapped__ is original
    assert json.dumps([2]) == "patched:[2]"


def test_a_second_engine_finds_the_target_patched_and_leaves_it(patcher):
    patcher.add([spec()])
    other = Patcher()
    other.add([spec()])
    assert states(other) == {"dumps": ("skipped", "already patched by another install of sm120_fp4")}
    other.remove_all()
    assert json.dumps.__sm120_fp4_patch__ == "dumps", "the other engine did not undo ours"


def test_undo_leaves_a_target_someone_else_replaced_since(patcher, caplog, monkeypatch):
    monkeypatch.setattr(json, "dumps", json.dumps)  # the true original comes back after the test
    patcher.add([spec()])
    theirs = lambda *a, **k: "theirs"  # noqa: E731
    json.dumps = theirs
    caplog.set_level(logging.WARNING, "sm120_fp4")
    patcher.remove_all()
    assert json.dumps is theirs
    assert any("replaced by someone else" in r.getMessage() for r in caplog.records)


def test_a_module_that_imported_the_patched_name_is_restored_too(patcher, monkeypatch):
    original = json.dumps
    patcher.add([spec()])
    importer = types.ModuleType("sm120_fp4_test_importer")
    importer.dumps = json.dumps  # `from json import dumps` after the patch
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    patcher.add([spec(name="importer-dumps", module=importer.__name__)])
    assert states(patcher)["importer-dumps"] == ("applied", f"imported already patched from {json.__name__}")
    patcher.remove_all()
    assert json.dumps is original and importer.dumps is original


# ---- post-import hooks ---------------------------------------------------------------------------


def test_a_patch_waits_for_its_module_and_applies_when_it_is_imported(patcher, late_colorsys):
    patcher.add([spec(name="hsv", module="colorsys", attribute="rgb_to_hsv")])
    assert states(patcher) == {"hsv": ("pending", None)}
    import colorsys

    assert colorsys.rgb_to_hsv.__sm120_fp4_patch__ == "hsv"
    assert states(patcher) == {"hsv": ("applied", None)}
    original = colorsys.rgb_to_hsv.__wrapped__
    patcher.remove_all()
    assert colorsys.rgb_to_hsv is original


def test_remove_all_disarms_a_pending_hook(patcher, late_colorsys):
    patcher.add([spec(name="hsv", module="colorsys", attribute="rgb_to_hsv")])
    patcher.remove_all()
    import colorsys

    assert not hasattr(colorsys.rgb_to_hsv, "__sm120_fp4_patch__")


def test_a_hook_that_raises_never_escapes_the_import(patcher, late_colorsys, caplog):
    def boom(original):
        raise RuntimeError("boom in make")

    caplog.set_level(logging.WARNING, "sm120_fp4")
    patcher.add([PatchSpec(name="hsv", module="colorsys", attribute="rgb_to_hsv", make=boom, **LEDGER)])
    colorsys = importlib.import_module("colorsys")  # succeeds
    assert not hasattr(colorsys.rgb_to_hsv, "__sm120_fp4_patch__")
    assert states(patcher) == {"hsv": ("skipped", "internal error: RuntimeError: boom in make")}
    assert [r.getMessage() for r in caplog.records] == [
        "sm120_fp4: patch hsv failed, SGLang left unpatched there: boom in make"
    ]


def test_when_imported_runs_a_step_now_or_at_import_and_never_raises_into_it(patcher, late_colorsys, caplog):
    seen = []
    patcher.when_imported(json.__name__, lambda m: seen.append(m.__name__))
    patcher.when_imported("colorsys", lambda m: seen.append(m.__name__))
    assert seen == [json.__name__]

    def fails(module):
        raise ValueError("step failed")

    patcher.when_imported("colorsys", fails)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    import colorsys  # noqa: F401

    assert seen == [json.__name__, "colorsys"]
    assert any("step fails on import of colorsys failed: step failed" in r.getMessage() for r in caplog.records)


def test_when_imported_is_disarmed_by_remove_all(patcher, late_colorsys):
    seen = []
    patcher.when_imported("colorsys", seen.append)
    patcher.remove_all()
    import colorsys  # noqa: F401

    assert seen == []


# ---- reasons to leave a target alone ------------------------------------------------------------


def test_a_check_that_objects_leaves_the_target_with_its_reason(patcher):
    original = json.dumps
    patcher.add([spec(check=lambda fn: "not the expected signature")])
    assert json.dumps is original and states(patcher) == {"dumps": ("skipped", "not the expected signature")}


def test_a_missing_attribute_is_skipped_with_the_likely_cause(patcher):
    patcher.add(
        [
            spec(name="a", attribute="no_such_name"),
            spec(name="b", attribute="JSONDecoder.no_such", when_missing="renamed upstream"),
        ]
    )
    assert states(patcher) == {
        "a": ("skipped", f"{json.__name__}.no_such_name not found in this release"),
        "b": ("skipped", f"{json.__name__}.JSONDecoder.no_such not found: renamed upstream"),
    }


def test_a_class_attribute_is_patched_on_the_class_and_restored(patcher):
    original = json.JSONEncoder.__dict__["encode"]
    patcher.add([spec(name="encode", attribute="JSONEncoder.encode")])
    assert json.JSONEncoder.__dict__["encode"].__sm120_fp4_patch__ == "encode"
    assert json.JSONEncoder().encode([3]) == "patched:[3]"
    patcher.remove_all()
    assert json.JSONEncoder.__dict__["encode"] is original


# ---- version guards (a fake distribution) ------------------------------------------------------


@pytest.fixture
def fakedist(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name == "fakedist":
            return "1.5"
        if name == "garbledist":
            return "not-a-version"
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize(
    "dist, versions, state, reason",
    [
        ("fakedist", ">=1,<2", "applied", None),
        ("fakedist", "<1.5", "skipped", "not needed in fakedist 1.5 (applies to <1.5)"),
        ("no-such-dist-sm120", ">=1", "skipped", "no-such-dist-sm120 is not installed"),
        (
            "garbledist",
            ">=1",
            "skipped",
            "cannot compare garbledist not-a-version with '>=1': Invalid version: 'not-a-version'",
        ),
        (
            "fakedist",
            "not a range",
            "skipped",
            "cannot compare fakedist 1.5 with 'not a range': Invalid specifier: 'not a range'",
        ),
    ],
)
def test_the_version_guard_applies_only_inside_the_range(patcher, fakedist, dist, versions, state, reason):
    original = json.dumps
    patcher.add([spec(distribution=dist, versions=versions)])
    assert states(patcher) == {"dumps": (state, reason)}
    assert (json.dumps is original) == (state == "skipped")


def test_installed_versions_are_read_once_per_lookup_and_again_after_clear_cache(monkeypatch):
    from sm120_fp4 import versions

    asked: list[str] = []

    def version(name):
        asked.append(name)
        if name == "fakedist":
            return "1.5"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    for _ in range(3):
        assert versions.installed_version("no-such-dist-sm120", "fakedist") == "1.5"
    assert asked == ["no-such-dist-sm120", "fakedist"], "each distribution's METADATA is read once"
    versions.clear_cache()
    assert versions.installed_version("fakedist") == "1.5" and asked[-1] == "fakedist" and len(asked) == 3
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.0")  # a later pip run: cached until cleared
    assert versions.installed_version("fakedist") == "1.5"
    versions.clear_cache()
    assert versions.installed_version("fakedist") == "2.0"


def test_a_target_range_is_capped_by_the_supported_range_unless_it_ends_earlier():
    from sm120_fp4 import versions

    assert versions.capped(">=0.5.8", ">=0.5.3,<0.5.24") == ">=0.5.8,<0.5.24"
    assert versions.capped(">=0.5.16,<0.5.21", ">=0.5.3,<0.5.24") == ">=0.5.16,<0.5.21"  # disappears in 0.5.21
    assert versions.capped(">=1.0", ">=0.9,<=2.0") == ">=1.0,<=2.0"


def test_the_supported_upper_bound_is_written_once_in_the_package():
    """Raising the supported SGLang range is one line: every target's range is capped by SUPPORTED."""
    from pathlib import Path

    from packaging.specifiers import SpecifierSet

    from sm120_fp4.sglang import release

    [upper] = [s.version for s in SpecifierSet(release.SUPPORTED) if s.operator == "<"]
    package = Path(release.__file__).resolve().parents[1]
    hits = [
        f"{path.relative_to(package)}:{n}"
        for path in sorted(package.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if upper in line
    ]
    assert hits == ["sglang/release.py:" + hits[0].rsplit(":", 1)[1]] and len(hits) == 1, hits


# ---- pin and note --------------------------------------------------------------------------------


def test_pin_sets_a_value_when_it_applies_and_remove_all_restores_it(patcher, monkeypatch):
    import colorsys

    monkeypatch.setattr(colorsys, "ONE_THIRD", colorsys.ONE_THIRD)  # restored whatever happens
    pin = PatchSpec(name="third", module="colorsys", attribute="ONE_THIRD", **LEDGER)
    before = colorsys.ONE_THIRD
    assert not patcher.pin(pin, colorsys, 0.5, applies=lambda current: current > 1)
    assert colorsys.ONE_THIRD is before and patcher.ledger() == []
    assert patcher.pin(pin, colorsys, 0.5, applies=lambda current: current < 1)
    assert colorsys.ONE_THIRD == 0.5 and states(patcher) == {"third": ("applied", None)}
    assert patcher.pin(pin, colorsys, 0.5, applies=lambda current: False), "already pinned"
    patcher.remove_all()
    assert colorsys.ONE_THIRD is before


def test_note_records_an_entry_without_touching_anything(patcher):
    patcher.note(spec(name="env-knob"), "skipped", "set by the operator")
    assert states(patcher) == {"env-knob": ("skipped", "set by the operator")}
