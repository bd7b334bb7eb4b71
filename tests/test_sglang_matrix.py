"""scripts/sglang_matrix.py without downloads: the source check of the simulation's stand-ins, the
FlashInfer axis, the run list and the report, on release source trees written here (the check reads SGLang's source with ast; nothing is imported).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sglang_matrix.py"
_spec = importlib.util.spec_from_file_location("sglang_matrix", _SCRIPT)
matrix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)

METADATA = "Metadata-Version: 2.1\nName: sglang\nVersion: {v}\nRequires-Dist: flashinfer_python=={fi}\nRequires-Dist: sgl-kernel==0.3.21\nRequires-Dist: transformers==4.57.1\n"
MQ = """
try:
    from flashinfer import fp4_quantize
except ImportError:
    fp4_quantize = None

class ModelOptFp4LinearMethod:
    def process_weights_after_loading(self, layer):
        pass

    def apply(self, layer, x, bias=None):
        x_fp4, x_scale = {quantizer}(x, layer.input_scale_inv)
        return x_fp4
"""


def release_tree(cache: Path, version: str, quantizer: str, flashinfer: str = "0.6.1") -> Path:
    """A release's extracted sources as sources() leaves them: modelopt_quant with `quantizer` in apply()."""
    src = cache / "src" / version
    mq = src / matrix.module_path(matrix.R.MQ)
    mq.parent.mkdir(parents=True)
    mq.write_text(MQ.format(quantizer=quantizer))
    (src / "METADATA").write_text(METADATA.format(v=version, fi=flashinfer))
    (src / ".extracted").write_text("\n".join(matrix.needed_files()))
    return cache


@pytest.mark.parametrize(
    "version, quantizer, expected",
    [
        ("0.5.8", "fp4_quantize", {"sim-activation-quantizer": "ok"}),
        # a release whose apply() quantizes with a name the stand-in does not replace (as 0.5.3-0.5.4.post1 did)
        ("0.5.8", "scaled_fp4_quant", {"sim-activation-quantizer": "FAIL"}),
        ("0.5.9", "some_new_quantizer", {"sim-activation-quantizer": "FAIL"}),
        # a ledger range that misses a release whose apply() calls the name
        ("0.5.7", "fp4_quantize", {"sim-activation-quantizer": "FAIL"}),
    ],
)
def test_the_source_check_checks_the_quantizer_stand_ins_against_what_apply_calls(
    tmp_path, version, quantizer, expected
):
    cache = release_tree(tmp_path, version, quantizer)
    if version == "0.5.7":  # outside SUPPORTED: only the stand-in's own check applies (no PINS row)
        result = {
            "sim-activation-quantizer": matrix.check_stand_in(matrix.S.QUANTIZER, version, cache / "src" / version)
        }
    else:
        result = matrix.check_version(version, cache)
        assert result["sim-kernel-package"] == ("ok", ""), (
            "0.5.8-0.5.10 install the pinned sgl-kernel: METADATA names it"
        )
        assert result["sim-blackwell-check"][0] == "n/a"
    assert {name: result[name][0] for name in expected} == expected, {n: result[n] for n in expected}
    if expected["sim-activation-quantizer"] == "FAIL":
        assert (
            "range too" in result["sim-activation-quantizer"][1]
            or "does not call" in result["sim-activation-quantizer"][1]
        )


def test_the_stand_in_check_fails_where_apply_is_missing(tmp_path):
    cache = release_tree(tmp_path, "0.5.10.post1", "fp4_quantize")
    mq = cache / "src" / "0.5.10.post1" / matrix.module_path(matrix.R.MQ)
    mq.write_text(mq.read_text().replace("def apply(", "def forward("))
    state, reason = matrix.check_version("0.5.10.post1", cache)["sim-activation-quantizer"]
    assert state == "FAIL" and "ModelOptFp4LinearMethod defines no apply" in reason


def test_the_run_list_has_the_newest_release_of_every_minor():
    assert "0.5.8.post1" in matrix.NEWEST_RELEASES and "0.5.8" not in matrix.NEWEST_RELEASES
    minors = {".".join(v.split(".")[:3]) for v in matrix.RELEASES}
    assert len(matrix.NEWEST_RELEASES) == len(minors)
    assert set(matrix.NEWEST_RELEASES) | set(matrix.ERA_RELEASES) == set(matrix.TABLE_RELEASES)


