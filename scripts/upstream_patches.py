"""The same fix as source diffs (``patches/``): ``python scripts/upstream_patches.py check|apply``.

A maintainer script for upstream PRs; the product is the runtime patch (``install()``).

Each diff in :data:`DIFFS` makes the runtime patch's decision in SGLang's own code and adds a start-up check;
every patched line carries ``# sm120-fp4: sglang-<release>-sm120-fp4``, which :func:`check` recognises.
``patches/LEDGER.md`` is rendered from :data:`DIFFS`. SGLang is located and read, never imported.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sm120_fp4.sglang.release import FP4_UTILS_FILE, MQ_FILE, RELEASE, fix_marker, installed_root  # noqa: E402
from sm120_fp4.versions import installed_version  # noqa: E402

__all__ = ["Diff", "DIFFS", "CheckResult", "check", "apply", "main", "diff_for", "patch_path", "patches_dir"]

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
    "output at start-up (then `python scripts/upstream_patches.py check` says 'fixed' for that tree)"
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
    """Return the diff made for (or exact for) SGLang `version`, or None."""
    return next((d for d in DIFFS if version in d.releases), None)


def patches_dir() -> Path:
    """Return `patches/` of this source checkout."""
    return Path(__file__).resolve().parent.parent / "patches"


def patch_path(diff: Diff) -> Path:
    return patches_dir() / diff.filename


def _sglang_root(target: Path) -> Path | None:
    """Return the directory holding the ``sglang`` package: `target`, or `target`/python (a git checkout)."""
    for root in (target, target / "python"):
        if (root / "sglang" / "__init__.py").is_file():
            return root
    return None


_VERSION_ASSIGN = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", re.M)
# Where a tree's version is written, in the order they are trusted.
_VERSION_SOURCES = (
    ("sglang-*.dist-info/METADATA", re.compile(r"^Version:\s*(\S+)", re.M)),
    ("sglang/_version.py", _VERSION_ASSIGN),
    ("sglang/version.py", _VERSION_ASSIGN),
    ("pyproject.toml", re.compile(r'^version\s*=\s*"([^"]+)"', re.M)),
)


def tree_version(root: Path) -> str | None:
    """Return SGLang's version in `root`: its dist-info METADATA, else its version file, else pyproject.toml."""
    for pattern, version in _VERSION_SOURCES:
        for path in sorted(root.glob(pattern)):
            match = version.search(path.read_text(errors="replace")) if path.is_file() else None
            if match:
                return match.group(1)
    return None


def check(site_dir: str | os.PathLike | None = None) -> CheckResult:
    """Return whether the SGLang in `site_dir` (default: the installed one) already contains the fix."""
    root = installed_root() if site_dir is None else _sglang_root(Path(site_dir))
    if root is None and site_dir is None:
        return CheckResult("no-sglang", "sglang is not installed (no importable 'sglang' package)")
    if root is None:
        return CheckResult("no-sglang", f"no sglang package in {site_dir} (looked for sglang/ and python/sglang/)")
    version = tree_version(root) or (installed_version("sglang") if site_dir is None else None)
    diff = diff_for(version) if version else None
    where = f"sglang {version or '(unknown version)'} at {root / 'sglang'}"
    if not (root / MQ_FILE).is_file():
        return CheckResult("unsupported", f"{where} has no {MQ_FILE}: not a release this fix knows", version, root)
    marker = fix_marker(root)
    if marker:
        made_for = "" if version in (None, marker.group(2)) else f" (made for {marker.group(2)})"
        message = f"{where} contains the fix: patch {marker.group(1)}{made_for}"
        return CheckResult("fixed", message, version, root, marker.group(1), diff)
    if version is None:
        return CheckResult("unsupported", f"cannot read the sglang version in {root}", None, root)
    supported, reason = RELEASE.support(version)
    if not supported:
        return CheckResult("unsupported", reason, version, root)
    remedy = (
        f"`python scripts/upstream_patches.py apply` ({diff.filename}) or the runtime patch, install()"
        if diff
        else "the runtime patch, install() (no source diff for this release)"
    )
    return CheckResult("not-fixed", f"{where} does not contain the fix; use {remedy}", version, root, None, diff)


