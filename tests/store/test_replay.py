"""Replayed distilled replies (issue 42, `distill.distiller.replays`): an accepted reply written with the person's
stated preference in context is trained in that many later steps too, bounded, and nothing else is ever replayed."""

from __future__ import annotations

import sqlite3
import time

from metaclaw.store import SampleMeta
from tests.store.conftest import make


def distilled(replays: int, **kw):
    return make(status="ready", meta=SampleMeta(distilled={"from": 1, "replays_left": replays}), **kw)


def test_a_distilled_reply_is_trained_in_as_many_later_steps_as_it_has_replays(store):
    source = store.insert(distilled(2))
    trained = []
    for step in range(4):
        batch = store.claim_batch(step=step, max_samples=4)
        trained.append([(s.response_ids, s.meta.distilled["replays_left"]) for s in batch])
    reply = list(range(10, 13))
    assert trained == [[(reply, 0)], [(reply, 0)], [(reply, 0)], []]  # the step itself, then 2 replays, then no more
    assert [r.id for r in store.select()][0] == source and store.count() == 3
    with sqlite3.connect(store.path) as c:  # a copy keeps the capture time (data.max_age_s)
        assert len({r[0] for r in c.execute("SELECT created_at FROM samples")}) == 1


def test_only_distilled_rows_are_replayed_and_a_released_claim_is_not_copied_twice(store):
    plain = store.insert(make(status="ready"))
    store.insert(distilled(1))
    assert len(store.claim_batch(step=0, max_samples=4)) == 2
    assert store.release_claims(0) == 2  # the step was abandoned: both are ready again
    assert len(store.claim_batch(step=1, max_samples=8)) == 3  # the two again, and the one copy made at step 0
    assert store.claim_batch(step=2, max_samples=8) == []  # no second copy of the released original
    assert store.count() == 3 and store.get(plain).status == "claimed"


def test_a_copy_is_bounded_by_age_like_its_original(store):
    store.insert(distilled(1))
    store.claim_batch(step=0, max_samples=4)
    with sqlite3.connect(store.path) as c:  # another process: an hour passes
        c.execute("UPDATE samples SET created_at=?", (time.time() - 3600,))
    assert store.claim_batch(step=1, max_samples=4, max_age_s=600) == []
    assert store.dropped_reasons() == {"stale": 1}


def test_a_step_without_a_gradient_hands_its_samples_back_to_train_beside_other_rewards(store):
    """Four equal corrections centred on their own mean have advantage 0: such a step takes no gradient, and
    its samples used to be consumed anyway (19 of the main job's 69 steps). Now they come back `ready`, and the
    next batch takes them first, beside a newer sample, never alone (their rewards would be equal again)."""
    equal = [store.insert(make(status="ready", reward=-1.0)) for _ in range(4)]
    assert {s.id for s in store.claim_batch(step=0, max_samples=4)} == set(equal)
    assert store.defer(equal) == 4
    assert [store.get(i).meta.deferred for i in equal] == [1] * 4
    assert store.claim_batch(step=1, max_samples=4) == []  # alone they would have equal rewards again
    newer = [store.insert(make(status="ready", reward=r)) for r in (1.0, -1.0, 0.0)]
    batch = store.claim_batch(step=2, max_samples=4)
    assert newer[-1] in {s.id for s in batch} and len(set(equal) & {s.id for s in batch}) == 3  # deferred first
    assert store.defer([newer[0]]) == 0  # only claimed samples can be handed back
    assert store.defer([s.id for s in batch]) == 1  # the newer one; the deferred ones were handed back once already


def test_a_turn_reopened_by_a_late_reaction_is_as_fresh_as_the_reaction(store):
    """A reaction 10 minutes after the reply reopens its turn (`meta.late_reaction`: 600 s); counted from the
    capture it would be stale at once (`data.max_age_s` 600), so the person's late words would never train."""
    late = store.insert(make(status="ready", reward=-1.0, meta=SampleMeta(extra={"late_reaction": 600.0})))
    plain = store.insert(make(status="ready", reward=1.0))
    with sqlite3.connect(store.path) as c:  # both replies were captured 11 minutes ago
        c.execute("UPDATE samples SET created_at=?", (time.time() - 660,))
    assert [s.id for s in store.claim_batch(step=0, max_samples=4, max_age_s=600)] == [late]
    assert store.get(plain).meta.dropped.startswith("stale:age")


def test_a_late_reaction_is_bounded_by_the_age_of_the_reaction_not_by_the_adapter_versions_since_its_turn(store):
    """On the real path the trainer publishes a version every 20-30 s on a CPU, so a turn reacted to 5-10 minutes
    late is 10-30 versions behind when it is scored: with the version bound (8) none of 131 late reactions of a
    human-mode run trained (session 32). A plain sample of the same version is still dropped, and the late one still
    ages out, counted from the reaction."""
    plain = store.insert(make(status="ready", reward=1.0, adapter_version=3))
    late = store.insert(make(status="ready", reward=-1.0, adapter_version=3,
                             meta=SampleMeta(extra={"late_reaction": 500.0})))  # fmt: skip
    with sqlite3.connect(store.path) as c:  # captured 9 minutes ago, reacted to 40 s ago
        c.execute("UPDATE samples SET created_at=?", (time.time() - 540,))
    assert [s.id for s in store.claim_batch(step=0, max_samples=4, min_adapter_version=20, max_age_s=600)] == [late]
    assert store.get(plain).meta.dropped == "stale:v3<v20"
    older = store.insert(make(status="ready", reward=-1.0, adapter_version=3,
                              meta=SampleMeta(extra={"late_reaction": 60.0})))  # fmt: skip
    with sqlite3.connect(store.path) as c:  # reacted to 11 minutes ago: aged out like any sample
        c.execute("UPDATE samples SET created_at=? WHERE id=?", (time.time() - 720, older))
    assert store.claim_batch(step=1, max_samples=4, min_adapter_version=30, max_age_s=600) == []
    assert store.get(older).meta.dropped.startswith("stale:age")


def test_a_distilled_reply_is_bounded_by_age_not_by_the_adapter_versions_since_its_turn(store):
    """The teacher (the base model) writes a distilled reply minutes after the corrected turn, behind live traffic;
    the reply is trained by cross-entropy, with no importance ratio, so the adapter versions published meanwhile do
    not make it stale. Counted in versions, 12 of one identity run's 21 distilled rows were dropped (session 27).
    A policy sample of the same turn's version is still dropped, and the distilled row still ages out."""
    policy = store.insert(make(status="ready", adapter_version=3))
    taught = store.insert(distilled(1, adapter_version=3))
    batch = store.claim_batch(step=0, max_samples=4, min_adapter_version=20, max_age_s=600)
    assert [s.id for s in batch] == [taught]
    assert store.get(policy).meta.dropped == "stale:v3<v20"
    assert len(store.claim_batch(step=1, max_samples=4, min_adapter_version=30, max_age_s=600)) == 1  # its replay
    store.insert(distilled(0, adapter_version=3))
    with sqlite3.connect(store.path) as c:  # another process: an hour passes
        c.execute("UPDATE samples SET created_at=? WHERE status='ready'", (time.time() - 3600,))
    assert store.claim_batch(step=2, max_samples=4, min_adapter_version=30, max_age_s=600) == []
    assert store.dropped_reasons() == {"stale": 2}
