"""`bench/tools/dashboard_shot.py`: a running service's dashboard (here a finished run's read-only server, announced
through `control.json` as a service announces itself) screenshotted in headless Chromium, its figures as JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.harness import collect
from tests.procs import REPO


def test_dashboard_shot_saves_the_page_once_the_curve_has_its_points(browser, read_only_dashboard, tmp_path):
    base, key, run_dir = read_only_dashboard  # `browser`: skipped loudly without chromium, as the other page tests
    (run_dir / "control.json").write_text(json.dumps({"url": base}))
    (run_dir / "control.key").write_text(key)
    png = tmp_path / "shot.png"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("METACLAW_PROXY_API_KEY", None)
    done = subprocess.run([sys.executable, "bench/tools/dashboard_shot.py", "--run-dir", str(run_dir), "--out",
                           str(png), "--points", "3", "--timeout", "120"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = collect(done.stdout.splitlines()).values()
    assert report == {"out": str(png), "points": 3, "console_errors": 0}
    assert png.read_bytes()[:4] == b"\x89PNG"
