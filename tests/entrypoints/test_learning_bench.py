"""`bench/runs/learning.py --batching both`: the before/after throughput block built from the runs' own figures."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("learning_bench", REPO / "bench" / "runs" / "learning.py")
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
        "short.json"
    )
    bench.plot(merged["runs"], tmp_path / "six.png", "merged")
    assert (tmp_path / "six.png").read_bytes()[:4] == b"\x89PNG"


def test_also_verify_takes_people_kinds_and_refuses_an_unknown_one():
    import argparse

    bench = _bench()
    assert bench.kind_list("no_emoji, concise") == ["no_emoji", "concise"]
    with pytest.raises(argparse.ArgumentTypeError, match="telepathy"):
        bench.kind_list("no_emoji,telepathy")


def _real_path():
    spec = importlib.util.spec_from_file_location("real_path", REPO / "bench" / "runs" / "real_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_store_figures_say_how_each_reaction_was_trained(tmp_path):
    """Age and staleness at training, the reward by rule, and the checks the real path must pass (issue 24)."""
    import sqlite3

    from metaclaw.simulate.people import PreferenceKind
    from metaclaw.store import Sample, SampleStore, SampleText

    kind = PreferenceKind.load("number", "all")
    correction, praise = kind.correction[0], kind.praise[0]
    store = SampleStore(tmp_path / "samples.sqlite")
    cases = [  # (next state, adapter version, reward, meta)
        (f"{correction}\n\nHow tall?", 0, 1.0, {"judge": {"rule": "neutral"}, "at_least_one": {"from": -1.0}}),
        (f"{praise} How far is the moon?", 1, 1.0, {"judge": {"rule": "positive"}}),
        (None, 2, 0.0, {"judge": {"rule": "no_next_state"}}),
        (correction, 2, -1.0, {"judge": {"rule": "negative"}}),
        (f"{correction} And pasta?", 0, None, {"dropped": "stale:v0<v3"}),
        (praise, 3, None, None),
    ]  # fmt: skip
    for i, (next_state, version, reward, meta) in enumerate(cases):
        sid = store.insert(Sample([1, 2], [3], [-0.5], session_id=f"s{i}", text=SampleText(next_state=next_state),
                                  adapter_version=version, meta={"session_source": "derived"}))  # fmt: skip
        if meta is not None:
            store.set_score(sid, reward=reward, status="dropped" if "dropped" in meta else "ready", meta=meta)
    assert len(store.claim_batch(step=2, max_samples=8)) == 4
    store.mark_consumed(3)
    with sqlite3.connect(tmp_path / "samples.sqlite") as c:  # captured 1, 2, 3, 4 minutes before training
        c.execute("UPDATE samples SET created_at = updated_at - 60 * id")
    figures = _real_path().store_figures(tmp_path / "samples.sqlite")
    assert figures["captured"] == 6 and figures["trained"] == 4 and figures["steps"] == 1
    assert figures["session_source"] == {"derived": 6}
    assert figures["age_at_training_s"]["median"] == 150.0 and figures["age_at_training_s"]["max"] == 240.0
    assert figures["staleness_versions"]["median"] == 0.5 and figures["staleness_versions"]["max"] == 2
    assert figures["reward_by_rule"]["at_least_one"] == {"n": 1, "positive": 1, "zero": 0, "negative": 0,
                                                         "mean": 1.0}  # fmt: skip
    assert figures["reward_by_rule"]["rule:negative"]["negative"] == 1  # the dashboard's names (reward_source)
    assert figures["reward_by_reaction"]["correction"]["n"] == 2 and figures["reward_by_reaction"]["praise"]["n"] == 1
    assert figures["corrections_trained_positive"] == 1  # the lifted correction
    assert figures["lifted_from_negative"] == 1
    assert figures["unreacted_trained_zero"] == 1
    assert figures["dropped_by_reason"] == {"stale": 1}
    assert figures["status"] == {"consumed": 4, "dropped": 1, "pending": 1}


@pytest.mark.slow
def test_real_path_bench_drives_the_live_service_like_people(tmp_path):
    """`--real-path` on the tiny model for seconds: the curve (base first), the store's figures, no session
    header on any request, every captured turn in a session the proxy derived."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "bench"
    cmd = [sys.executable, "bench/runs/learning.py", "--real-path", "--model", "tiny", "--people", "2",
           "--minutes", "0.3", "--eval-prompts", "4", "--max-tokens", "8", "--eval-every-min", "0.05",
           "--also-verify", "no_emoji,concise", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "learning.json").read_text())
    assert report["mode"] == "real_path" and (out / "learning.png").read_bytes()[:4] == b"\x89PNG"
    run = report["runs"][0]
    assert "error" not in run and run["returncode"] == 0
    assert "rollout=proxy" in run["command"] and "simulated_user" not in run["command"]
    assert run["curve"][0]["adapter"] == 0 and run["curve"][0]["minutes"] == 0.0 and run["base"] is not None
    assert report["also_verify"] == ["no_emoji", "concise"]  # every point: the same replies under other verifiers
    assert all(set(p["also"]) == {"no_emoji", "concise"} and 0 <= p["also"]["no_emoji"] <= 1 for p in run["curve"])
    people = run["people"]
    assert people["replies"] > 0 and people["errors"] == 0 and people["session_headers_sent"] == 0
    store = run["store"]
    assert store["captured"] >= people["replies"] - people["people"]  # a reply still in flight at the end
    assert set(store["session_source"]) == {"derived"}
    for key in ("age_at_training_s", "staleness_versions", "reward_by_rule", "corrections_trained_positive",
                "unreacted_trained_zero", "dropped_by_reason"):  # fmt: skip
        assert key in store
    assert run["backlog"] and "backlog" in run["backlog"][-1]


def test_sessions_to_a_stable_effect_counts_conversations_until_three_first_replies_comply_in_a_row():
    def first(at: float, complied: bool) -> dict:
        return {"sent_at": at, "complied": complied, "index": 0}

    later = {"sent_at": 0.5, "complied": True, "index": 1}  # a later reply may follow an in-context correction
    order = [first(5, True), first(1, False), first(2, True), first(3, False), first(4, True), first(6, True), later]
    assert _real_path().sessions_to_stable(order) == 6  # begun in order 1..6: the run is the 4th, 5th and 6th
    assert _real_path().sessions_to_stable([first(1, True), first(2, True), later]) is None
    off_topic = {"sent_at": 2, "complied": True, "index": 0, "answered": False}  # the right form, not an answer
    assert _real_path().sessions_to_stable([first(1, True), off_topic, first(3, True), first(4, True)]) is None
    assert _real_path().sessions_to_stable([first(1, True), off_topic, *(first(t, True) for t in (3, 4, 5))]) == 5
