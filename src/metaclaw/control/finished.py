"""A run whose service has stopped, read from its directory (no torch, no key): `metaclaw status [--watch]
--run-dir DIR` prints its summary, and a run directory that does not exist is one line naming the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONTROL_FILE = "control.json"  # metaclaw.control.plane.CONTROL_FILE: what a running service writes
SUMMARY_FILE = "summary.json"  # metaclaw.evaluation.report: what a finished run writes


def check_run_dir(run_dir: str) -> Path:
    """`run_dir` as a path; a missing one ends the command with the fix."""
    path = Path(run_dir).expanduser()
    if not path.is_dir():
        raise SystemExit(f"metaclaw: no run directory at {run_dir}: give the directory `metaclaw train` logged at "
                         f"start (outputs/DATE/TIME by default; `ls -d outputs/*/*` lists them)")  # fmt: skip
    return path


def pid_alive(pid: Any) -> bool:
    """Whether process `pid` exists (True when it cannot be told: not recorded, another user's)."""
    if not isinstance(pid, int) or pid <= 0:
        return True  # not recorded: cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it exists
        return True
    return True


def service_running(run_dir: Path) -> bool:
    """Whether the service that wrote `run_dir/control.json` is still running (False when it never wrote one)."""
    try:
        pid = json.loads((run_dir / CONTROL_FILE).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return False
    return pid_alive(pid)


def summary_line(summary: dict[str, Any]) -> str:
    """`summary.json` in a line: steps, samples, time, held-out compliance and why it ended early."""
    line = (f"ended:      {summary.get('steps', 0)} steps, {summary.get('samples_trained', 0)} samples trained in "
            f"{float(summary.get('wall_s') or 0) / 60:.1f} min")  # fmt: skip
    base, final = summary.get("base_compliance"), summary.get("final_compliance")
    if final is not None:
        line += f"; held-out compliance {'-' if base is None else f'{100 * base:.0f}%'} -> {100 * final:.0f}%"
    if summary.get("ended_early"):
        line += f"; ended early: {summary['ended_early']}"
    return line


def finished_status(run_dir: str) -> str | None:
    """The summary of the run in `run_dir` when its service is not running, else None (ask the service)."""
    path = check_run_dir(run_dir)
    if service_running(path):
        return None
    from metaclaw.control.dashboard.cli import format_state, local_data

    text = format_state(local_data(str(path)).state())
    try:
        text += "\n" + summary_line(json.loads((path / SUMMARY_FILE).read_text()))
    except (OSError, ValueError):
        text += "\nended:      no summary.json (the run was stopped before it wrote one, or it is still starting)"
    return text
