"""`bench/learning.py --batching both`: the before/after throughput block built from the runs' own figures."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("learning_bench", REPO / "bench" / "learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(method, skills, batching, samples, replies, eval_s, steps):
    return {"method": method, "skills": skills, "batching": batching, "trained_samples_per_min": samples,
            "user_replies_per_min": replies, "eval_seconds_median": eval_s, "steps": steps}  # fmt: skip


def test_batching_is_compared_per_configuration_with_ratios():
    bench = _bench()
    results = [
        _run("rl", False, False, 2.0, 4.0, 100.0, 10),
        _run("rl", False, True, 3.0, 5.0, 60.0, 15),
        _run("opd", False, False, 1.0, 2.0, 90.0, 5),
        {"method": "opd", "skills": False, "batching": True, "error": "train.py failed (rc 1)"},
    ]
    rows = bench.compare_batching(results)
    assert len(rows) == 1  # opd's batched run failed: no pair, no made-up ratio
    row = rows[0]
    assert (row["method"], row["skills"]) == ("rl", False)
    assert row["trained_samples_per_min"] == {"before": 2.0, "after": 3.0, "ratio": 1.5}
    assert row["user_replies_per_min"]["ratio"] == 1.25
    assert row["eval_seconds_median"] == {"before": 100.0, "after": 60.0, "ratio": 0.6}
    assert row["steps"]["ratio"] == 1.5
