"""`make lint`: no Python file over 400 lines, no function over 60 (docs/architecture.md).

A function's size is its lines from ``def`` to its last statement, decorators excluded,
docstring included: what a reader has to hold at once. Exit 1 and one line per offence.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
ROOTS = ("hicache_ray", "actors", "placement", "apps", "examples", "tests", "tools")


def offences(path: Path) -> list[str]:
    """The size offences of one file."""
    text = path.read_text()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{path}: {lines} lines (at most {MAX_FILE_LINES}): split it by concern")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > MAX_FUNCTION_LINES:
                found.append(
                    f"{path}:{node.lineno}: {node.name}() is {size} lines "
                    f"(at most {MAX_FUNCTION_LINES})"
                )
    return found


def main(roots: list[str]) -> int:
    found = [o for root in roots for p in sorted(Path(root).rglob("*.py")) for o in offences(p)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(ROOTS)))
