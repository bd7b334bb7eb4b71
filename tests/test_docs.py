"""Documentation that is generated from, or checked against, the code."""

from __future__ import annotations

import re
import typing
from collections import Counter
from pathlib import Path

from helpers.procs import background

from sm120_fp4.config import Settings, env_name
from sm120_fp4.config.values import DURATIONS
from sm120_fp4.tables import markdown_table

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()

# The README's "accepted" column where a setting's type does not list its values.
ACCEPTED = {
    "toggle": "`1`, `on`, `0`, `off`",
    **dict.fromkeys(("backends", "moe_backends"), "`auto` or comma-separated names"),
    "simulate": "`MAJOR.MINOR`: `12.0`, `12.1`, or another NVIDIA GPU's (7.0 to 11.0; SGLang left untouched)",
    "report": "a path",
    "verdicts": "a file path, or `off`",
    **{
        f: ("`off`, or " if f == "canary" else "")
        + f"{unit}, {least:g} <= {unit[0] if unit == 'seconds' else 'ms'} <= {most:g}"
        for f, (least, most, unit) in DURATIONS.items()
    },
}


def accepted(field: str) -> str:
    choices = typing.get_args(Settings.model_fields[field].annotation)
    if field not in ACCEPTED and choices and all(isinstance(c, str) for c in choices):
        return ", ".join(f"`{c}`" for c in choices)
    return ACCEPTED.get(field, "")


def settings_table() -> str:
    """Return the README's table of every setting, generated from Settings (its Field descriptions: the meaning)."""
    rows = []
    for field, info in Settings.model_fields.items():
        default = info.default
        given = "unset" if default is None else ",".join(default) if isinstance(default, tuple) else str(default)
        rows.append((f"`{env_name(field)}`", f"`{given}`", accepted(field), info.description))
    return "\n".join(markdown_table(("variable", "default", "accepted", "meaning"), rows))


def test_readme_settings_table_is_generated_from_settings():
    block = re.search(r"<!-- settings-table:start -->\n(.*?)\n<!-- settings-table:end -->", README, re.S)
    assert block, "README lost its settings-table markers"
    table = settings_table()
    assert block.group(1) == table, f"put this table between the README's settings-table markers:\n{table}"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert blocks[0] == "bash scripts/setup_env.sh && .venv/bin/python -m sm120_fp4 demo"
    assert blocks[1] == "bash scripts/setup_env.sh --with-vllm && .venv/bin/python -m pytest"
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert blocks[1] in ci.splitlines()


def readme_refusal() -> list[str]:
    block = re.search(r"\*\*The refusal\*\*.*?```\n(.*?)\n```", README, re.S)
    return block.group(1).splitlines()


def test_reliability_md_has_exactly_the_declared_cases():
    """RELIABILITY.md's rows are the @case declarations of the test files (refresh the outcomes with
    `python scripts/reliability_table.py`); a case added, changed or removed makes this fail."""
    from helpers.cases import AREAS, declared_cases

    def cell(text: str) -> str:  # as scripts/reliability_table.py writes a cell
        return text.replace("|", "\\|").replace("\n", " ")

    text = (Path(__file__).resolve().parents[1] / "RELIABILITY.md").read_text()
    rows = [
        re.split(r"(?<!\\) \| ", line[2:-2])
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| area |")
    ]
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    assert all(area.replace("\\|", "|") in AREAS for area, *_ in rows)
    in_file = Counter((area, case, expected) for area, case, expected, _ in rows)
    declared = Counter(tuple(cell(field) for field in fields) for fields in declared_cases())
    assert in_file == declared, (
        f"stale RELIABILITY.md: run python scripts/reliability_table.py\n"
        f"  declared, not in the file: {sorted(declared - in_file)}\n  in the file, not declared: {sorted(in_file - declared)}"
    )
    assert f"**{len(rows)} cases:" in text


