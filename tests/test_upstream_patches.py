"""patches/: every diff applies cleanly to its release, the patched code compiles (and, for the
installed release, imports), its start-up check refuses wrong output, and `patches check|apply`
answer correctly. Nothing is downloaded here: the release wheels come from .cache/sglang-wheels/
(scripts/fetch_release_sources.sh fetches them during set-up).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import io
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.common import slow_but_one

from sm120_fp4 import nvfp4
from sm120_fp4.sglang import release
from sm120_fp4.sglang.release import FP4_UTILS_FILE, MQ_FILE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import ledger  # noqa: E402  (scripts/ledger.py renders patches/LEDGER.md)
import upstream_patches as upstream  # noqa: E402
from helpers.cases import case  # noqa: E402
from helpers.procs import Popen, background, clean_env, python  # noqa: E402
from upstream_patches import DIFFS  # noqa: E402

CACHE = ROOT / ".cache" / "sglang-wheels"
RELEASES = [(diff, release) for diff in DIFFS for release in diff.releases]
RELEASE_IDS = [release for _, release in RELEASES]
TOOLS = ["patch", "git"]


def _wheel(version: str) -> Path:
    found = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        pytest.skip(f"no cached wheel for sglang {version} in {CACHE}: run scripts/fetch_release_sources.sh")
    return found[0]


def _unpack(version: str, dest: Path) -> Path:
    """The files a diff and `patches check|apply` need, from the release wheel, as in site-packages."""
    wanted = {MQ_FILE, FP4_UTILS_FILE, "sglang/__init__.py", "sglang/version.py", "sglang/_version.py"}
    with zipfile.ZipFile(_wheel(version)) as wheel:
        for name in wheel.namelist():
            if name in wanted or (name.endswith(".dist-info/METADATA") and name.startswith("sglang-")):
                wheel.extract(name, dest)
    return dest


def _read(tree: Path) -> dict[str, bytes]:
    return {name: (tree / name).read_bytes() for name in (MQ_FILE, FP4_UTILS_FILE)}


@pytest.fixture
def tool(monkeypatch, request):
    """Force one patch tool for upstream.apply (skipped where the host lacks it)."""
    name = getattr(request, "param", None)
    if name is None:
        return upstream._tool()
    if shutil.which(name) is None:
        pytest.skip(f"{name} is not installed")
    monkeypatch.setattr(upstream, "_tool", lambda: name)
    return name


# ---------------------------------------------------------------- the ledger and the table of diffs


def _gnu_patch(tree: Path, diff) -> None:
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    subprocess.run(["patch", "-p1", "--batch", "-s", "-d", str(tree), "-i", str(upstream.patch_path(diff))], check=True)


def test_ledger_is_rendered_from_code():
    assert ledger.main(["--check"]) == 0, "run: python scripts/ledger.py --write"


@background(lambda folder: python("import sys, sm120_fp4.api; print('sm120_fp4.upstream' in sys.modules)", folder))
def test_upstream_diff_tooling_is_off_the_install_path(background):
    rc, stdout, stderr = background
    assert rc == 0 and stdout.strip() == "False", stderr


def test_apply_without_patch_or_git_prints_the_exact_command(tmp_path, monkeypatch, capsys):
    tree = _unpack("0.5.23", tmp_path)
    monkeypatch.setattr(upstream, "_tool", lambda: None)
    assert upstream.apply(tree) == 2
    err = capsys.readouterr().err
    assert "neither GNU patch nor git" in err and "patch -p1" in err and str(tree) in err
    assert not upstream.check(tree).fixed, "nothing was changed"


def test_ledger_names_every_runtime_target_and_diff():
    from sm120_fp4.sglang.targets import ledger_rows

    text = ledger.render_ledger()
    for spec in ledger_rows():
        assert f"`{spec.name}`" in text and spec.remove_when in text
    for diff in DIFFS:
        assert f"`{diff.filename}`" in text and diff.remove_when in text


def test_patches_dir_holds_exactly_the_listed_diffs():
    on_disk = {p.name for p in (ROOT / "patches").glob("*.patch")}
    assert on_disk == {d.filename for d in DIFFS}
    assert {"0.5.8", "0.5.10", "0.5.23"} <= {r for d in DIFFS for r in d.releases}


@pytest.mark.parametrize("diff", DIFFS, ids=[d.release for d in DIFFS])
def test_diff_touches_the_files_it_lists_and_carries_its_marker(diff):
    text = upstream.patch_path(diff).read_text()
    touched = tuple(
        line[len("+++ b/") :].split("\t")[0].strip() for line in text.splitlines() if line.startswith("+++ ")
    )
    assert touched == diff.files
    assert all(line.startswith(("--- a/", "+++ b/", "@@", " ", "+", "-")) for line in text.splitlines())
    added = [line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert sum(f"sm120-fp4: {diff.id}" in line for line in added) >= len(diff.files)
    assert len(added) < 100, "keep the diff small enough to review"


# ---------------------------------------------------------------- applying each diff to its release


@pytest.mark.parametrize(("diff", "release"), RELEASES, ids=RELEASE_IDS)
def test_diff_applies_cleanly_with_gnu_patch_and_compiles(diff, release, tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    tree = _unpack(release, tmp_path)
    cmd = ["patch", "-p1", "--batch", "--fuzz=0", "-d", str(tree), "-i", str(upstream.patch_path(diff))]
    dry = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "Hunk" not in dry.stdout, f"applies only with offset or fuzz:\n{dry.stdout}"
    subprocess.run(cmd, check=True, capture_output=True)
    for name in diff.files:
        source = (tree / name).read_text()
        compile(source, name, "exec")
        assert f"sm120-fp4: {diff.id}" in source


@pytest.mark.parametrize("tool", TOOLS, indirect=True)
@pytest.mark.parametrize(("diff", "release"), RELEASES, ids=RELEASE_IDS)
def test_apply_gives_the_same_tree_with_every_tool(diff, release, tool, tmp_path, capsys):
    expected = _unpack(release, tmp_path / "expected")
    _gnu_patch(expected, diff)  # GNU patch is the reference
    tree = _unpack(release, tmp_path / "tree")
    assert upstream.apply(tree) == 0, capsys.readouterr()
    assert _read(tree) == _read(expected)


@pytest.mark.parametrize(("diff", "release"), RELEASES, ids=RELEASE_IDS)
def test_check_says_not_fixed_then_fixed(diff, release, tmp_path, capsys):
    tree = _unpack(release, tmp_path)
    before = upstream.check(tree)
    assert (before.state, before.exit_code, before.version, before.diff) == ("not-fixed", 1, release, diff)
    assert upstream.main("check", target=str(tree)) == 1
    assert diff.filename in capsys.readouterr().out

    assert upstream.apply(tree, dry_run=True) == 0
    assert "dry run" in capsys.readouterr().out
    assert upstream.check(tree).exit_code == 1, "--dry-run must change nothing"

    assert upstream.main("apply", target=str(tree)) == 0
    after = upstream.check(tree)
    assert (after.state, after.exit_code, after.patch_id) == ("fixed", 0, diff.id)
    assert upstream.main("check", target=str(tree)) == 0
    capsys.readouterr()
    assert upstream.apply(tree) == 0, "applying twice is a no-op"
    assert "nothing to do" in capsys.readouterr().out


def test_check_without_sglang_is_2(tmp_path, capsys):
    assert upstream.check(tmp_path).state == "no-sglang"
    assert upstream.main("check", target=str(tmp_path)) == 2
    assert upstream.main("apply", dry_run=True, target=str(tmp_path)) == 2
    assert "no sglang package" in capsys.readouterr().err


def test_apply_refuses_a_release_without_a_diff(tmp_path, capsys):
    tree = _unpack("0.5.23", tmp_path)
    (metadata,) = tree.glob("sglang-*.dist-info/METADATA")
    metadata.write_text(metadata.read_text().replace("Version: 0.5.23", "Version: 0.5.9"))
    before = _read(tree)
    assert upstream.main("apply", dry_run=True, target=str(tree)) == 2
    err = capsys.readouterr().err
    assert "sglang 0.5.9" in err and "no diff for this release" in err
    assert upstream.apply(tree) == 2
    assert _read(tree) == before


def test_apply_refuses_when_the_tree_is_not_the_release_it_claims(tmp_path, capsys):
    tree = _unpack("0.5.23", tmp_path)
    (metadata,) = tree.glob("sglang-*.dist-info/METADATA")
    metadata.write_text(metadata.read_text().replace("Version: 0.5.23", "Version: 0.5.10"))
    before = _read(tree)
    assert upstream.apply(tree, dry_run=True) == 1
    assert "does not apply cleanly to sglang 0.5.10" in capsys.readouterr().err
    assert _read(tree) == before


def test_apply_refuses_an_unreadable_version(tmp_path, capsys):
    tree = _unpack("0.5.23", tmp_path)
    for path in [*tree.glob("sglang-*.dist-info/METADATA"), tree / "sglang" / "_version.py"]:
        path.unlink()
    assert upstream.apply(tree, dry_run=True) == 2
    assert "cannot read the sglang version" in capsys.readouterr().err


@pytest.mark.parametrize("tool", TOOLS, indirect=True)
def test_apply_to_a_source_checkout(tool, tmp_path):
    """An SGLang git checkout keeps the package under python/ and has no dist-info."""
    tree = _unpack("0.5.23", tmp_path / "python")
    for metadata in tree.glob("sglang-*.dist-info/METADATA"):
        metadata.unlink()
    if shutil.which("git"):
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert upstream.check(tmp_path).version == "0.5.23"
    assert upstream.apply(tmp_path) == 0
    assert upstream.check(tmp_path).fixed


def test_carried_fix_follows_check(tmp_path, monkeypatch):
    tree = _unpack("0.5.23", tmp_path)
    monkeypatch.setattr(release, "installed_root", lambda: tree)
    monkeypatch.setattr(upstream, "installed_root", lambda: tree)
    assert release.carried_fix() is None
    assert upstream.apply(tree) == 0
    assert "carries the patches/ diff sglang-0.5.23-sm120-fp4" in release.carried_fix()
    monkeypatch.setattr(upstream, "installed_root", lambda: None)
    assert upstream.check().exit_code == 2


def _ledger_states() -> dict[str, str]:
    import sm120_fp4

    return {p.name: p.state for p in sm120_fp4.status().patches}


@case(
    "own failures",
    "SGLang patched with `scripts/upstream_patches.py apply` (the dense-GEMM diff) and SM120_FP4=1, with a {kernel} kernel",
    "install() patches as on an unpatched tree (the same ledger), the status names the diff, and every dense and MoE layer "
    "is still checked: a kernel that turns wrong after the generic self-test is refused at the layer, naming it",
)
@pytest.mark.parametrize("kernel", slow_but_one(["dense", "MoE"]))  # the MoE case: 6 s of CPU
def test_a_tree_patched_with_the_upstream_diff_keeps_every_check_on(tmp_path, monkeypatch, sglang_unpatched, kernel):
    from helpers import moe_faults
    from helpers.children import all_zeros
    from helpers.common import simulated_moe_skip_reason

    import sm120_fp4
    from sm120_fp4 import backends, serving
    from sm120_fp4.demo import synthetic
    from sm120_fp4.errors import RefusedToServe
    from sm120_fp4.sglang import layers

    if kernel == "MoE" and simulated_moe_skip_reason() is not None:
        pytest.skip(simulated_moe_skip_reason())
    moe_layers = pytest.importorskip("sm120_fp4.sglang.moe_layers")
    plain, patched = _unpack("0.5.23", tmp_path / "plain"), _unpack("0.5.23", tmp_path / "patched")
    assert upstream.apply(patched) == 0 and upstream.check(patched).fixed
    sim = dict(simulate="12.0", backends="emulated", moe_backends="emulated")
    monkeypatch.setattr(release, "installed_root", lambda: plain)
    sm120_fp4.install(**sim)
    unpatched_ledger = _ledger_states()
    sm120_fp4.uninstall()

    monkeypatch.setattr(release, "installed_root", lambda: patched)
    status = sm120_fp4.install(**sim)
    assert status.installed and "carries the patches/ diff sglang-0.5.23-sm120-fp4" in status.message
    assert _ledger_states() == unpatched_ledger, "the same runtime patches, re-check and MoE seam included"
    if kernel == "dense":
        layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    else:
        moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(8, 256, 128, seed=1), 2)
    [decision] = [d for d in serving.decisions() if d.family == kernel.lower()]
    assert decision.verified and decision.layers and decision.layers[0].passed
    sm120_fp4.uninstall()

    late_moe = moe_faults.after_generic(
        moe_faults.drops_one_expert
    )  # passes the generic MoE self-test, then drops an expert

    def late_dense(*args):  # passes the generic self-test, then returns zeros (at the layer's own check)
        return (backends.emulated_mm_fp4 if not serving.decisions() else all_zeros)(*args)

    if kernel == "dense":
        backends.register("late-zeros", late_dense)
        sm120_fp4.install(**{**sim, "backends": "late-zeros"})
        with pytest.raises(
            RefusedToServe, match=r"(?s)failed the served-layer check: ModelOptFp4LinearMethod N=32 K=64"
        ):
            layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    else:
        backends.register_moe("late-faulty", late_moe)
        sm120_fp4.install(**{**sim, "moe_backends": "late-faulty"})
        with pytest.raises(RefusedToServe, match=r"(?s)failed the served-layer check: ModelOptNvFp4FusedMoEMethod E=8"):
            moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(8, 256, 128, seed=1), 2)


def test_unknown_action_is_2(capsys):
    assert upstream.main("frobnicate") == 2
    assert "'frobnicate'" in capsys.readouterr().err


# ---------------------------------------------------------------- the start-up check in each diff


def _good_gemm(a, b, a_sf, b_sf, alpha, out_dtype, n):
    return nvfp4.reference_mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype)


FAULTS = {
    "zeros": (lambda *args: torch.zeros(args[0].shape[0], args[6], dtype=torch.bfloat16), "all-zero output rows"),
    "nan rows": (lambda *args: _good_gemm(*args).index_fill(0, torch.tensor([0]), float("nan")), "non-finite output"),
    "25x scale": (lambda *args: _good_gemm(*args) / 25, "relative error"),
    "rows 64-127 zero at M>128": (
        lambda *args: (
            _good_gemm(*args).index_fill(0, torch.arange(64, min(128, args[0].shape[0])), 0.0)
            if args[0].shape[0] > 128
            else _good_gemm(*args)
        ),
        "M=129, N=256, K=512: all-zero output rows",
    ),
}


def _load_check(source: str, gemm, transposed: bool = True) -> object:
    """`_verify_fp4_gemm_once` from a patched modelopt_quant.py, on CPU with nvfp4 standing in."""
    tree = ast.parse(source)
    nodes = [
        n
        for n in tree.body
        if (isinstance(n, ast.FunctionDef) and n.name == "_verify_fp4_gemm_once")
        or (
            isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "_FP4_GEMM_VERIFIED_DEVICES" for t in n.targets)
        )
    ]
    assert len(nodes) == 2, "the diff defines _verify_fp4_gemm_once and _FP4_GEMM_VERIFIED_DEVICES"
    backend = SimpleNamespace(value="flashinfer_cutlass", is_cutlass=lambda: not transposed)
    namespace = {
        "torch": torch,
        "fp4_quantize": lambda x, global_scale: nvfp4.quantize(x, global_scale),
        "fp4_gemm": gemm,
        "enable_flashinfer_fp4_gemm": True,
        "get_fp4_gemm_runner_backend": lambda: backend,
    }
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "modelopt_quant.py", "exec"), namespace)
    return namespace["_verify_fp4_gemm_once"]


@pytest.fixture(scope="module")
def patched_sources(tmp_path_factory) -> dict[str, str]:
    sources = {}
    for diff in DIFFS:
        tree = _unpack(diff.release, tmp_path_factory.mktemp(diff.release))
        _gnu_patch(tree, diff)
        sources[diff.release] = (tree / MQ_FILE).read_text()
    return sources


@pytest.mark.parametrize("diff", DIFFS, ids=[d.release for d in DIFFS])
def test_startup_check_passes_a_correct_gemm(diff, patched_sources):
    calls = []

    def gemm(*args):
        calls.append(args[0].shape[0])
        return _good_gemm(*args)

    verify = _load_check(patched_sources[diff.release], gemm)
    verify(torch.device("cpu"))
    assert calls == [1, 7, 129, 1000]
    verify(torch.device("cpu"))
    assert len(calls) == 4, "once per device"


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
@pytest.mark.parametrize("diff", DIFFS, ids=[d.release for d in DIFFS])
def test_startup_check_refuses_wrong_output(diff, fault, patched_sources):
    gemm, expected = FAULTS[fault]
    verify = _load_check(patched_sources[diff.release], gemm)
    with pytest.raises(RuntimeError, match="start-up check failed") as info:
        verify(torch.device("cpu"))
    assert expected in str(info.value) and "--fp4-gemm-backend=flashinfer_cutlass" in str(info.value)


def test_startup_check_of_0_5_10_passes_untransposed_weights_to_sglang_cutlass(patched_sources):
    """0.5.10's own cutlass backend takes the weight untransposed, as its apply() passes it."""

    def gemm(a, b, a_sf, b_sf, alpha, out_dtype, n):
        assert b.is_contiguous() and b.shape == (n, a.shape[1])
        return _good_gemm(a, b.T, a_sf, b_sf.T, alpha, out_dtype, n)

    _load_check(patched_sources["0.5.10"], gemm, transposed=False)(torch.device("cpu"))


