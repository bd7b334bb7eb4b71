#!/usr/bin/env python3
"""Print the AST statement count of a package (docstrings, comments and blank lines do not count).

Usage: python3 scripts/count_statements.py [DIR]   (default: sm120_fp4, the size the project caps)
"""

import ast
import pathlib
import sys


def statements(tree: ast.AST) -> int:
    """Return the statements under `tree`, a bare string expression (a docstring) not counted."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            docstring = isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)
            if docstring and isinstance(node.value.value, str):
                continue
            n += 1
    return n


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "sm120_fp4")
    print(sum(statements(ast.parse(p.read_text(encoding="utf-8"))) for p in root.rglob("*.py")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
