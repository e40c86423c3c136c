"""Screenshot the dashboard of a running service (the README's figure is taken during the main job).

    python train.py hydra.run.dir=outputs/main &   # the main job, or any rollout=proxy service
    python bench/tools/dashboard_shot.py --run-dir outputs/main --out docs/figures/dashboard.png --points 3

Waits for the service (`control.json`), opens `/dashboard` in headless Chromium with the run's control key (or
`$METACLAW_PROXY_API_KEY`), waits until the held-out curve has `--points` points, and saves a PNG. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from tests.dashboard.cdp import Browser, find_chromium  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", default="docs/figures/dashboard.png")
    ap.add_argument("--points", type=int, default=2, help="curve points to wait for")
    ap.add_argument("--timeout", type=float, default=1800)
    add_results_argument(ap)
    args = ap.parse_args()
    run_dir, deadline = Path(args.run_dir), time.monotonic() + args.timeout
    while not (run_dir / "control.json").exists() or not (run_dir / "control.key").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no service announced itself in {run_dir}")
        time.sleep(2)
    url = json.loads((run_dir / "control.json").read_text())["url"]
    key = os.environ.get("METACLAW_PROXY_API_KEY") or (run_dir / "control.key").read_text().strip()
    binary = find_chromium()
    if binary is None:
        raise SystemExit("chromium is not installed (apt-get install -y chromium)")
    b = Browser(binary)
    try:
        b.call("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 900, "deviceScaleFactor": 1,
                                                      "mobile": False})  # fmt: skip
        b.goto(f"{url}/dashboard")
        b.wait_for("!document.getElementById('key-form').hidden")
        b.js(f"document.getElementById('key').value = {json.dumps(key)}; "
             "document.getElementById('key-form').requestSubmit(); true")  # fmt: skip
        b.wait_for("!document.getElementById('main').hidden")
        points = "document.querySelectorAll('#curves circle.point').length"
        b.wait_for(f"{points} >= {args.points}", timeout_s=max(1.0, deadline - time.monotonic()))
        time.sleep(3)
        b.js("window.scrollTo(0, 0); true")
        b.screenshot(Path(args.out))
        publish(__file__, args, {"out": args.out, "points": b.js(points), "console_errors": len(b.console_errors())})
    finally:
        b.close()


if __name__ == "__main__":
    main()