# ---------------------------------------------------------------- the installed release: import it patched

_IMPORT_PATCHED = textwrap.dedent(
    """
    import importlib, importlib.abc, importlib.util, json, sys, types, warnings
    warnings.simplefilter("ignore")
    MQ = "sglang.srt.layers.quantization.modelopt_quant"
    PATCHED = sys.argv[1]

    class Redirect(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            return importlib.util.spec_from_file_location(name, PATCHED) if name == MQ else None

    sys.meta_path.insert(0, Redirect())
    import torch
    mq = importlib.import_module(MQ)
    from sglang.srt.layers.quantization import fp4_utils
    import sglang.kernels.ops.gemm as gemm_ops

    result = {"file": mq.__file__, "calls_check": "_verify_fp4_gemm_once" in
              __import__("inspect").getsource(mq.ModelOptFp4LinearMethod.process_weights_after_loading)}
    seen = {}

    def fake_mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype, out=None, backend="auto"):
        seen.update(backend=backend, out=None if out is None else [list(out.shape), str(out.dtype), out.is_contiguous()])
        return out if out is not None else torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    mq.flashinfer_fp4_gemm = fake_mm_fp4
    gemm_ops.try_qwen3x_nvfp4_gemm = lambda *args: None
    body = mq.fp4_gemm.__wrapped__
    a, b = torch.zeros(3, 16, dtype=torch.uint8), torch.zeros(40, 16, dtype=torch.uint8).T
    E = fp4_utils.Fp4GemmRunnerBackend
    for sm12x in (True, False):
        mq.get_platform = lambda: types.SimpleNamespace(is_sm120=sm12x)
        for member in ("AUTO", "FLASHINFER_CUDNN", "FLASHINFER_CUTLASS", "FLASHINFER_TRTLLM"):
            mq.get_fp4_gemm_runner_backend = lambda: E[member]
            seen.clear()
            body(a, b, None, None, torch.ones(()), torch.bfloat16, 40)
            result[f"{sm12x}/{member}"] = dict(seen)
    print("RESULT" + json.dumps(result))
    """
)


