"""Freshness (docs/online_loop.md "Freshness"): steps claim the newest samples; stale ones are never trained but
kept in the store, settled with a reason and counted; every trained sample records when, at which step and
against which served adapter it was trained."""

from __future__ import annotations

import sqlite3
import time

from metaclaw.modules.health import HealthMonitor
from metaclaw.store import SampleStore
from metaclaw.store.claims import plan_claim
from tests.store.conftest import make


def _age(store: SampleStore, sample_id: int, seconds: float) -> None:
    """Pretend the sample was captured `seconds` ago (another connection, like another process)."""
    with sqlite3.connect(store.path) as c:
        c.execute("UPDATE samples SET created_at=? WHERE id=?", (time.time() - seconds, sample_id))


def test_a_step_claims_the_newest_ready_samples_first(store):
    ids = [store.insert(make(status="ready")) for _ in range(6)]
    assert [s.id for s in store.claim_batch(step=0, max_samples=4)] == ids[:1:-1]  # 6, 5, 4, 3
    assert [s.id for s in store.claim_batch(step=1, max_samples=4)] == [ids[1], ids[0]]


def test_stale_by_versions_is_never_trained_kept_and_counted_even_when_the_batch_fills_first(store):
    old = [store.insert(make(status="ready", adapter_version=1)) for _ in range(3)]  # 9 versions behind v10
    fresh = [store.insert(make(status="ready", adapter_version=v)) for v in (2, 9, 10)]
    batch = store.claim_batch(step=0, max_samples=2, min_adapter_version=10 - 8, served_version=10)
    assert [s.id for s in batch] == [fresh[2], fresh[1]]
    # the batch was full before the scan reached them: the stale ones are still settled now, not left `ready`
    for i in old:
        s = store.get(i)
        assert (s.status, s.meta["dropped"]) == ("dropped", "stale:v1<v2")
    assert store.get(fresh[0]).status == "ready"  # v2: exactly at the bound, still trainable
    assert store.dropped_reasons() == {"stale": 3} and store.count() == 6  # kept in the store


def test_stale_by_minutes_is_never_trained_kept_and_counted(store):
    ids = [store.insert(make(status="ready")) for _ in range(4)]
    _age(store, ids[0], 700.0)
    _age(store, ids[3], 650.0)  # the newest id, captured long ago: age counts, not order
    batch = store.claim_batch(step=0, max_samples=4, max_age_s=600.0)
    assert [s.id for s in batch] == [ids[2], ids[1]]
    for i in (ids[0], ids[3]):
        s = store.get(i)
        assert s.status == "dropped" and s.meta["dropped"].startswith("stale:age ")
    assert store.dropped_reasons() == {"stale": 2} and store.count() == 4
    health = HealthMonitor(str(store.path))
    assert health.snapshot()["rollout/dropped_stale"] == 2.0


def test_trained_samples_record_step_time_and_served_version(store):
    ids = [store.insert(make(status="ready", adapter_version=v)) for v in (3, 4)]
    before = time.time()
    store.claim_batch(step=7, max_samples=2, served_version=5)
    with sqlite3.connect(store.path) as c:
        rows = c.execute("SELECT id, claimed_step, claimed_at, served_version, adapter_version, created_at"
                         " FROM samples ORDER BY id").fetchall()  # fmt: skip
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [(ids[0], 7, 5, 3), (ids[1], 7, 5, 4)]
    assert all(before <= r[2] <= time.time() and r[2] >= r[5] for r in rows)
    rates = store.rates(window_s=60.0)
    assert rates["trained_per_min"] == 2.0 and rates["replies_per_min"] == 2.0
    assert rates["trained_lag"] == 2 and rates["trained_age_s"] >= 0.0
    assert store.reconcile(global_step=7) == {"consumed": 0, "released": 2}  # the step was never checkpointed
    assert all(s.status == "ready" for s in store.select())
    with sqlite3.connect(store.path) as c:
        assert c.execute("SELECT COUNT(*) FROM samples WHERE claimed_at IS NOT NULL").fetchone()[0] == 0


def test_a_store_written_before_the_freshness_columns_gains_them(tmp_path):
    path = tmp_path / "old.sqlite"
    SampleStore(path).close()
    with sqlite3.connect(path) as c:
        for column in ("scored_at", "claimed_at", "served_version"):
            c.execute(f"ALTER TABLE samples DROP COLUMN {column}")
    store = SampleStore(path)
    sample_id = store.insert(make())
    store.set_score(sample_id, reward=1.0)
    assert [s.id for s in store.claim_batch(0, 1, served_version=0)] == [sample_id]
    with sqlite3.connect(path) as c:
        scored_at, claimed_at = c.execute("SELECT scored_at, claimed_at FROM samples").fetchone()
    assert scored_at is not None and claimed_at is not None
    store.close()


def test_many_adapters_each_batch_is_its_newest_and_no_adapter_starves():
    rows = [{"id": i, "agent_id": a, "adapter_version": 0, "created_at": 100.0, "n_tokens": 5, "gen": None}
            for i, a in [(6, "alice"), (5, "alice"), (4, "alice"), (3, "bob"), (2, "bob"), (1, "alice")]]  # fmt: skip
    # alice's newest samples keep coming, but bob's oldest fresh sample (2) waited longer than alice's (4): bob
    # goes first; alice's sample 1 is stale by age and never holds her place in the queue
    plan = plan_claim(rows[:5], now=110.0, max_samples=2, partition=lambda a: a)
    assert plan.batch == [3, 2]
    plan = plan_claim(rows, now=110.0, max_samples=2, max_age_s=5.0, partition=lambda a: a)
    assert plan.batch == [] and len(plan.drops) == 6
    rows[-1] = {**rows[-1], "created_at": 0.0}
    plan = plan_claim(rows, now=110.0, max_samples=2, max_age_s=60.0, partition=lambda a: a,
                      served_version={"alice": 4, "bob": 2})  # fmt: skip
    assert plan.drops == [(1, "stale:age 110s>60s")] and plan.batch == [3, 2] and plan.served == {3: 2, 2: 2}