# ---- README and docs for readers ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_shows_install_in_python_near_the_top():
    lines = README.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200 (details go to docs/)"
    block = re.search(r"```python\n(.*?)\n```", README, re.S)
    assert block and "sm120_fp4.install()" in block.group(1), "README lost its Python block with install()"
    assert README[: block.start()].count("\n") < 60, "the install() block is not within README's first 60 lines"


def test_benchmarks_is_current_only():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 250, "BENCHMARKS.md keeps the current numbers only (the history is in git)"
    cells = [cell for line in text.splitlines() if line.startswith("|") for cell in re.split(r"(?<!\\)\|", line)]
    long = [cell.strip()[:80] for cell in cells if len(cell.strip()) > 200]
    assert not long, f"table cells over 200 characters: {long}"


# Words about how the project was built, not about the product. Written so this file does not match
# itself; upstream projects' issues ("FlashInfer issue 2577", "SGLang #123") are fine.
PROCESS_WORDS = re.compile(
    r"(second|third|fourth|fifth|sixth|seventh|this|next|last) session|issue #?[0-9]|items? (numbered )?[0-9]+\."
    r"|round (two|three|four)|the lent[ ]|device[ ]call|this[ ]stop",
    re.I,
)
UPSTREAM = re.compile(r"(FlashInfer|SGLang|vLLM|Humming|CUTLASS|torch|Triton|upstream)\S*\s+(\S+\s+){0,2}$", re.I)
SHIPPED = (
    "README.md",
    "BENCHMARKS.md",
    "RELIABILITY.md",
    "CHANGELOG.md",
    "ARCHITECTURE.md",
    "docs/**/*.md",
    "scripts/*",
    "benchmarks/**/*.py",
    "sm120_fp4/**/*.py",
    "tests/**/*.py",
)