def test_the_report_keeps_the_rows_of_releases_not_run_again(tmp_path):
    report = tmp_path / "RELEASES.md"
    row = {
        "release": "0.5.8.post1",
        "repo": "r",
        "code": "r@abc1234",
        "pins": "p",
        "deviations": [],
        "date": "2026-12-01",
        "build_error": "pip install failed",
        "ok": False,
    }
    matrix.write_report(
        report, [row, dict(row, release="0.5.9", code="r@0000001")], {"releases": {"0.5.8": {}}, "date": "d"}
    )
    fixed = dict(row, release="0.5.8.post1", code="r@fffffff")
    (tmp_path / "r.json").write_text(json.dumps([fixed]))
    assert matrix.main(["--render", str(tmp_path / "r.json"), "--report", str(report)]) == 0
    text = report.read_text()
    rows = [line.split(" | ")[:2] for line in text.splitlines() if line.startswith("| 0.5.")]
    assert rows == [["| 0.5.8.post1", "fffffff"], ["| 0.5.9", "0000001"]], rows
    assert matrix.SOURCE_TITLE in text, "the earlier source-check section is kept"
    missing = [v for v in matrix.TABLE_RELEASES if v not in ("0.5.8.post1", "0.5.9")]
    assert f"Not run yet (of `--releases table`): {', '.join(missing)}." in text


def test_a_snapshot_folder_inside_a_checkout_is_labelled_by_its_own_name(tmp_path):
    """--repo .cache/snap/<commit> (an exported snapshot inside this checkout) ran that commit, not
    the enclosing checkout's HEAD."""
    snapshot = matrix.ROOT / ".cache" / "snap-label-test" / "abc1234"
    snapshot.mkdir(parents=True, exist_ok=True)
    try:
        assert matrix.repo_label(snapshot) == "abc1234"
        assert matrix.repo_label(matrix.ROOT).startswith(matrix.ROOT.name + "@")
    finally:
        snapshot.rmdir()
        snapshot.parent.rmdir()


OP_EVERY_DEVICE = """
@torch.library.custom_op("sglang::fp4_gemm", mutates_args=())
def _sglang_fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, out_features):
    return fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, backend="cutlass")
"""
OP_GPU_ONLY = """
from flashinfer import mm_fp4 as flashinfer_fp4_gemm

@register_custom_op(fake_impl=_sglang_fp4_gemm_fake)
def fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, out_features):
    return flashinfer_fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, backend="cutlass")
"""
OP_CUDA_TYPES = OP_EVERY_DEVICE.replace("mutates_args=()", 'mutates_args=(), device_types="cuda"')


@pytest.mark.parametrize(
    "version, op, expected, says",
    [
        ("0.5.8", OP_GPU_ONLY, "ok", ""),
        ("0.5.7", OP_EVERY_DEVICE, "n/a", ""),
        ("0.5.7", "", "n/a", ""),
        # 0.5.5.post3-0.5.7's op ran on every device: a range reaching such a release would claim a CPU kernel there
        ("0.5.9", OP_EVERY_DEVICE, "FAIL", "too wide"),
        ("0.5.9", "", "FAIL", "too wide"),
        # a GPU-only op outside the range would leave the simulated GEMM without a CPU kernel
        ("0.5.7", OP_GPU_ONLY, "FAIL", "too narrow"),
        ("0.5.7", OP_CUDA_TYPES, "FAIL", "too narrow"),
    ],
)
def test_the_cpu_kernel_check_follows_how_each_release_registers_the_op(tmp_path, version, op, expected, says):
    """sim-fp4-gemm-cpu-kernel's ledger range is exactly where sglang::fp4_gemm has no CPU kernel."""
    cache = release_tree(tmp_path, version, "fp4_quantize")
    mq = cache / "src" / version / matrix.module_path(matrix.R.MQ)
    mq.write_text(mq.read_text() + op)
    state, reason = matrix.check_cpu_kernel(version, cache / "src" / version)
    assert state == expected and says in reason, (state, reason)


MOE_UTILS_GLOBAL = """
class MoeRunnerBackend(Enum):
    AUTO = "auto"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"

MOE_RUNNER_BACKEND: Optional[MoeRunnerBackend] = None

def initialize_moe_config(server_args):
    global MOE_RUNNER_BACKEND
    MOE_RUNNER_BACKEND = MoeRunnerBackend(server_args.moe_runner_backend)
"""
MOE_UTILS_FLAGS = """
from sglang.srt.runtime_context import get_flags

class MoeRunnerBackend(Enum):
    AUTO = "auto"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"

def initialize_moe_config(server_args):
    moe = get_flags().moe
    moe.runner_backend = MoeRunnerBackend(server_args.moe_runner_backend)
"""
FLAGS = """
class MoeFlags(_FlagGroupBase):
    runner_backend: Any = None
"""
PINS = ("moe-runner-config-hook", "moe-runner-backend-pin", "moe-runner-backend-pin-legacy")


