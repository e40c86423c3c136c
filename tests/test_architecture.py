"""The package layers of docs/architecture.md, checked from the imports (ast, no import runs).

A unit (a top-level package or module of `metaclaw`) may import only units on a strictly lower floor: no upward
arrow, no two units importing each other, no unit left unplaced. Inside a unit, no module imports itself back
through others (no import circle). Imports inside functions and under `TYPE_CHECKING` count too: an import
hidden in a function is still a dependency, only a later one. There is no exception list.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "metaclaw"

# Floor by floor, lowest first: a unit imports only units of the floors below its own.
LAYERS: list[tuple[str, frozenset[str]]] = [
    (
        "ground",
        frozenset(
            {
                "store",
                "messages",
                "atomic",
                "devices",
                "lifecycle",
                "stopping",
                "agents",
                "profiling",
                "distribution",
                "conf",
                "ops",
                "__init__",
            }
        ),
    ),  # fmt: skip (conf: the YAML tree, no imports)
    ("vocabulary", frozenset({"wire", "config", "runfiles", "thinking", "memory_plan"})),
    ("libraries", frozenset({"losses", "advantages", "skills", "simulate", "scheduler", "tracking"})),
    ("privacy", frozenset({"privacy"})),
    ("model", frozenset({"modules"})),
    ("serving", frozenset({"serving"})),  # the policy server; its plumbing (client, security, render) is in wire
    ("services", frozenset({"rollout", "scoring", "evaluation", "export", "training_server"})),
    ("control", frozenset({"control"})),  # status, steering and the dashboard: read what the services write
    ("training data", frozenset({"datamodules"})),
    ("orchestration", frozenset({"loop"})),
    ("entry", frozenset({"training"})),
    ("command", frozenset({"cli"})),  # the `metaclaw` console script: train, serve, control, export
    ("main", frozenset({"__main__"})),
]


def module_name(root: Path, path: Path) -> str:
    """`serving/engines/hf.py` → `serving.engines.hf`; a package is its folder: `store/__init__.py` → `store`."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def unit_of(module: str) -> str:
    """`serving.engines.hf` → `serving`."""
    return module.split(".")[0]


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterable[tuple[str, str | None]]:
    """(module, name or None) for each `metaclaw` name an import statement binds, relative imports resolved."""
    if isinstance(node, ast.Import):
        yield from ((a.name.removeprefix("metaclaw."), None) for a in node.names if a.name.startswith("metaclaw."))
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        elif node.module == "metaclaw" or (node.module or "").startswith("metaclaw."):
            source = node.module.removeprefix("metaclaw").removeprefix(".")
        else:
            return
        yield from ((source, a.name) for a in node.names)


def module_imports(root: Path) -> dict[tuple[str, str], str]:
    """(importing module, imported module) → `file:line` of the first import that makes the edge.

    `from metaclaw.a import b` imports the module `a.b` when there is one, else the module `a` (b is a name in it);
    a name that is no module of the tree is taken at its nearest enclosing module (kept whole when it has none).
    """
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    edges: dict[tuple[str, str], str] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for source, name in _imported(node, module, path.name == "__init__.py"):
                full = ".".join(filter(None, (source, name)))
                target = full if full in files else (source or "__init__")  # `from metaclaw import x`: the root
                while target and target not in files and "." in target:
                    target = target.rpartition(".")[0]
                target = target if target in files else full
                if target and target != module:
                    edges.setdefault((module, target), f"{path.relative_to(root)}:{node.lineno}")
    return edges


def import_edges(root: Path) -> dict[tuple[str, str], str]:
    """(importing unit, imported unit) → the first `file:line` that makes the edge."""
    edges: dict[tuple[str, str], str] = {}
    for (src, dst), where in sorted(module_imports(root).items(), key=lambda e: e[1]):
        if unit_of(src) != unit_of(dst):
            edges.setdefault((unit_of(src), unit_of(dst)), where)
    return edges


def units(root: Path) -> set[str]:
    return {unit_of(module_name(root, p)) for p in root.rglob("*.py")}


def violations(edges: Mapping[tuple[str, str], str], layers: list[tuple[str, frozenset[str]]]) -> list[str]:
    """Each import that does not point strictly down the floors, in words."""
    floor = {u: i for i, (_, members) in enumerate(layers) for u in members}
    out = []
    for (src, dst), where in sorted(edges.items()):
        if src not in floor or dst not in floor:
            out.append(f"{where}: {src} -> {dst}: {src if src not in floor else dst} has no floor in LAYERS")
        elif floor[dst] >= floor[src]:
            kind = "upward" if floor[dst] > floor[src] else "sideways"
            kind += " and mutual" if (dst, src) in edges else ""
            out.append(f"{where}: {src} ({layers[floor[src]][0]}) -> {dst} ({layers[floor[dst]][0]}): {kind} import")
    return out


