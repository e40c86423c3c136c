"""Task prompts for the simulated user: a JSONL file of `{id, domain, prompt, split}` (`train` | `heldout`).

The packaged `tasks.jsonl` holds 132 everyday questions over 11 domains; every 4th of each domain is held out
for evaluation and never asked during training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PACKAGED = Path(__file__).parent / "tasks.jsonl"


@dataclass(frozen=True)
class Task:
    id: str
    domain: str
    prompt: str
    split: str


def load_tasks(path: str | Path | None = None, split: str | None = None) -> list[Task]:
    """Tasks of `path` (the packaged file when None), only those of `split` when given; refuses an empty result."""
    path = Path(path) if path else PACKAGED
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [k for k in ("prompt", "split") if not isinstance(row.get(k), str) or not row.get(k)]
        if missing:
            raise ValueError(f"{path}:{n}: task needs string fields {missing}")
        tasks.append(Task(str(row.get("id", n)), str(row.get("domain", "general")), row["prompt"], row["split"]))
    chosen = [t for t in tasks if split is None or t.split == split]
    if not chosen:
        raise ValueError(f"{path}: no tasks with split={split!r}")
    return chosen
