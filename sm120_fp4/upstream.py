"""The same fix as source diffs (``patches/``): their ledger, ``patches check`` and ``patches apply``.

For teams that bake a patched SGLang into an image or send the fix upstream instead of patching at
run time. Each diff in :data:`DIFFS` makes the runtime patch's decision in SGLang's own code (cutlass
with ``alpha`` and a contiguous ``out`` on SM12x, ``auto``/``cudnn`` only) and adds a start-up check
that refuses to serve on wrong output. Every patched line carries the marker
``# sm120-fp4: sglang-<release>-sm120-fp4``, which is how :func:`check` recognises a patched tree.

``patches/LEDGER.md`` is rendered by :func:`render_ledger` from ``sglang_targets.ledger_rows()`` and
:data:`DIFFS` (``python -m sm120_fp4.upstream --write-ledger``); a test keeps the file equal to it.

Standard library only (plus ``packaging``); SGLang is located and read, never imported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "Diff",
    "DIFFS",
    "UPSTREAM_FIXED_IN",
    "CheckResult",
    "check",
    "apply",
    "main",
    "runtime_patch_needed",
    "diff_for",
    "patch_path",
    "render_ledger",
]

MQ_FILE = "sglang/srt/layers/quantization/modelopt_quant.py"
FP4_UTILS_FILE = "sglang/srt/layers/quantization/fp4_utils.py"
MARKER = re.compile(r"#\s*sm120-fp4:\s*(sglang-(\S+?)-sm120-fp4)\b")
# SGLang releases that contain an equivalent fix themselves (a specifier, e.g. ">=0.6.0"). None
# does as of 0.5.23; set this when one does, and `patches check` answers "fixed" for it.
UPSTREAM_FIXED_IN = ""

_CHECK_SUMMARY = (
    "adds `_verify_fp4_gemm_once(device)`, called from "
    "`ModelOptFp4LinearMethod.process_weights_after_loading` on SM12x: exactly representable NVFP4 "
    "inputs quantized with SGLang's `fp4_quantize`, the GEMM through SGLang's `fp4_gemm` op at "
    "M = 1, 7, 129, 1000, and a RuntimeError (refuse to serve) on non-finite output, all-zero rows "
    "or a row relative error above 1e-2"
)
_OP_SUMMARY = (
    "the `sglang::fp4_gemm` op body, on SM12x only, maps FlashInfer backend `auto`/`cudnn` to "
    "`cutlass` (same 128x4 weight layout) and passes a preallocated contiguous `out` "
    "(`alpha` is already `layer.alpha`); other backends and other GPUs are unchanged"
)
_REMOVE_DIFF = (
    "when the image moves to a release with no diff here (use the runtime patch there), or to an "
    "SGLang release that passes a verified backend with alpha and out on SM12x and checks the "
    "output at start-up (then `sm120-fp4 patches check` says fixed and UPSTREAM_FIXED_IN lists it)"
)


@dataclass(frozen=True)
class Diff:
    """One upstream-ready diff: made against `release`, also exact for the releases in `also`."""

    release: str
    also: tuple[str, ...]
    files: tuple[str, ...]
    changes: str
    why: str
    upstream: str
    remove_when: str = _REMOVE_DIFF

    @property
    def id(self) -> str:
        return f"sglang-{self.release}-sm120-fp4"

    @property
    def filename(self) -> str:
        return f"{self.id}.patch"

    @property
    def releases(self) -> tuple[str, ...]:
        return (self.release, *self.also)


DIFFS: tuple[Diff, ...] = (
    Diff(
        release="0.5.8",
        also=("0.5.8.post1",),
        files=(MQ_FILE,),
        changes=f"{_OP_SUMMARY}; {_CHECK_SUMMARY}",
        why=(
            "0.5.8 passes the default `--fp4-gemm-backend auto` to FlashInfer unresolved (and every "
            "process that never ran `initialize_fp4_gemm_config` does too); FlashInfer's `auto` "
            "(0.6.1 is pinned) tries cuDNN first on SM120 and aborts with CUDNN_STATUS_BAD_PARAM; "
            "`out` is never passed and nothing checks the numbers"
        ),
        upstream="flashinfer#2577 (all zeros), flashinfer#3398 (zeros at some M); sglang 0.5.9 defaults to flashinfer_cutlass",
    ),
    Diff(
        release="0.5.10",
        also=("0.5.10.post1",),
        files=(MQ_FILE, FP4_UTILS_FILE),
        changes=(
            f"{_OP_SUMMARY}; {_CHECK_SUMMARY} (weights untransposed for SGLang's own `cutlass`, as "
            "`apply` does); fp4_utils.py: `initialize_fp4_gemm_config` resolves `auto` to "
            "`flashinfer_cutlass` on SM12x instead of `flashinfer_cudnn`"
        ),
        why=(
            "0.5.10-0.5.12 resolve `auto` to `flashinfer_cudnn` on SM120: the cuDNN path is the one "
            "FlashInfer 0.6.0-0.6.7 fails on SM120 (CUDNN_STATUS_BAD_PARAM building its graph) and "
            "rebuilds a graph per new shape (12-17 s stalls); the cutlass NaN rows that motivated "
            "the switch are what the start-up check refuses"
        ),
        upstream="sglang#20043 / PR 20047 (auto -> cudnn on SM120, reverted in 0.5.13), vLLM PR 48210 (cuDNN graph rebuilds)",
    ),
    Diff(
        release="0.5.23",
        also=(),
        files=(MQ_FILE,),
        changes=f"{_OP_SUMMARY}; {_CHECK_SUMMARY}",
        why=(
            "0.5.13+ resolve `auto` to `flashinfer_cutlass` on SM12x, but SGLang never passes `out`, "
            "an explicit `flashinfer_cudnn` (or a process that never initialised the enum: `auto`) "
            "still reaches FlashInfer, and nothing verifies the output before serving"
        ),
        upstream="flashinfer#2577, flashinfer#3398, sglang#20043 / PR 20047 (NaN rows); no upstream start-up check exists",
    ),
)

State = Literal["fixed", "not-fixed", "no-sglang", "unsupported"]
_EXIT = {"fixed": 0, "not-fixed": 1, "no-sglang": 2, "unsupported": 2}


@dataclass(frozen=True)
class CheckResult:
    """Whether one SGLang tree contains the fix; `exit_code` is 0 fixed, 1 not fixed, 2 no/unsupported."""

    state: State
    message: str
    version: str | None = None
    root: Path | None = None
    patch_id: str | None = None
    diff: Diff | None = field(default=None, repr=False)

    @property
    def fixed(self) -> bool:
        return self.state == "fixed"

    @property
    def exit_code(self) -> int:
        return _EXIT[self.state]


def diff_for(version: str) -> Diff | None:
    """The diff made for (or exact for) SGLang `version`, or None."""
    return next((d for d in DIFFS if version in d.releases), None)


def patches_dir() -> Path:
    """`patches/` of a source checkout, or the copy a wheel ships as ``sm120_fp4/_patches``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_patches", here.parent / "patches"):
        if candidate.is_dir():
            return candidate
    return here.parent / "patches"