def _import_patched(folder: Path) -> Popen:
    """Unpack the installed release, apply its diff, and import it patched in a background child."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed")
    diff = upstream.diff_for(version)
    if diff is None or diff.release != "0.5.23":
        pytest.skip(f"the import test knows 0.5.23's op signature; sglang {version} is installed")
    tree = _unpack(version, folder / "tree")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        if upstream.apply(tree) != 0:
            raise RuntimeError(f"the diff does not apply to the installed release: {err.getvalue()}")
    patched = tree / MQ_FILE
    return Popen([sys.executable, "-c", _IMPORT_PATCHED, str(patched)], clean_env(), folder)


@background(_import_patched)
def test_installed_release_imports_patched_and_makes_the_runtime_decision(background):
    _, stdout, stderr = background
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, stdout[-3000:] + stderr[-3000:]
    result = json.loads(line[len("RESULT") :])
    assert result["file"].endswith("/tree/" + MQ_FILE) and result["calls_check"]  # the patched copy was imported
    out = [[3, 40], "torch.bfloat16", True]
    # SM12x: auto/cudnn -> cutlass, with a contiguous out; the others keep their backend, get out too.
    assert result["True/AUTO"] == {"backend": "cutlass", "out": out}
    assert result["True/FLASHINFER_CUDNN"] == {"backend": "cutlass", "out": out}
    assert result["True/FLASHINFER_CUTLASS"] == {"backend": "cutlass", "out": out}
    assert result["True/FLASHINFER_TRTLLM"] == {"backend": "trtllm", "out": out}
    # Other GPUs: exactly the release's behaviour.
    assert result["False/AUTO"] == {"backend": "auto", "out": None}
    assert result["False/FLASHINFER_CUDNN"] == {"backend": "cudnn", "out": None}
