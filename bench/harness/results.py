"""Results as data: every bench script's figures as JSON lines under one schema (`Record`).

A script builds its report (a nested dict, as it always has) and hands it to `publish`, which writes one line per
figure to stdout and, with `--results FILE`, appends the same lines to FILE (e.g. `docs/results/bench.jsonl`).
A figure's `metric` is its path inside the report (`runs/0/tokens_per_s`, JSON-pointer style: `~` is written `~0`
and `/` is written `~1`); `collect` reads lines back into the report. The lines of one invocation share `run`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

BENCH = Path(__file__).resolve().parents[1]
KINDS = ("perf", "runs", "studies", "tools")

Value = StrictBool | StrictInt | StrictFloat | StrictStr | None


class Machine(BaseModel):
    """Where a figure was measured."""

    model_config = ConfigDict(extra="forbid")
    cores: int
    arch: str
    python: str
    gpu: str | None


class Record(BaseModel):
    """One figure of one bench run: the schema of every line a bench script writes."""

    model_config = ConfigDict(extra="forbid")
    bench: str = Field(pattern=rf"^({'|'.join(KINDS)})/[a-z0-9_]+$")  # the script: <kind>/<name>
    run: str  # one invocation: its lines share this id
    metric: str  # the figure's path inside the script's report, `/`-separated
    value: Value
    unit: str  # "" when dimensionless or not a measure (a label, a count of things)
    commit: str  # the checkout's short sha, `-dirty` with uncommitted changes
    load: tuple[float, float, float]  # the machine's 1, 5, 15 min load average when the run ended
    machine: Machine
    ts: datetime
    params: dict[str, Value | list[Value]]  # the script's arguments


# A figure's unit from the words of its key (`swap_ms_median` is ms), else of the nearest ancestor key that names
# one (`tokens_per_s/fp32/b1` is tokens/s). First match wins.
_UNITS = [
    (r"tokens_per_s", "tokens/s"), (r"per_min", "1/min"), (r"per_s", "1/s"), (r"tflops", "TFLOP/s"),
    (r"gflops", "GFLOP/s"), (r"gbs", "GB/s"), (r"ms", "ms"), (r"mib|mb", "MiB"), (r"gib", "GiB"), (r"gb", "GB"),
    (r"bytes", "B"), (r"pct", "%"), (r"s|secs|seconds", "s"), (r"min|minutes", "min"),
    (r"speedup|ratio|over", "x"),
    (r"share|recall|accuracy|precision|rate|frac|compliance|mfu", "fraction"),
]  # fmt: skip
_UNIT_RES = [(re.compile(rf"(?:^|_)(?:{words})(?:_|$)"), unit) for words, unit in _UNITS]


def unit_of(path: list[str]) -> str:
    """The unit a figure's path names, or "" (a count, a label, a name)."""
    for key in reversed(path):
        for pattern, unit in _UNIT_RES:
            if pattern.search(key.lower()):
                return unit
    return ""


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _unescape(key: str) -> str:
    return key.replace("~1", "/").replace("~0", "~")


def flatten(report: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[list[str], Any]]:
    """Every leaf of a nested report with its path; lists by index. Non-finite floats become None."""
    if isinstance(report, Mapping):
        for key, value in report.items():
            yield from flatten(value, (*path, str(key)))
    elif isinstance(report, (list, tuple)):
        for i, value in enumerate(report):
            yield from flatten(value, (*path, str(i)))
    elif isinstance(report, float) and not math.isfinite(report):
        yield list(path), None
    elif report is None or isinstance(report, (bool, int, float, str)):
        yield list(path), report
    else:
        yield list(path), str(report)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _listify(v) for k, v in node.items()}
    if node and sorted(node) == sorted(str(i) for i in range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node


def nest(records: Iterable[Record]) -> Any:
    """The report that `records` (of one run) were flattened from (dicts keyed 0..n-1 read back as lists)."""
    root: dict[str, Any] = {}
    for rec in records:
        keys = [_unescape(k) for k in rec.metric.split("/")] if rec.metric else []
        if not keys:
            return rec.value
        node = root
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = rec.value
    return _listify(root)


def collect(lines: Iterable[str]) -> dict[str, Any]:
    """Validate JSON lines against `Record` and rebuild each run's report: {run id: report}, in order."""
    runs: dict[str, list[Record]] = {}
    for line in lines:
        if line.strip():
            rec = Record.model_validate_json(line)
            runs.setdefault(rec.run, []).append(rec)
    return {run: nest(recs) for run, recs in runs.items()}


def commit() -> str:
    git = ["git", "-C", str(BENCH.parent)]
    try:
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, check=False).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def machine() -> Machine:
    gpu = None
    torch = sys.modules.get("torch")  # only when the script loaded it: no 2 s import for a tool
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return Machine(cores=os.cpu_count() or 1, arch=platform.machine(), python=platform.python_version(), gpu=gpu)


def _param(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_param(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def bench_name(script: str | Path) -> str:
    """`bench/perf/hf_batching.py` -> `perf/hf_batching`."""
    path = Path(script).resolve()
    return f"{path.parent.name}/{path.stem}"


def add_results_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=None, metavar="FILE",
                        help="also append the JSON lines to FILE (e.g. docs/results/bench.jsonl)")  # fmt: skip


def records(script: str | Path, params: Mapping[str, Any] | argparse.Namespace, report: Any) -> list[Record]:
    """The report's figures as `Record`s: one per leaf, sharing one run id, commit, load and timestamp."""
    args = vars(params) if isinstance(params, argparse.Namespace) else dict(params)
    name, run, sha, host = bench_name(script), uuid.uuid4().hex[:12], commit(), machine()
    ts = datetime.now(timezone.utc)
    one, five, fifteen = os.getloadavg()
    load = (round(one, 2), round(five, 2), round(fifteen, 2))
    kept = {k: _param(v) for k, v in args.items() if k != "results"}
    out = []
    for path, value in flatten(report):
        metric = "/".join(_escape(k) for k in path)
        out.append(Record(bench=name, run=run, metric=metric, value=value, unit=unit_of(path),
                          commit=sha, load=load, machine=host, ts=ts, params=kept))  # fmt: skip
    return out


def publish(script: str | Path, params: Mapping[str, Any] | argparse.Namespace, report: Any,
            results: Path | None = None) -> list[Record]:  # fmt: skip
    """Write the report's figures as JSON lines to stdout, and append them to `results` (default: `--results`)."""
    recs = records(script, params, report)
    text = "".join(rec.model_dump_json() + "\n" for rec in recs)
    sys.stdout.write(text)
    sys.stdout.flush()
    if results is None and isinstance(params, argparse.Namespace):
        results = getattr(params, "results", None)
    if results is not None:
        Path(results).parent.mkdir(parents=True, exist_ok=True)
        with open(results, "a") as f:
            f.write(text)
    return recs
