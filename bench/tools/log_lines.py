"""What a run's log says per step: INFO lines by kind, steps, duplicates and adverts (issue 44's quiet-log check).

    python bench/tools/log_lines.py RUN_DIR [RUN_DIR ...]

Reads `RUN_DIR/train.log` (Hydra's text format, `log=text`) and prints one JSON object per run:

- `info_lines`, `warning_lines`, `steps` (the optimizer steps the run published: `summary.json`, else its
  publish lines or `adapters/step-*` folders), `info_per_step` (INFO lines after start-up per step);
- `kinds`: INFO lines grouped by logger and message template (digits, paths and hex folded), with counts, most
  frequent first; a kind more frequent than the steps is named in `more_than_once_per_step`;
- `duplicates`: the same message (timestamp aside) twice within one second, i.e. a line printed by two handlers;
- `adverts`: lines that sell something (Lightning's "💡 Tip", "litlogger").

Start-up is everything up to the proxy's "ready" line (model load, servers, probe).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402

LINE = re.compile(r"^\[(?P<ts>[\d\- :,]+)\]\[(?P<logger>[^\]]+)\]\[(?P<level>[A-Z]+)\] - (?P<msg>.*)$")
FOLD = [
    (re.compile(r"(/[\w.\-+]+)+"), "PATH"),
    (re.compile(r"\b[0-9a-f]{8,}\b"), "HEX"),
    (re.compile(r"\d+(\.\d+)?"), "#"),
]
ADVERT = re.compile(r"💡|litlogger|Tip:", re.I)
READY = "Rollout proxy ready"


def template(msg: str) -> str:
    for pattern, repl in FOLD:
        msg = pattern.sub(repl, msg)
    return msg[:120]


def steps_of(run: Path, published: int) -> int:
    """`summary.json`'s steps; while running (or without it), the adapters published (the log's lines or the
    folders, whichever is more: `keep_last` prunes folders)."""
    summary = run / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        for key in ("optimizer_steps", "steps", "global_step"):
            if isinstance(data.get(key), int):
                return data[key]
    folders = len(list((run / "adapters").glob("step-*"))) if (run / "adapters").is_dir() else 0
    return max(folders, published)


def report(run: Path) -> dict:
    entries = []
    for raw in (run / "train.log").read_text(errors="replace").splitlines():
        m = LINE.match(raw)
        if m:
            ts = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f")
            entries.append((ts, m["logger"], m["level"], m["msg"]))
    ready = next((i for i, e in enumerate(entries) if READY in e[3]), 0)
    info = [e for e in entries if e[2] == "INFO"]
    after = [e for e in entries[ready + 1 :] if e[2] == "INFO"]
    kinds = Counter(f"{logger}: {template(msg)}" for _, logger, _, msg in after)
    steps = steps_of(run, sum("Published adapter" in e[3] for e in entries))
    duplicates, last = [], {}
    for ts, logger, level, msg in entries:
        key = (logger, level, msg)
        if key in last and (ts - last[key]).total_seconds() <= 1.0:
            duplicates.append(f"{logger}: {msg[:120]}")
        last[key] = ts
    return {
        "run": str(run),
        "info_lines": len(info),
        "warning_lines": sum(e[2] == "WARNING" for e in entries),
        "startup_info_lines": len(info) - len(after),
        "steps": steps,
        "info_per_step": round(len(after) / steps, 2) if steps else None,
        "kinds": dict(kinds.most_common()),
        "more_than_once_per_step": [k for k, n in kinds.items() if steps and n > steps],
        "duplicates": duplicates,
        "adverts": [f"{e[1]}: {e[3][:120]}" for e in entries if ADVERT.search(e[3])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, nargs="+")
    add_results_argument(ap)
    args = ap.parse_args()
    for run in args.runs:  # one report (one `run` id) per run directory
        publish(__file__, {"run_dir": str(run)}, report(run), results=args.results)


if __name__ == "__main__":
    main()
