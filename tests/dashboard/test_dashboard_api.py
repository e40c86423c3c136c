"""The dashboard's routes on a real server (`python -m metaclaw dashboard --run-dir DIR`, a finished run): the
page loads without the key, every data route needs it in the Authorization header, no state changes on GET, and
the figures come from the run directory alone. `status --watch` draws the same figures as text."""

from __future__ import annotations

import httpx

from metaclaw.control.dashboard.cli import format_state, local_data, watch
from metaclaw.control.dashboard.data import curve_point
from metaclaw.evaluation.stats import wilson


def test_the_page_loads_without_the_key_and_its_data_needs_it(read_only_dashboard):
    base, key, run_dir = read_only_dashboard
    page = httpx.get(f"{base}/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"] and "<script src=" in page.text
    assert "http" not in page.text.replace("http://www.w3.org", "")  # no CDN: every asset is ours
    for asset in ("dashboard.js", "dashboard.css"):
        assert httpx.get(f"{base}/dashboard/static/{asset}").status_code == 200
    assert httpx.get(f"{base}/dashboard/static/..%2F..%2Fdata.py").status_code in (401, 404)  # not served
    assert httpx.get(f"{base}/dashboard/api/state").status_code == 401
    assert httpx.get(f"{base}/dashboard/api/state", params={"key": key}).status_code == 401  # never in a URL
    assert httpx.get(f"{base}/dashboard/api/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.post(f"{base}/dashboard/api/state", headers=auth, json={}).status_code == 405
    assert httpx.post(f"{base}/control/rollback", headers=auth, json={"step": 4}).status_code == 404  # read-only
    r = httpx.get(f"{base}/dashboard/api/state", headers=auth)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    state = r.json()
    assert state["live"] is False and state["window"] is None
    points = state["curves"]["default"]
    assert [p["step"] for p in points] == [0, 4, 8]
    assert (points[0]["ci_low"], points[0]["ci_high"]) == tuple(wilson(0.25 * 32, 32))  # computed: none recorded
    assert (points[2]["ci_low"], points[2]["ci_high"]) == (0.6, 0.88)  # the record's own interval
    assert points[1]["gate"] == "accepted" and points[2]["good"] == 0.7
    s = state["samples"]
    assert (s["captured"], s["scored"], s["trained"], s["backlog"]) == (6, 4, 2, 2)
    assert s["dropped"] == {"heldout": 1, "no_next_state": 1} and s["oldest_waiting_s"] >= 0
    adapters = {a["name"]: a for a in state["adapters"]["default"]["adapters"]}
    assert adapters["step-000006"]["gate"] == "rejected" and "margin" in adapters["step-000006"]["reasons"][0]
    assert "inconclusive" in adapters["step-000008"]["reasons"][0]  # an inconclusive acceptance says so
    assert adapters["step-000008"]["served"] and not adapters["step-000004"]["served"]  # the last published
    assert [g["decision"] for g in state["gate"]] == ["accepted", "rejected", "accepted"]
    turns = [t for sess in state["sessions"] for t in sess["turns"]]
    assert {t["source"] for t in turns} >= {"rule:positive", "rule:negative", "feedback"}
    assert "SECRET-REPLY-TEXT" not in r.text and "hello" not in r.text  # text only with the local flag
    series = state["training"]["series"]  # the trainer's metrics.csv: the curves beside held-out compliance
    assert set(series) == {"loss", "reward", "samples_per_min", "replies_per_min", "sample_age_s", "trainer_lag",
                           "lr", "grad_norm", "ratio_mean", "ratio_min", "ratio_max",
                           "ratio_truncated_frac"}  # fmt: skip
    assert series["ratio_min"][0] == [1, 0.9] and series["ratio_max"][-1] == [8, 1.2]  # the behaviour gap, counted
    assert series["loss"][0] == [1, 0.45] and series["grad_norm"][-1] == [8, 9.0] and len(series["lr"]) == 8
    assert state["training"]["reward_mix"] == [{"step": 4, "positive": 1, "negative": 1, "zero": 0}]


def test_text_only_with_the_flag_and_status_watch_draws_the_figures(finished_run, capsys):
    assert "SECRET-REPLY-TEXT" in str(local_data(str(finished_run), show_text=True).state()["sessions"])
    state = local_data(str(finished_run)).state()
    text = format_state(state)
    assert "finished run" in text and "step    8 step-000008   75% [60%, 88%] n=32" in text
    assert "captured 6" in text and "heldout 1" in text and "step-000006 20% vs served 50% n=32: rejected" in text
    assert watch(lambda: state, once=True) == 0
    assert "held-out compliance" in capsys.readouterr().out


def test_curve_point_interval_from_n():
    p = curve_point({"step": 3, "adapter": "v3", "compliance": 1.0, "n": 0})
    assert (p["ci_low"], p["ci_high"]) == (0.0, 1.0)  # nothing measured: the whole range


def test_a_finished_runs_dashboard_opens_without_a_key(keyless_dashboard):
    base, key, _ = keyless_dashboard
    assert key is None  # none printed, none asked for: a finished run, read-only, loopback clients only
    r = httpx.get(f"{base}/dashboard/api/state")
    assert r.status_code == 200 and r.json()["live"] is False
    assert httpx.post(f"{base}/control/pause", json={}).status_code == 404  # still read-only
