"""The dashboard's curves over training steps, from the run directory (live or finished): what the trainer logged
(`<run dir>/csv/metrics.csv`, `logger=csv`, the default) and the reward mix of each step's batch (the store).

Only the file's tail is read (`TAIL_BYTES`): a service that ran for weeks has a large metrics.csv.
"""

from __future__ import annotations

import csv
import io
import sqlite3
from pathlib import Path
from typing import Any

TAIL_BYTES = 1 << 20
MAX_POINTS = 400
# curve name -> the metric the trainer logs (metaclaw.modules.online_rl, metaclaw.modules.health)
SERIES = {
    "loss": "loss/total",
    "reward": "rollout/reward_mean",
    "samples_per_min": "train/samples_per_min",
    "replies_per_min": "rollout/replies_per_min",
    "sample_age_s": "train/sample_age_s",
    "trainer_lag": "train/version_lag",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "ratio_mean": "loss/ratio_mean",  # behaviour vs the trainer's recomputation (losses.base.ratio_metrics)
    "ratio_min": "loss/ratio_min",
    "ratio_max": "loss/ratio_max",
    "clip_frac": "loss/clip_frac",  # loss=ppo|cispo
    "ratio_truncated_frac": "loss/ratio_truncated_frac",  # loss=importance_sampling with max_ratio (the default)
}


def metrics_csv(run_dir: Path) -> Path | None:
    """The CSV logger's file: `<run dir>/csv/metrics.csv`, else the first `metrics.csv` under `csv*/`."""
    path = run_dir / "csv" / "metrics.csv"
    if path.is_file():
        return path
    return next(iter(sorted(run_dir.glob("csv*/**/metrics.csv"))), None)


def read_tail(path: Path, tail_bytes: int = TAIL_BYTES) -> list[dict[str, str]]:
    """The rows of the last `tail_bytes` of a CSV file, with its header."""
    with path.open("rb") as f:
        header = f.readline().decode("utf-8", "replace")
        size = f.seek(0, io.SEEK_END)
        start = max(len(header), size - tail_bytes)
        f.seek(start)
        body = f.read().decode("utf-8", "replace")
    if start > len(header):
        body = body.split("\n", 1)[1] if "\n" in body else ""  # a partial first line
    return list(csv.DictReader(io.StringIO(header + body)))


def metric_series(run_dir: Path, max_points: int = MAX_POINTS) -> dict[str, list[list[float]]]:
    """`{curve: [[step, value], ...]}` of every curve in `SERIES` the trainer logged (the last `max_points`)."""
    path = metrics_csv(run_dir)
    if path is None:
        return {}
    out: dict[str, dict[int, float]] = {name: {} for name in SERIES}
    for row in read_tail(path):
        try:
            step = int(float(row.get("step") or ""))
        except ValueError:
            continue
        for name, key in SERIES.items():
            value = row.get(key)
            if value:
                try:
                    out[name][step] = float(value)  # Lightning may write a step over several rows: the last wins
                except ValueError:
                    continue
    return {name: [[s, v] for s, v in sorted(points.items())[-max_points:]] for name, points in out.items() if points}


def reward_mix(db: sqlite3.Connection, max_points: int = MAX_POINTS) -> list[dict[str, Any]]:
    """Each optimizer step's batch: how many samples had a positive, a negative and a zero reward."""
    rows = db.execute(
        "SELECT claimed_step, SUM(reward > 0), SUM(reward < 0), SUM(reward = 0) FROM samples WHERE claimed_step IS "
        "NOT NULL AND reward IS NOT NULL AND status IN ('claimed', 'consumed') GROUP BY claimed_step "
        "ORDER BY claimed_step DESC LIMIT ?", (max_points,),
    ).fetchall()  # fmt: skip
    return [{"step": s, "positive": p, "negative": n, "zero": z} for s, p, n, z in reversed(rows)]
