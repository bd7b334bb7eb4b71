"""The package's own shape: no import cycle among its modules, and SGLang known in one place.

Read from the source (ast), top-level and lazy (function-level) imports alike."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sm120_fp4"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the module, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
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
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__ is no edge back
                edges[name].add(target)
    # Depth-first search; a back edge is a cycle.
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
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
        found += [(name, node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"sglang\.[a-z_.]+", node.value)]
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
        found += [(name, node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"vllm\.[a-z_.]+", node.value)]
    assert found == []
