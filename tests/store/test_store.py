"""SampleStore: validation at insert, durability settings, idempotent claims, crash reconciliation."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from metaclaw.store import Sample, SampleStore, SampleText, SampleValidationError
from tests.store.conftest import make


def test_wal_and_full_sync(store):
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_roundtrip_keeps_every_field(store):
    s = make(
        agent_id="a1",
        session_id="s1",
        turn_index=2,
        adapter_version=7,
        temperature=0.7,
        reward=-1.0,
        teacher_logprobs=[-0.1, -0.2, -0.3],
        status="ready",
        text=SampleText(messages=[{"role": "user", "content": "hi"}], response_text="yo", next_state="thanks"),
        meta={"skills": ["x"]},
    )
    sid = store.insert(s)
    got = store.get(sid)
    for field in (
        "agent_id",
        "session_id",
        "turn_index",
        "adapter_version",
        "temperature",
        "reward",
        "status",
        "text",
        "meta",
        "prompt_ids",
        "response_ids",
        "behaviour_logprobs",
        "teacher_logprobs",
    ):
        assert getattr(got, field) == getattr(s, field), field


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"behaviour_logprobs": [-0.1, -0.2]}, "behaviour_logprobs has 2 entries but response_ids has 3"),
        ({"teacher_logprobs": [-0.1]}, "teacher_logprobs has 1 entries but response_ids has 3"),
        ({"response_ids": [], "behaviour_logprobs": []}, "response_ids is empty"),
        ({"prompt_ids": []}, "prompt_ids is empty"),
        ({"response_ids": [1, -2, 3]}, "response_ids must be non-negative integers"),
        ({"behaviour_logprobs": [0.0, float("nan"), 0.0]}, "behaviour_logprobs must be finite"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"status": "weird"}, "status must be one of"),
    ],
)
def test_bad_samples_are_refused_naming_the_field(store, kwargs, message):
    base = dict(prompt_ids=[1, 2], response_ids=[4, 5, 6], behaviour_logprobs=[-1.0, -1.0, -1.0])
    with pytest.raises(SampleValidationError, match=message):
        store.insert(Sample(**{**base, **kwargs}))
    assert store.count() == 0


def test_claim_is_idempotent_per_step_and_respects_budgets(store):
    ids = [store.insert(make(n_resp=3, status="ready")) for _ in range(5)]  # 6 tokens each
    first = store.claim_batch(step=0, max_samples=4, max_tokens=13)
    assert [s.id for s in first] == [ids[4], ids[3]]  # newest first; a third would exceed 13 tokens
    again = store.claim_batch(step=0, max_samples=4, max_tokens=13)
    assert [s.id for s in again] == [ids[4], ids[3]]
    nxt = store.claim_batch(step=1, max_samples=2)
    assert [s.id for s in nxt] == [ids[2], ids[1]]
    assert store.claim_batch(step=2, max_samples=4, min_samples=2) == []  # one left: not enough for 2 ranks
    assert store.counts()["ready"] == 1


def test_claim_drops_too_long_and_stale(store):
    long_id = store.insert(make(n_resp=20, status="ready"))
    stale_id = store.insert(make(status="ready", adapter_version=1))
    ok_id = store.insert(make(status="ready", adapter_version=5))
    batch = store.claim_batch(step=0, max_samples=8, max_sample_tokens=10, min_adapter_version=3)
    assert [s.id for s in batch] == [ok_id]
    assert store.get(long_id).status == "dropped" and store.get(long_id).meta["dropped"].startswith("too_long")
    assert store.get(stale_id).meta["dropped"].startswith("stale")


def test_reconcile_consumes_covered_steps_and_releases_the_rest(store):
    for _ in range(6):
        store.insert(make(status="ready"))
    for step in range(3):
        store.claim_batch(step=step, max_samples=2)
    # a checkpoint exists after 2 steps (steps 0 and 1); the process died while step 2 was in flight
    outcome = store.reconcile(global_step=2)
    assert outcome == {"consumed": 4, "released": 2}
    assert store.counts()["consumed"] == 4 and store.counts()["ready"] == 2
    assert [s.claimed_step for s in store.select("consumed")] == [1, 1, 0, 0]  # newest first: ids 6, 5 at step 0


def test_set_score_moves_to_ready_and_checks_lengths(store):
    sid = store.insert(make())
    with pytest.raises(SampleValidationError, match="teacher_logprobs has 2 entries"):
        store.set_score(sid, teacher_logprobs=[-1.0, -2.0])
    store.set_score(sid, reward=1.0, meta={"votes": [1, 1, 0]})
    got = store.get(sid)
    assert got.status == "ready" and got.reward == 1.0 and got.meta["votes"] == [1, 1, 0]
    with pytest.raises(KeyError):
        store.set_score(9999, reward=1.0)


def test_wait_for_ready_wakes_on_insert_without_spinning(store):
    def later():
        time.sleep(0.2)
        store.insert(make(status="ready"))

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    assert store.wait_for_ready(timeout=5)
    assert time.monotonic() - t0 < 2
    assert SampleStore(store.path).wait_for_ready(timeout=0.01)  # another handle sees it at once


def test_two_handles_share_data_and_survive_reopen(tmp_path):
    path = tmp_path / "s.sqlite"
    a, b = SampleStore(path), SampleStore(path)
    sid = a.insert(make(status="ready"))
    assert b.get(sid).status == "ready"
    a.close()
    b.close()
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"teacher_logprobs": [-0.1, float("-inf"), -0.3]}, "teacher_logprobs"),
        ({"teacher_logprobs": [float("nan"), -0.2, -0.3]}, "teacher_logprobs"),
        ({"reward": float("nan")}, "reward"),
        ({"reward": float("inf")}, "reward"),
    ],
)
def test_set_score_refuses_non_finite_values_naming_the_field(store, kwargs, field):
    sid = store.insert(make())
    with pytest.raises(SampleValidationError, match=f"{field} must be finite"):
        store.set_score(sid, **kwargs)
    got = store.get(sid)
    assert got.status == "pending" and got.teacher_logprobs is None and got.reward is None


def test_dropped_reasons_are_counted_by_their_prefix(store):
    for reason in ("stale:v0<v1", "stale:v1<v3", "judge_failed", "too_long:20>10"):
        store.insert(make(status="dropped", meta={"dropped": reason}))
    store.insert(make(status="dropped"))  # no reason recorded
    store.insert(make(status="ready"))
    assert store.dropped_reasons() == {"stale": 2, "judge_failed": 1, "too_long": 1, "unknown": 1}


def test_drop_oldest_keeps_the_newest_backlog_and_counts_what_it_dropped(store):
    ids = [store.insert(make(status="ready")) for _ in range(10)]
    batch = store.claim_batch(step=0, max_samples=2, max_backlog=4)
    assert [s.id for s in batch] == [ids[9], ids[8]]  # the oldest 6 were dropped; the batch is the newest
    assert [s.id for s in store.select("dropped")] == ids[:6]
    assert store.dropped_reasons() == {"backlog": 6} and store.counts()["ready"] == 2
    assert store.claim_batch(step=1, max_samples=2, max_backlog=4) and store.dropped_reasons() == {"backlog": 6}


def test_pause_capture_refuses_new_turns_at_the_bound(tmp_path):
    from metaclaw.store import BacklogFull, GroupCommitWriter

    store = SampleStore(tmp_path / "s.sqlite", capture_limit=3)
    with GroupCommitWriter(store) as writer:
        first = [writer.insert(make()) for _ in range(3)]
        store._backlog_seen = (0, -1.0)  # the count is cached for 0.5 s; look again now
        with pytest.raises(BacklogFull, match=r"data\.max_backlog=3"):
            writer.submit(make())
        writer.submit_next_state(first[-1], "thanks").result(5)  # the earlier turns' bookkeeping goes on
        assert store.stats["capture_paused"] == 1
        store.set_score(first[0], reward=1.0)
        store.claim_batch(step=0, max_samples=1)  # training took one: capture resumes
        store._backlog_seen = (0, -1.0)
        writer.insert(make())
    assert store.count() == 4 and store.get(first[-1]).text.next_state == "thanks"
