"""The package's own shape: no import cycle among its modules, and SGLang known in one place.

Read from the source (ast), top-level and lazy (function-level) imports alike."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sm120_fp4"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of the module's syntax tree (parsed once for the tests of this file: they walk the package
    several times)."""
    return tuple(ast.walk(ast.parse(path.read_text())))


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the module, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def test_no_import_cycle_among_the_package_modules():
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        edges[name] = set()
        for _, target in _imports(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if (
                target and target != name and not name.startswith(target + ".")
            ):  # a package's own __init__ is no edge back
                edges[name].add(target)
    # Depth-first search; a back edge is a cycle.
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
    assert len(modules) > 40 and not cycles, cycles


def test_only_the_sglang_subpackage_names_sglangs_modules():
    """Outside sm120_fp4/sglang/ no module imports SGLang or spells one of its module paths; the
    start-up hook takes SGLang's top-level name from sm120_fp4.sglang.names (stdlib-only)."""
    found = []
    for name, path in _modules().items():
        if name == "sm120_fp4.sglang" or name.startswith("sm120_fp4.sglang."):
            continue
        found += [(name, line, target) for line, target in _imports(name, path) if re.match(r"sglang(\.|$)", target)]
        found += [
            (name, node.lineno, node.value)
            for node in _nodes(path)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"sglang\.[a-z_.]+", node.value)
        ]
    assert found == []
    from sm120_fp4 import bootstrap
    from sm120_fp4.sglang import names

    assert bootstrap.SGLANG is names.TOP_LEVEL


def test_only_the_vllm_subpackage_names_vllms_modules():
    """Outside sm120_fp4/vllm/ no module imports vLLM or spells one of its module paths (api.ENGINES lists the
    engine homes by our own package names)."""
    found = []
    for name, path in _modules().items():
        if name == "sm120_fp4.vllm" or name.startswith("sm120_fp4.vllm."):
            continue
        found += [(name, line, target) for line, target in _imports(name, path) if re.match(r"vllm(\.|$)", target)]
        found += [
            (name, node.lineno, node.value)
            for node in _nodes(path)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"vllm\.[a-z_.]+", node.value)
        ]
    assert found == []


def _unit(module: str) -> str:
    """The part of the package a module belongs to, as ARCHITECTURE.md's table names it: its top-level
    module (``api``) or folder (``serving``); the package's own ``__init__`` is ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _folder_imports() -> dict[str, set[str]]:
    """Each part of the package -> the other parts its modules import (top-level and lazy imports)."""
    modules = _modules()
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        unit = _unit(name)
        targets = found.setdefault(unit, set())
        for node in _nodes(path):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                # `from .. import locks` imports the module sm120_fp4.locks (the package's face only for other names)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in names:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and _unit(target) != unit:
                    targets.add(_unit(target))
    return found


def _architecture_table() -> dict[str, set[str]]:
    """ARCHITECTURE.md's folder table: each part's name -> what its import column says it may import."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    section = text.split("## The package, folder by folder", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`").removesuffix("/").removesuffix(".py")
        table[name] = (
            set()
            if cells[2] == "-"
            else {n.strip().strip("`").removesuffix("/").removesuffix(".py") for n in cells[2].split(",")}
        )
    return table


def test_architecture_md_says_what_each_folder_imports():
    """ARCHITECTURE.md's folder table has one row per part of the package, and its import column is
    exactly what that part's modules import (folder granularity, lazy imports included)."""
    assert _architecture_table() == _folder_imports()


def test_count_statements_prints_the_packages_size_in_ast_statements(capsys, monkeypatch):
    # What .ci/run prints: every statement of the package, a docstring (a bare string) not counted.
    import runpy
    import sys

    import pytest

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(sys, "argv", ["count_statements.py", str(root / "sm120_fp4" / "verify")])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(root / "scripts" / "count_statements.py"), run_name="__main__")
    assert done.value.code == 0
    files = sorted((root / "sm120_fp4" / "verify").rglob("*.py"))
    nodes = [n for p in files for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.stmt)]
    docstrings = [n for n in nodes if isinstance(n, ast.Expr) and isinstance(getattr(n.value, "value", None), str)]
    assert int(capsys.readouterr().out) == len(nodes) - len(docstrings) > 0
