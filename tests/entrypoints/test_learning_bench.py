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


def test_runs_of_separate_invocations_are_merged_and_compared_at_one_wall_minute(tmp_path):
    """`--merge`: runs of different lengths side by side; `at_<m>_min` is each run's last point by minute m."""
    import json

    bench = _bench()

    def curve(*points):
        return [{"minutes": m, "step": s, "adapter": "base" if s == 0 else f"step-{s:06d}", "compliance": c,
                 "good": c, "nll": 2.0} for m, s, c in points]  # fmt: skip

    long = {"minutes_per_run": 36, "overrides": ["eval.every_n_adapters=5"],
            "runs": [{"method": "rl", "skills": False, "base": 0.2, "final": 0.9,
                      "curve": curve((2, 0, 0.2), (10, 5, 0.4), (19, 10, 0.6), (37, 20, 0.9))}]}  # fmt: skip
    short = {"minutes_per_run": 18, "overrides": [],
             "runs": [{"method": "rl", "skills": True, "base": 0.3, "final": 0.3,
                       "curve": curve((5, 0, 0.3), (18, 4, 0.3))},
                      {"method": "opd", "skills": True, "error": "train.py failed (rc 1)"}]}  # fmt: skip
    paths = []
    for name, report in (("long", long), ("short", short)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    merged = bench.merge(paths, 18.0)
    table = merged["table"]
    assert [(r["method"], r["skills"], r["minutes_per_run"]) for r in table] == [
        ("rl", False, 36), ("rl", True, 18), ("opd", True, 18)]  # fmt: skip
    assert table[0]["at_18_min"]["compliance"] == 0.4 and table[0]["final"] == 0.9  # minute 10, not 19
    assert table[1]["at_18_min"]["step"] == 4
    assert table[2]["at_18_min"] is None and table[2]["error"]  # a failed run stays in the table, with no figure
    assert merged["runs"][0]["overrides"] == ["eval.every_n_adapters=5"] and merged["runs"][1]["source"].endswith(
        "short.json")
    bench.plot(merged["runs"], tmp_path / "six.png", "merged")
    assert (tmp_path / "six.png").read_bytes()[:4] == b"\x89PNG"
