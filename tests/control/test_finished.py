"""A finished run is readable: `status` and `status --watch` print its summary from the run directory, fast."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.dashboard.conftest import make_run
from tests.procs import REPO

PROBE = """
import sys
from metaclaw.control.cli import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules, "status of a finished run imported torch"
sys.exit(code)
"""


def status(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", PROBE, "status", *args], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip


def test_status_and_watch_of_a_finished_run_print_its_summary(tmp_path):
    run_dir = make_run(tmp_path / "run")
    (run_dir / "control.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": 2**22 + 12345}))  # gone
    (run_dir / "summary.json").write_text(json.dumps({"steps": 8, "samples_trained": 32, "wall_s": 600.0,
                                                      "base_compliance": 0.25, "final_compliance": 0.8}))  # fmt: skip
    for args in ((), ("--watch",)):
        out = status("--run-dir", str(run_dir), *args)
        assert out.returncode == 0, out.stderr
        assert "finished run" in out.stdout and "not running any more" not in out.stderr
        assert "ended:      8 steps, 32 samples trained in 10.0 min; held-out compliance 25% -> 80%" in out.stdout
        assert "samples    captured 6" in out.stdout  # the store's figures, from the directory


def test_the_curves_read_only_the_tail_of_a_long_metrics_file(tmp_path):
    from metaclaw.control.dashboard.series import metric_series

    (tmp_path / "csv").mkdir()
    lines = ["step,loss/total,train/lr"] + [f"{s},{s / 1000},0.001" for s in range(200_000)]
    (tmp_path / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n")
    series = metric_series(tmp_path, max_points=5)
    assert series["loss"] == [[s, s / 1000] for s in range(199_995, 200_000)] and "reward" not in series