def patch_path(diff: Diff) -> Path:
    return patches_dir() / diff.filename


# ---------------------------------------------------------------- locating and reading a tree


def _sglang_root(target: Path) -> Path | None:
    """The directory holding the ``sglang`` package: `target` (site-packages, unpacked wheel)
    or `target`/python (an SGLang git checkout)."""
    for root in (target, target / "python"):
        if (root / "sglang" / "__init__.py").is_file():
            return root
    return None


def _installed_root() -> Path | None:
    """The site-packages directory of the importable sglang, found without importing it."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


_VERSION_ASSIGN = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", re.M)


def tree_version(root: Path) -> str | None:
    """SGLang's version in `root`: its dist-info METADATA, else ``sglang/_version.py`` or
    ``sglang/version.py`` (a source tree), else ``pyproject.toml``."""
    for metadata in sorted(root.glob("sglang-*.dist-info/METADATA")):
        match = re.search(r"^Version:\s*(\S+)", metadata.read_text(errors="replace"), re.M)
        if match:
            return match.group(1)
    for name in ("sglang/_version.py", "sglang/version.py"):
        path = root / name
        match = _VERSION_ASSIGN.search(path.read_text(errors="replace")) if path.is_file() else None
        if match:
            return match.group(1)
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(errors="replace"), re.M)
        if match:
            return match.group(1)
    return None


def _distribution_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_in(version: str, specifier: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return bool(specifier) and Version(version) in SpecifierSet(specifier)
    except InvalidVersion:
        return False


def _supported(version: str) -> tuple[bool, str]:
    from .sglang_targets import release_support

    return release_support(version)


# ---------------------------------------------------------------- check


def check(site_dir: str | os.PathLike | None = None) -> CheckResult:
    """Whether the SGLang in `site_dir` (default: the installed one) already contains the fix."""
    if site_dir is None:
        root = _installed_root()
        if root is None:
            return CheckResult("no-sglang", "sglang is not installed (no importable 'sglang' package)")
    else:
        root = _sglang_root(Path(site_dir))
        if root is None:
            return CheckResult(
                "no-sglang", f"no sglang package in {site_dir} (looked for sglang/ and python/sglang/)"
            )
    version = tree_version(root) or (_distribution_version() if site_dir is None else None)
    diff = diff_for(version) if version else None
    where = f"sglang {version or '(unknown version)'} at {root / 'sglang'}"
    mq = root / MQ_FILE
    if not mq.is_file():
        return CheckResult("unsupported", f"{where} has no {MQ_FILE}: not a release this fix knows", version, root)
    marker = MARKER.search(mq.read_text(errors="replace"))
    if marker:
        made_for = "" if version in (None, marker.group(2)) else f" (made for {marker.group(2)})"
        return CheckResult(
            "fixed", f"{where} contains the fix: patch {marker.group(1)}{made_for}", version, root, marker.group(1), diff
        )
    if version is None:
        return CheckResult("unsupported", f"cannot read the sglang version in {root}", None, root)
    if _version_in(version, UPSTREAM_FIXED_IN):
        return CheckResult("fixed", f"{where} contains the fix upstream ({UPSTREAM_FIXED_IN})", version, root)
    supported, reason = _supported(version)
    if not supported:
        return CheckResult("unsupported", reason, version, root)
    remedy = (
        f"`sm120-fp4 patches apply` ({diff.filename}) or the runtime patch, install()"
        if diff
        else "the runtime patch, install() (no source diff for this release)"
    )
    return CheckResult("not-fixed", f"{where} does not contain the fix; use {remedy}", version, root, None, diff)


def runtime_patch_needed() -> tuple[bool, str]:
    """(False, why) when the installed SGLang already contains the fix, else (True, why)."""
    result = check()
    if result.fixed:
        return False, f"the installed SGLang already contains the fix ({result.message}); runtime patch not needed"
    return True, result.message


# ---------------------------------------------------------------- apply


def _tool() -> str:
    """GNU patch if present, else git apply, else the built-in applier."""
    for name in ("patch", "git"):
        if shutil.which(name):
            return name
    return "python"


def _run(tool: str, root: Path, patch: Path, dry_run: bool) -> tuple[bool, str]:
    """Apply `patch` (-p1) under `root` with `tool`; (ok, what the tool printed)."""
    if tool == "python":
        return _apply_unified(root, patch.read_text(), dry_run)
    if tool == "patch":
        cmd = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch"]
        cmd += ["-d", str(root), "-i", str(patch)]
        cmd += ["--dry-run"] if dry_run else []
        env = None
    else:
        cmd = ["git", "apply", "-p1", "--verbose", *(["--check"] if dry_run else []), str(patch)]
        # Never let git find a repository above root: paths in the diff are relative to root.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _parse_unified(text: str) -> list[tuple[str, list[tuple[int, list[str], list[str]]]]]:
    """[(path without its first component, [(old start, old lines, new lines)])]."""
    files: list[tuple[str, list]] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip().split("/", 1)[-1]
            if path.startswith("/") or ".." in Path(path).parts:
                raise ValueError(f"unsafe path in diff: {path!r}")
            files.append((path, []))
            i += 2
            continue
        match = _HUNK.match(lines[i])
        if match and files:
            old_left, new_left = int(match.group(2) or 1), int(match.group(4) or 1)
            old, new = [], []
            i += 1
            while (old_left or new_left) and i < len(lines):
                tag, body = lines[i][:1], lines[i][1:]
                if tag in (" ", "-"):
                    old.append(body)
                    old_left -= 1
                if tag in (" ", "+"):
                    new.append(body)
                    new_left -= 1
                i += 1
            files[-1][1].append((int(match.group(1)), old, new))
            continue
        i += 1
    return files


def _apply_unified(root: Path, text: str, dry_run: bool) -> tuple[bool, str]:
    """A strict unified-diff applier (exact context, offsets allowed) for hosts without patch/git."""
    results: dict[Path, str] = {}
    report = []
    for path, hunks in _parse_unified(text):
        target = root / path
        if not target.is_file():
            return False, f"can't find file to patch: {path}"
        current = target.read_text().splitlines(keepends=True)
        offset = 0
        for number, (start, old, new) in enumerate(hunks, 1):
            want = max(start - 1 + offset, 0)
            candidates = [want] + [p for p in range(len(current) - len(old) + 1) if p != want]
            at = next((p for p in candidates if current[p : p + len(old)] == old), None)
            if at is None:
                return False, f"hunk #{number} of {path} does not apply (context differs)"
            current[at : at + len(old)] = new
            offset = at - (start - 1) + len(new) - len(old)
        results[target] = "".join(current)
        report.append(f"{'checking' if dry_run else 'patching'} file {path}")
    if not dry_run:
        for target, content in results.items():
            target.write_text(content)
    return True, "\n".join(report)


def apply(target: str | os.PathLike | None = None, dry_run: bool = False) -> int:
    """Apply the diff matching the SGLang in `target` (default: the installed one); exit code.

    0 applied (or would apply, or already applied), 1 the diff does not apply cleanly,
    2 refused: no sglang, unreadable version, or no diff for that version.
    """
    if target is None:
        root = _installed_root()
        if root is None:
            return _refuse("sglang is not installed; pass --target DIR (a site-packages or source tree)")
    else:
        root = _sglang_root(Path(target))
        if root is None:
            return _refuse(f"--target {target}: no sglang package there (looked for sglang/ and python/sglang/)")
    version = tree_version(root)
    if version is None:
        return _refuse(
            f"cannot read the sglang version in {root} (no sglang-*.dist-info/METADATA, "
            "sglang/_version.py or sglang/version.py with a version): refusing to guess which diff fits"
        )
    diff = diff_for(version)
    if diff is None:
        known = ", ".join(r for d in DIFFS for r in d.releases)
        return _refuse(
            f"sglang {version} in {root}: no diff for this release (diffs: {known}); use the runtime patch, install()"
        )
    state = check(root)
    if state.patch_id == diff.id:
        print(f"{state.message}; nothing to do")
        return 0
    if state.patch_id is not None:
        return _refuse(f"{root}: already carries {state.patch_id}, not {diff.id} for sglang {version}")
    patch = patch_path(diff)
    if not patch.is_file():
        return _refuse(f"{patch} is missing from this installation of sm120_fp4")
    tool = _tool()
    ok, output = _run(tool, root, patch, dry_run=True)
    if output:
        print(output)
    if not ok:
        print(
            f"error: {diff.filename} does not apply cleanly to sglang {version} in {root} ({tool}); "
            "the tree differs from the release",
            file=sys.stderr,
        )
        return 1
    if dry_run:
        print(
            f"dry run: {diff.filename} applies cleanly to sglang {version} in {root} ({tool}); "
            f"would change {', '.join(diff.files)}"
        )
        return 0
    ok, output = _run(tool, root, patch, dry_run=False)
    if output:
        print(output)
    if not ok:
        print(f"error: applying {diff.filename} in {root} failed ({tool})", file=sys.stderr)
        return 1
    print(f"applied {diff.filename} to sglang {version} in {root}: changed {', '.join(diff.files)}")
    return 0


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(action: str, dry_run: bool = False, target: str | None = None) -> int:
    """`sm120-fp4 patches check|apply`: print the answer, return the exit code."""
    if action == "check":
        result = check(target)
        print(result.message, file=sys.stdout if result.exit_code < 2 else sys.stderr)
        return result.exit_code
    if action == "apply":
        return apply(target, dry_run=dry_run)
    return _refuse(f"patches: unknown action {action!r} (expected 'check' or 'apply')")


# ---------------------------------------------------------------- the ledger


def render_ledger() -> str:
    """patches/LEDGER.md, from sglang_targets.ledger_rows() and DIFFS (the single source of truth)."""
    from .sglang_targets import SUPPORTED, ledger_rows

    out = [
        "# Ledger: the SM120 NVFP4 dense-GEMM fix, at run time and as source diffs",
        "",
        "Generated by `python -m sm120_fp4.upstream --write-ledger` from "
        "`sm120_fp4.sglang_targets.ledger_rows()` and `sm120_fp4.upstream.DIFFS`; "
        "`tests/test_upstream_patches.py` fails when this file and the code disagree. "
        "Edit the code, then regenerate.",
        "",
        "`sm120-fp4 patches check` says whether the installed SGLang already contains the fix "
        "(exit 0 fixed, 1 not fixed, 2 no or unsupported SGLang); "
        "`sm120-fp4 patches apply [--dry-run] [--target DIR]` applies the matching diff below "
        "to a site-packages or a source tree and refuses on any other version.",
        "",
        f"## Runtime patch targets (`sm120_fp4.install()`, SGLang {SUPPORTED})",
        "",
    ]
    for spec in ledger_rows():
        out += [
            f"### `{spec.name}`",
            "",
            f"- **Changes:** `{spec.module}.{spec.attribute}`",
            f"- **Releases:** `{spec.versions or SUPPORTED}`",
            f"- **Why:** {spec.why}",
            f"- **Upstream:** {spec.upstream}",
            f"- **Remove:** {spec.remove_when}",
            "",
        ]
    out += [
        "## Source diffs (`patches/`)",
        "",
        "Paths are relative to site-packages / the wheel root: `patch -p1 -d <site-packages> < FILE` "
        "or `git apply -p1 FILE` inside an unpacked wheel. Every added line block carries the "
        "marker `# sm120-fp4: sglang-<release>-sm120-fp4`.",
        "",
    ]
    for diff in DIFFS:
        also = f" (files identical in {', '.join(diff.also)})" if diff.also else ""
        out += [
            f"### `{diff.filename}`",
            "",
            f"- **Releases:** {', '.join(diff.releases)}{also}",
            f"- **Files:** {', '.join(f'`{f}`' for f in diff.files)}",
            f"- **Changes:** {diff.changes}",
            f"- **Why:** {diff.why}",
            f"- **Upstream:** {diff.upstream}",
            f"- **Remove:** {diff.remove_when}",
            "",
        ]
    out += [
        "Every other release in the supported range is covered by the runtime patch only "
        f"(diffs exist for {', '.join(r for d in DIFFS for r in d.releases)}). "
        "Not covered by the diffs: the start-up check for compressed-tensors W4A4 checkpoints "
        "(they share the fixed `fp4_gemm` op, and the runtime patch checks them), NVFP4 MoE "
        "kernels, and the multimodal FP4 path.",
        "",
    ]
    return "\n".join(out)


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sm120_fp4.upstream", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-ledger", action="store_true", help="write patches/LEDGER.md")
    group.add_argument("--check-ledger", action="store_true", help="exit 1 if patches/LEDGER.md is stale")
    group.add_argument("--releases", action="store_true", help="print the SGLang releases that have a diff")
    args = parser.parse_args(argv)
    if args.releases:
        print("\n".join(r for d in DIFFS for r in d.releases))
        return 0
    ledger = patches_dir() / "LEDGER.md"
    if args.write_ledger:
        ledger.write_text(render_ledger())
        print(f"wrote {ledger}")
        return 0
    if not ledger.is_file() or ledger.read_text() != render_ledger():
        print(f"{ledger} is stale: run python -m sm120_fp4.upstream --write-ledger", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
