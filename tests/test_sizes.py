"""Units stay small enough to read (docs/architecture.md, issue 45): no function in `src/` is longer than 80
lines and no class has more than 15 attributes. There is no exception list.

A function's length runs from its `def` to its last line (decorators aside). A class's attributes are the union
of the names it stores on `self` (anywhere in its body, nested functions included) and its class-level
assignments, annotated or not (a dataclass's fields). A record that outgrows the rule groups its fields into
nested records by concern; a class splits into collaborators.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
MAX_FUNCTION_LINES = 80
MAX_CLASS_ATTRIBUTES = 15


def class_attributes(node: ast.ClassDef) -> set[str]:
    """The attributes of a class as the rule counts them: `self.x = ...` stores and class-level assignments."""
    names = set()
    for sub in ast.walk(node):
        stored = isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
        if stored and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            names.add(sub.attr)
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        if isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return names


def oversized(root: Path) -> tuple[list[str], list[str]]:
    """(functions longer than the rule, classes with more attributes than the rule), each as `path:line name n`."""
    functions, classes = [], []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    functions.append(f"{where}:{node.lineno} {node.name} ({n} lines)")
            elif isinstance(node, ast.ClassDef):
                n = len(class_attributes(node))
                if n > MAX_CLASS_ATTRIBUTES:
                    classes.append(f"{where}:{node.lineno} {node.name} ({n} attributes)")
    return functions, classes


def test_the_counting_rule_on_a_known_class_and_function(tmp_path):
    body = "\n".join(f"        self.a{i} = {i}" for i in range(14))
    (tmp_path / "m.py").write_text(
        "from dataclasses import dataclass\n"
        f"class Big:\n    x: int = 0\n    y = 1\n    def __init__(self):\n{body}\n"
        "@dataclass\nclass Record:\n" + "".join(f"    f{i}: int = 0\n" for i in range(15)) +
        "def long():\n" + "    pass\n" * 80
    )  # fmt: skip
    functions, classes = oversized(tmp_path)
    assert functions == ["m.py:" + str(7 + 14 + 16) + " long (81 lines)"]
    assert classes == ["m.py:2 Big (16 attributes)"]  # 14 on self + 2 class-level; Record's 15 fields pass


def test_no_function_is_longer_than_80_lines():
    functions, _ = oversized(ROOT)
    assert functions == [], "split these by concern:\n" + "\n".join(functions)


def test_no_class_has_more_than_15_attributes():
    _, classes = oversized(ROOT)
    assert classes == [], "split these into collaborators or nested records:\n" + "\n".join(classes)


if __name__ == "__main__":  # the figures for a report: python tests/test_sizes.py
    functions, classes = oversized(ROOT)
    print(f"functions > {MAX_FUNCTION_LINES} lines: {len(functions)}", *functions, sep="\n  ")
    print(f"classes > {MAX_CLASS_ATTRIBUTES} attributes: {len(classes)}", *classes, sep="\n  ")
