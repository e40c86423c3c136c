"""The serving benches still run (one broke unnoticed when the configs moved into the package): each on the tiny
model, as a user would start it, printing its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def _bench(*args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_hf_batching_measures_the_linger_off_and_on():
    out = _bench("bench/hf_batching.py", "--model", "tiny", "--requests", "6", "--clients", "2", "--rounds", "1")
    off, on = out["runs"]
    assert off["batch_linger_s"] == 0.0 and on["batch_linger_s"] == 0.25  # the composed config's value
    for run in (off, on):
        assert sum(int(size) * n for size, n in run["batches"].items()) == 6  # every request answered, once
    assert out["speedup"] > 0 and out["clients"] == 2


def test_generation_bench_runs_on_the_packaged_config():
    out = _bench("bench/generation.py", "--model", "tiny", "--quick", "--no-llama-cpp", "--threads", "1")
    assert out["runs"] and all(r["tokens_per_s"] > 0 for r in out["runs"].values())
    assert out["limit_tokens_per_s"]["b1"] > 0 and out["llama_cpp"]["status"] == "skipped"


def test_decode_precision_bench_measures_speed_and_the_logprob_gap():
    out = _bench("bench/decode_precision.py", "--model", "tiny", "--batches", "1", "--tokens", "4", "--replies", "2")
    assert set(out["tokens_per_s"]) == {"fp32", "bf16", "int8_dynamic"}
    assert all(v["b1"] > 0 for v in out["tokens_per_s"].values())
    for gap in out["logprob_gap"].values():  # 2 replies of 4 tokens each, every one compared
        assert gap["tokens"] == 8 and 0.0 <= gap["mean"] <= gap["max"]


def test_prefix_reuse_bench_compares_the_cache_off_and_on():
    out = _bench("bench/prefix_reuse.py", "--model", "tiny", "--rounds", "1", "--clients", "2", "--max-tokens", "4")
    off, on = out["engines"]["off"], out["engines"]["on"]
    assert off["turns"] == on["turns"] == 2 * 3  # two conversations of three turns through each engine
    assert out["cache"]["hits"] >= 4 and 0 < out["cache"]["reused_share"] < 1  # turns 2 and 3 find turn 1's keys
    assert out["speedup_wall"] > 0 and out["prefix_cache_mb"] == 1024  # backend/hf.yaml


def test_log_lines_counts_kinds_steps_duplicates_and_adverts(tmp_path):
    run = tmp_path / "run"
    (run / "adapters" / "step-000002").mkdir(parents=True)
    lines = [
        "[2026-11-28 10:00:00,000][metaclaw.loop.live][INFO] - Rollout proxy ready: point your agent at base_url=x",
        "[2026-11-28 10:00:01,000][metaclaw.modules.publisher][INFO] - Published adapter v1 at /r/adapters/step-000001",
        "[2026-11-28 10:00:01,100][metaclaw.modules.publisher][INFO] - Published adapter v1 at /r/adapters/step-000001",
        "[2026-11-28 10:00:02,000][lightning.pytorch][INFO] - 💡 Tip: try installing litlogger",
        "[2026-11-28 10:00:03,000][metaclaw.modules.publisher][INFO] - Published adapter v2 at /r/adapters/step-000002",
    ]
    (run / "train.log").write_text("\n".join(lines) + "\n")
    out = _bench("bench/log_lines.py", str(run))
    assert out["steps"] == 3 and out["startup_info_lines"] == 1 and out["info_lines"] == 5  # 3 publish lines
    assert out["kinds"]["metaclaw.modules.publisher: Published adapter v# at PATH"] == 3
    assert len(out["duplicates"]) == 1 and len(out["adverts"]) == 1