def process_words(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        for match in PROCESS_WORDS.finditer(line):
            if match.group(0).lower().startswith("issue") and UPSTREAM.search(line[: match.start()]):
                continue
            found.append(line.strip()[:160])
    return found


def test_process_words_finds_them_and_leaves_upstream_issues_alone():
    # The samples are put together here, so that this file does not hold the words it looks for.
    assert process_words("as measured in the fifth " + "session") and process_words(
        "see " + "issue " + "20, items numbered " + "22.1"
    )
    assert (
        process_words("the " + "lent H200")
        and process_words("in one device " + "call")
        and process_words("round " + "two")
    )
    assert not process_words("FlashInfer issue 2577 and SGLang #20047") and not process_words(
        "the weight-update session"
    )


def test_no_process_words_in_shipped_files():
    files = {
        path
        for pattern in SHIPPED
        for path in ROOT.glob(pattern)
        if path.is_file() and path.suffix not in (".png", ".pyc")
    }
    files.discard(Path(__file__).resolve())  # the word list itself
    hits = [f"{path.relative_to(ROOT)}: {line}" for path in sorted(files) for line in process_words(path.read_text())]
    assert not hits, "the product speaks of itself only:\n" + "\n".join(hits)


def test_version_is_the_newest_release_of_the_changelog():
    from helpers.procs import run_cli

    from sm120_fp4._version import __version__

    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## \[Unreleased\]$", changelog, re.M), "CHANGELOG.md has an [Unreleased] section on top"
    newest = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert newest, "CHANGELOG.md has no dated release heading (## [X.Y.Z] - YYYY-MM-DD)"
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"sm120-fp4 {__version__}" and __version__ == newest.group(1)


def test_sglang_extra_pins_the_supported_range():
    import tomllib

    from sm120_fp4.sglang.release import SUPPORTED

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang{SUPPORTED}"]


def readme_commands() -> list[str]:
    """Every command line of README's bash blocks (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)\n```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(re.sub(r"\s+", " ", line))
    return commands


# README's command lines that need a 12.x GPU, a network, or minutes, with where they are tested
# instead; every other one of ours is run below, on this CPU, as written.
ELSEWHERE = {
    "bash scripts/setup_env.sh && .venv/bin/python -m sm120_fp4 demo": "test_cli.py (the demo); .ci/run",
    "bash scripts/setup_env.sh --with-vllm && .venv/bin/python -m pytest": ".ci/run",
    "pip install sm120-fp4": "a network",
    'pip install "sm120-fp4[sglang]"': "a network; test_sglang_extra_pins_the_supported_range",
    "SM120_FP4=1 python -m sglang.launch_server --model-path nvidia/Llama-3.1-8B-Instruct-FP4 --quantization modelopt_fp4": "a 12.x GPU",
    "sm120-fp4 launch -- python -m sglang.launch_server --model-path nvidia/Llama-3.1-8B-Instruct-FP4 --quantization modelopt_fp4": "a 12.x GPU",
    "SM120_FP4_SIMULATE=12.0 SM120_FP4_BACKENDS=emulated SM120_FP4_MOE_BACKENDS=emulated .venv/bin/python -m sm120_fp4 selftest --model DIR": "test_model_check.py (a minute of CPU)",
    ".venv/bin/python -m sm120_fp4 demo --server --model-path DIR": "test_demo_server.py (a real server)",
}


def _ours_to_run() -> list[str]:
    """README's command lines run below: every one not listed in ELSEWHERE."""
    return [command for command in readme_commands() if command not in ELSEWHERE]


# One child runs each command line after the other (a background job: it starts at the session's start and runs
# beside the in-process tests, about a minute of CPU on 2 cores, most of it `doctor` importing SGLang) and prints
# [argv, exit code, stdout, stderr] of each as JSON.
_RUN_EACH = """
import json, subprocess, sys
runs = []
for argv in json.loads(sys.argv[1]):
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=240)
    runs.append([argv, done.returncode, done.stdout, done.stderr])
print(json.dumps(runs))
"""


def _readme_commands_job(folder):
    import json
    import sys

    from helpers.procs import Popen, clean_env

    from sm120_fp4.demo.checkpoint import write_checkpoint

    ckpt = write_checkpoint(str(folder / "ckpt"), seed=1)
    argvs = [
        ["-m", "sm120_fp4", *(ckpt if word == "DIR" else word for word in command.split()[1:])]
        for command in _ours_to_run()
        if command.split()[0] == "sm120-fp4"  # the test names any other
    ]
    block = re.search(r"```python\n(.*?)\n```", README, re.S).group(1)
    return Popen(
        [sys.executable, "-c", _RUN_EACH, json.dumps([*argvs, ["-c", block]])], clean_env(), folder, timeout=900
    )


@background(_readme_commands_job)
def test_readme_cpu_commands_work_as_written(background):
    """The README's cheap CPU command lines, run here as written (`sm120-fp4 X` as `python -m sm120_fp4 X`,
    the same program; DIR a checkpoint); the others are listed in ELSEWHERE with where they are tested."""
    import json

    for command in _ours_to_run():
        words = command.split()
        assert words[0] == "sm120-fp4" and "=" not in words[0], (
            f"README command not run and not listed in ELSEWHERE: {command}"
        )
    rc, out, err = background
    assert rc == 0, err[-3000:]
    *ran, (_, block_rc, block_out, block_err) = json.loads(out)
    assert len(ran) == len(_ours_to_run())
    said = {}
    for command, (argv, code, stdout, stderr) in zip(_ours_to_run(), ran):
        assert code == 0, f"{command}: exit {code}\n{stderr[-2000:]}"
        said[command] = stdout + stderr
    assert {"sm120-fp4 --version", "sm120-fp4 doctor", "sm120-fp4 selftest", "sm120-fp4 selftest --model DIR"} <= set(
        said
    )
    # On a CPU, `selftest --model DIR` says exactly what the README shows for verifying there.
    assert (
        "SM120_FP4_SIMULATE=12.0 SM120_FP4_BACKENDS=emulated SM120_FP4_MOE_BACKENDS=emulated"
        in said["sm120-fp4 selftest --model DIR"]
    )
    assert f"sm120-fp4 {__import__('sm120_fp4').__version__}" in said["sm120-fp4 --version"]
    # The Python block, as written: on a CPU it installs nothing and says why.
    assert block_rc == 0 and "no compute-capability 12.x GPU visible" in block_out, block_err[-2000:]