@pytest.mark.parametrize(
    "version, utils, flags, expected",
    [
        ("0.5.15.post1", MOE_UTILS_GLOBAL, "", ("ok", "n/a", "ok")),
        ("0.5.16", MOE_UTILS_FLAGS, FLAGS, ("ok", "ok", "n/a")),
        ("0.5.14", MOE_UTILS_GLOBAL, "", ("n/a", "n/a", "n/a")),  # no seam before 0.5.15: nothing pinned, on purpose
        # a release that keeps the runner on get_flags().moe outside the flags pin's range (0.5.16-0.5.18 were,
        # under the ranges of old: flags from 0.5.19, the module global up to 0.5.18)
        ("0.5.15", MOE_UTILS_FLAGS, FLAGS, ("ok", "FAIL", "FAIL")),
        ("0.5.17", MOE_UTILS_FLAGS.replace("get_flags", "get_exec"), FLAGS, ("ok", "FAIL", "n/a")),
        (
            "0.5.19",
            MOE_UTILS_GLOBAL.replace("    MOE_RUNNER_BACKEND = ", "    backend = "),
            FLAGS,
            ("FAIL", "FAIL", "n/a"),
        ),
    ],
)
def test_the_moe_runner_pins_are_checked_where_each_release_keeps_the_runner(tmp_path, version, utils, flags, expected):
    cache = release_tree(tmp_path, version, "fp4_quantize")
    for module, text in ((matrix.R.MOE_UTILS, utils), (matrix.R.RUNTIME_CONTEXT, flags)):
        path = cache / "src" / version / matrix.module_path(module)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    result = matrix.check_version(version, cache)
    assert tuple(result[name][0] for name in PINS) == expected, {name: result[name] for name in PINS}


@pytest.mark.parametrize("version", matrix.RELEASES)
def test_every_supported_release_has_one_alias_spec_and_no_target_of_unknown_kind(version):
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from sm120_fp4.sglang import release, targets

    assert Version(version) in SpecifierSet(release.SUPPORTED), f"{version} listed but outside {release.SUPPORTED}"
    spec = matrix.alias_spec(version)  # what run_import patches and checks there
    assert spec.module == release.MQ and spec.attribute == "flashinfer_fp4_gemm"
    runtime = [s for s in targets.ledger_rows() if s.make is not None and Version(version) in SpecifierSet(s.versions)]
    assert [s.name for s in runtime if matrix.kind(s) == "unknown"] == []


def test_a_release_without_an_alias_spec_is_named_not_a_stop_iteration():
    with pytest.raises(RuntimeError, match=r"sglang 0\.6\.0: 0 FP4 GEMM alias specs cover it"):
        matrix.alias_spec("0.6.0")


def test_the_flashinfer_axis_replaces_the_pin_and_keeps_its_rows_beside_the_releases(tmp_path):
    cache = release_tree(tmp_path, "0.5.8", "fp4_quantize", flashinfer="0.6.1")
    plan = matrix.resolve("0.5.8", cache, flashinfer="0.7.4")
    assert plan["flashinfer"] == "0.7.4" and "flashinfer 0.7.4" in matrix.pins_summary(plan)
    assert any(d.startswith("flashinfer-python 0.7.4 (release pins ==0.6.1)") for d in plan["deviations"]), plan[
        "deviations"
    ]
    assert matrix.venv_dir("0.5.8", "0.7.4") != matrix.venv_dir("0.5.8")
    report = tmp_path / "RELEASES.md"
    row = {
        "release": "0.5.9",
        "repo": "r",
        "code": "r@abc1234",
        "pins": "p",
        "deviations": [],
        "date": "d",
        "build_error": "x",
        "ok": False,
    }
    matrix.write_report(report, [row])
    matrix.write_report(
        report,
        [
            dict(row, release=matrix.row_key("0.5.8", "0.7.4"), code="r@1111111"),
            dict(row, release=matrix.row_key("0.5.9", "0.7.4"), code="r@2222222"),
        ],
    )
    rows = [line.split(" | ")[:2] for line in report.read_text().splitlines() if line.startswith("| 0.5.")]
    assert rows == [
        ["| 0.5.8+flashinfer-0.7.4", "1111111"],
        ["| 0.5.9", "abc1234"],
        ["| 0.5.9+flashinfer-0.7.4", "2222222"],
    ], rows


def test_flashinfer_option_rejects_what_is_not_a_release(capsys):
    with pytest.raises(SystemExit) as exit_:
        matrix.main(["--import-check", "0.5.23", "--flashinfer", "0.7.4; rm -rf /"])
    assert (
        exit_.value.code == 2
        and "--flashinfer '0.7.4; rm -rf /': a flashinfer-python release" in capsys.readouterr().err
    )