def circles(edges: Mapping[tuple[str, str], str]) -> list[str]:
    """Each import circle among the modules of one unit, as `a -> b (where) -> ... -> a (where)`.

    One circle is named per group of modules that all reach each other (a strongly connected component).
    """
    graph: dict[str, list[str]] = {}
    for src, dst in sorted(edges):
        if unit_of(src) == unit_of(dst):
            graph.setdefault(src, []).append(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            at = stack.index(v)
            group, stack[at:] = set(stack[at:]), []
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        start = min(group)
        paths = {start: [start]}  # breadth first, inside the group, back to the start
        queue = [start]
        while queue:
            v = queue.pop(0)
            nxt = [w for w in graph[v] if w in group]
            if start in nxt:
                path = [*paths[v], start]
                out.append(" -> ".join([start, *(f"{b} ({edges[(a, b)]})" for a, b in itertools.pairwise(path))]))
                break
            for w in nxt:
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    queue.append(w)
    return sorted(out)


def test_every_unit_has_a_floor():
    placed = set().union(*(m for _, m in LAYERS))
    assert units(ROOT) - placed == set(), "place the new package in LAYERS (tests/test_architecture.py) and docs"


def test_the_layer_table_names_each_unit_once():
    names = [u for _, members in LAYERS for u in members]
    assert len(names) == len(set(names))


def test_imports_point_strictly_down():
    assert violations(import_edges(ROOT), LAYERS) == []


def test_no_two_units_import_each_other():
    edges = import_edges(ROOT)
    assert sorted({tuple(sorted(e)) for e in edges if e[::-1] in edges}) == []


def test_no_import_circle_inside_a_unit():
    assert circles(module_imports(ROOT)) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # the store (ground floor) reaching up into the proxy
        ({"store/samples.py": "def f():\n    from metaclaw.rollout.proxy import RolloutProxy\n"}, "upward import"),
        # two services importing each other (what rollout/ and scoring/ did)
        (
            {
                "rollout/live.py": "from metaclaw.scoring.worker import ScoringWorker\n",
                "scoring/worker.py": "import metaclaw.rollout.session_tracker\n",
            },
            "sideways and mutual import",
        ),
        # a package nobody placed
        ({"newpkg/x.py": "from metaclaw import store\n"}, "has no floor"),
    ],
)
def test_the_checker_catches_a_bad_import(tmp_path, files, expected):
    root = _tree(tmp_path, files)
    found = violations(import_edges(root), LAYERS)
    assert found and all(expected in v for v in found)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # two modules of one package, the way back hidden in a function (what control/api.py and plane.py did)
        (
            {
                "control/__init__.py": "",
                "control/api.py": "from metaclaw.control.plane import ControlPlane\n",
                "control/plane.py": "class ControlPlane:\n    def mount(self):\n"
                "        from metaclaw.control.api import mount_control\n",
            },
            "control.api -> control.plane (control/api.py:1) -> control.api (control/plane.py:3)",
        ),
        # three modules around, through a package's own __init__ and a relative import (training_server's VERSION)
        (
            {
                "pkg/__init__.py": "from metaclaw.pkg.main import run\nVERSION = '1'\n",
                "pkg/main.py": "from .app import create_app\n",
                "pkg/app.py": "def create_app():\n    from metaclaw.pkg import VERSION\n",
            },
            "pkg -> pkg.main (pkg/__init__.py:1) -> pkg.app (pkg/main.py:1) -> pkg (pkg/app.py:2)",
        ),
    ],
)
def test_the_checker_catches_an_import_circle(tmp_path, files, expected):
    assert circles(module_imports(_tree(tmp_path, files))) == [expected]


def test_a_submodule_imported_by_name_is_not_a_circle(tmp_path):
    """`from metaclaw.pkg import sub` in `pkg/other.py` imports `pkg.sub`, not the package's `__init__`."""
    root = _tree(tmp_path, {"pkg/__init__.py": "from metaclaw.pkg.other import x\n",
                            "pkg/other.py": "from metaclaw.pkg import sub\nx = 1\n", "pkg/sub.py": ""})  # fmt: skip
    assert circles(module_imports(root)) == []
