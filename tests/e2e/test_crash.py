"""Crash safety: SIGKILL `train.py` mid-run, restart it on the same run dir, and count every sample."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

from metaclaw.store import SampleStore
from tests.e2e.conftest import ENV, REPO
from tests.procs import stop_group


def launch(run_dir, *overrides: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "train.py",
        "model=tiny",
        "rollout=store",
        "method=rl",
        "logger=csv",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    return subprocess.Popen(
        args, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def test_sigkill_mid_run_loses_nothing_and_trains_nothing_twice(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ("trainer.max_steps=8", "data.batch_size=1")
    proc = launch(run_dir, *overrides)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "adapters" / "step-000005").exists():
            assert proc.poll() is None, "train.py ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        stop_group(proc)
    store = SampleStore(run_dir / "samples.sqlite")
    before = {s.id for s in store.select()}
    # step-000005 exists, so the checkpoint of step 4 (publish.checkpoint_every_n_steps: 4) and its consumption
    # are done; steps 4 and on are still claimed (the crash window `SampleStore.reconcile` repairs at restart)
    assert before and store.counts()["consumed"] >= 4

    proc = launch(run_dir, *overrides)
    try:
        assert proc.wait(timeout=300) == 0
    finally:
        stop_group(proc)
    samples = store.select()
    assert {s.id for s in samples} == before  # no captured turn lost (or invented)
    counts = store.counts()
    assert counts["claimed"] == 0
    consumed = [s for s in samples if s.status == "consumed"]
    per_step = Counter(s.claimed_step for s in consumed)
    assert sorted(per_step) == list(range(8)) and set(per_step.values()) == {1}  # each step one sample, once
    assert json.loads((run_dir / "adapters" / "latest.json").read_text())["version"] == 8
