"""The package layers of docs/architecture.md, checked from the imports (ast, no import runs).

A unit (a top-level package or module of `metaclaw`) may import only
units on a strictly lower floor: no upward arrow, no two units importing each other, no unit left unplaced.
Imports inside functions and under `TYPE_CHECKING` count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "metaclaw"

# Floor by floor, lowest first: a unit imports only units of the floors below its own.
LAYERS: list[tuple[str, frozenset[str]]] = [
    ("ground", frozenset({"store", "messages", "atomic", "devices", "lifecycle", "stopping", "agents", "profiling"})),
    ("vocabulary", frozenset({"wire", "config", "runfiles"})),
    ("libraries", frozenset({"losses", "advantages", "skills", "simulate", "scheduler"})),
    ("serving", frozenset({"serving"})),
    ("privacy", frozenset({"privacy"})),
    ("model", frozenset({"modules"})),
    ("services", frozenset({"rollout", "scoring", "evaluation", "export", "training_server"})),
    ("control", frozenset({"control"})),  # status, steering and the dashboard: read what the services write
    ("training data", frozenset({"datamodules"})),
    ("orchestration", frozenset({"loop"})),
    ("entry", frozenset({"training", "__main__", "__init__"})),
]


def unit_of(module: str) -> str:
    """`serving.engines.hf` → `serving`."""
    return module.split(".")[0]


def imported_modules(tree: ast.AST) -> Iterable[str]:
    """Every `metaclaw.*` name an import statement binds (relative imports are not used in this tree)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        yield from (n.removeprefix("metaclaw.") for n in names if n.startswith("metaclaw."))


def import_edges(root: Path) -> dict[tuple[str, str], str]:
    """(importing unit, imported unit) → the first file that makes the edge."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        source = unit_of(".".join(rel.with_suffix("").parts))
        for name in imported_modules(ast.parse(path.read_text(), str(path))):
            target = unit_of(name)
            if target != source:
                edges.setdefault((source, target), str(rel))
    return edges


def units(root: Path) -> set[str]:
    return {unit_of(".".join(p.relative_to(root).with_suffix("").parts)) for p in root.rglob("*.py")}


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