def _tool() -> str | None:
    """Return GNU patch if present, else git, else None (the command is then printed, not run)."""
    return next((name for name in ("patch", "git") if shutil.which(name)), None)


def _command(tool: str, root: Path, patch: Path, dry_run: bool) -> list[str]:
    if tool == "patch":
        options = "-p1 --forward --batch --fuzz=0 --no-backup-if-mismatch".split()
        return ["patch", *options, "-d", str(root), "-i", str(patch), *(["--dry-run"] if dry_run else [])]
    return ["git", "apply", "-p1", "--verbose", *(["--check"] if dry_run else []), str(patch)]


def apply(target: str | os.PathLike | None = None, dry_run: bool = False) -> int:
    """Apply the diff matching the SGLang in `target` (default: the installed one); return 0 done, 1 failed, 2 refused."""
    root = installed_root() if target is None else _sglang_root(Path(target))
    if root is None and target is None:
        return _refuse("sglang is not installed; pass --target DIR (a site-packages or source tree)")
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
    if tool is None:
        command = " ".join(shlex.quote(part) for part in _command("patch", root, patch, dry_run))
        return _refuse(f"neither GNU patch nor git is installed; install one, or run this where one is:\n  {command}")
    where = f"sglang {version} in {root} ({tool})"
    failed = f"{diff.filename} does not apply cleanly to {where}; the tree differs from the release"
    if not _run(tool, root, patch, True, failed):
        return 1
    if dry_run:
        print(f"dry run: {diff.filename} applies cleanly to {where}; would change {', '.join(diff.files)}")
        return 0
    if not _run(tool, root, patch, False, f"applying {diff.filename} in {root} failed ({tool})"):
        return 1
    print(f"applied {diff.filename} to sglang {version} in {root}: changed {', '.join(diff.files)}")
    return 0


def _run(tool: str, root: Path, patch: Path, dry_run: bool, failed: str) -> bool:
    """Apply `patch` (-p1) under `root` with `tool`, print its output (and `failed` if it fails); return ok."""
    # git: never let it find a repository above root (paths in the diff are relative to root).
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)} if tool == "git" else None
    proc = subprocess.run(_command(tool, root, patch, dry_run), cwd=root, env=env, capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).strip()
    if output:
        print(output)
    if proc.returncode != 0:
        print(f"error: {failed}", file=sys.stderr)
    return proc.returncode == 0


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(action: str, dry_run: bool = False, target: str | None = None) -> int:
    """Run `check|apply`: print the answer, return the exit code."""
    if action == "check":
        result = check(target)
        print(result.message, file=sys.stdout if result.exit_code < 2 else sys.stderr)
        return result.exit_code
    if action == "apply":
        return apply(target, dry_run=dry_run)
    return _refuse(f"patches: unknown action {action!r} (expected 'check' or 'apply')")


def cli(argv: list[str] | None = None) -> int:
    """`python scripts/upstream_patches.py check|apply [--dry-run] [--target DIR]`."""
    parser = argparse.ArgumentParser(
        description="the same fix as upstream-ready diffs: check the installed SGLang, or apply"
    )
    parser.add_argument("action", choices=["check", "apply"])
    parser.add_argument("--dry-run", action="store_true", help="apply: show whether the diff applies, change nothing")
    parser.add_argument(
        "--target", help="apply: a site-packages, unpacked wheel or SGLang source tree (default: installed)"
    )
    args = parser.parse_args(argv)
    return main(args.action, dry_run=args.dry_run, target=args.target)


if __name__ == "__main__":
    sys.exit(cli())
