"""The scoring worker: per-method settling, the at-least-one guarantee, OPD teacher logprobs, hanging judges."""

from __future__ import annotations

import asyncio
import threading
from functools import partial

from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.scoring.judges import RuleJudge, Verdict
from metaclaw.scoring.teacher import TeacherClient
from metaclaw.scoring.worker import ScoringWorker
from metaclaw.store import Sample, SampleStore, SampleText, SessionLog

# The mechanisms as seed 002 states them (+1 at least once, closing turns judged); the product's rules are
# ScoringWorker's defaults (off, drop): tests/test_configs.py
SeedRulesWorker = partial(ScoringWorker, at_least_one=True, no_next_state="score", no_verdict="score")


def add_session(store: SampleStore, session: str, next_states: list[str | None]) -> list[int]:
    ids = []
    for i, ns in enumerate(next_states):
        msgs = [{"role": "user", "content": f"q{i}"}]
        s = Sample(
            [1, 2, 3],
            [4, 5],
            [-0.5, -0.5],
            session_id=session,
            turn_index=i,
            text=SampleText(messages=msgs, response_text="r", next_state=ns),
        )
        ids.append(store.insert(s))
    return ids


def done(store: SampleStore, session: str) -> None:
    SessionLog(store.path).touch("default", session, done=True)


def test_rl_waits_for_the_session_then_applies_at_least_one(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "bad", ["that's wrong", "ok", None])
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True, session_idle_s=1e9)
    assert asyncio.run(worker.run_once()) == 0  # not finished: rewards held back
    done(store, "bad")
    assert asyncio.run(worker.run_once()) == 3
    rewards = [s.reward for s in store.select()]
    # the neutral turn with evidence (a next state) is lifted to +1: not the corrected one, not the last turn
    assert rewards == [-1.0, 1.0, 0.0]
    assert store.select()[1].meta["at_least_one"] == {"from": 0.0}
    assert store.counts()["ready"] == 3


def test_at_least_one_never_lifts_a_turn_the_user_or_the_judge_called_bad(tmp_path):
    """Issue 24: the +1 went to turns the user had corrected (18 of 40 on the real path)."""
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "corrected", ["that's wrong", "no, still wrong", None])
    rated = add_session(store, "rated", ["ok", None])
    store.add_feedback(rated[0], {"score": -1.0})  # the user rated the neutral-looking turn bad
    done(store, "corrected"), done(store, "rated")
    asyncio.run(SeedRulesWorker(store, RuleJudge(), needs_reward=True, at_least_one=True).run_once())
    got = store.select()
    assert [s.reward for s in got[:2]] == [-1.0, -1.0] and got[3].reward == -1.0
    assert not any("at_least_one" in s.meta for s in got)
    assert all(s.reward <= 0 for s in got if s.reward is not None)


def test_rl_without_guarantee_scores_as_soon_as_next_state_is_known(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["thanks, works", None])
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True, at_least_one=False, session_idle_s=1e9)
    assert asyncio.run(worker.run_once()) == 1
    first, second = store.select()
    assert (first.status, first.reward, second.status) == ("ready", 1.0, "pending")


def test_a_turn_nothing_reacted_to_is_dropped_when_told(tmp_path):
    """A simulated user's closing turn (`no_next_state: drop`): no evidence, never trained on; with feedback it is."""
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["thanks, works", None])
    add_session(store, "t", [None])
    store.add_feedback(store.select()[2].id, {"score": 1.0})
    done(store, "s"), done(store, "t")
    judged = []

    class CountingJudge(RuleJudge):
        async def reward(self, sample):
            judged.append(sample.id)
            return await super().reward(sample)

    worker = SeedRulesWorker(store, CountingJudge(), needs_reward=True, at_least_one=False, no_next_state="drop")
    assert asyncio.run(worker.run_once()) == 3
    assert store.select()[1].id not in judged  # no evidence: the judge is not asked
    answered, closing, with_feedback = store.select()
    assert (answered.status, answered.reward) == ("ready", 1.0)
    assert (closing.status, closing.meta["dropped"]) == ("dropped", "no_next_state")
    assert (with_feedback.status, with_feedback.reward) == ("ready", 1.0)
    kept = SampleStore(tmp_path / "k.sqlite")
    add_session(kept, "s", [None])
    done(kept, "s")
    asyncio.run(SeedRulesWorker(kept, RuleJudge(), needs_reward=True, at_least_one=False).run_once())
    assert (kept.select()[0].status, kept.select()[0].reward) == ("ready", 0.0)  # the default: the judge scores it


def test_a_next_message_that_judges_nothing_is_no_verdict_and_never_trained(tmp_path):
    """Session 24: the next question alone, a follow-up task or the person's own update gave the turn reward 0, and
    centred over a batch a 0 among corrections is a push towards the reply. By default (`no_verdict: drop`) such a
    turn is settled `dropped: no_verdict`; explicit feedback makes it trainable; `score` trains it at 0."""
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["that's wrong", "What about in winter?", "thanks, works", "Sorry, I meant two people."])
    turns = add_session(store, "f", ["How long does it keep?", "ok"])
    asyncio.run(ScoringWorker(store, RuleJudge(), needs_reward=True).run_once())
    wrong, winter, thanks, update = store.select()[:4]
    assert [(t.status, t.reward) for t in (wrong, thanks)] == [("ready", -1.0), ("ready", 1.0)]
    assert [(t.status, t.meta.get("dropped")) for t in (winter, update)] == [("dropped", "no_verdict")] * 2
    assert store.add_feedback(turns[0], {"score": 1.0}) == (
        "dropped",
        "pending",
    )  # the person's own score is evidence: reopened, trained
    asyncio.run(ScoringWorker(store, RuleJudge(), needs_reward=True).run_once())
    assert (store.get(turns[0]).status, store.get(turns[0]).reward) == ("ready", 1.0)
    kept = SampleStore(tmp_path / "k.sqlite")
    add_session(kept, "s", ["What about in winter?", "ok"])
    asyncio.run(ScoringWorker(kept, RuleJudge(), needs_reward=True, no_verdict="score").run_once())
    assert (kept.select()[0].status, kept.select()[0].reward) == ("ready", 0.0)


def test_idle_sessions_count_as_finished(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["great", None])
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True, session_idle_s=0.0)
    assert asyncio.run(worker.run_once()) == 2


def test_opd_uses_teacher_logprobs_and_drops_turns_without_hint(tmp_path, tiny_tokenizer):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["No, that's wrong. Use Berlin.", "thanks", None])
    done(store, "s")
    with ThreadedServer(scripted_upstream()) as up:
        worker = SeedRulesWorker(
            store,
            RuleJudge(),
            needs_reward=False,
            needs_teacher=True,
            teacher=TeacherClient(up.url, "tiny"),
            render_teacher_prompt=lambda s, hint: [1, 2, 3, 9],
        )
        asyncio.run(worker.run_once())
    first, second, third = store.select()
    assert first.status == "ready" and first.teacher_logprobs == [-0.5, -0.5] and first.meta["hint"] == "Use Berlin."
    assert first.reward is None
    assert (second.status, second.meta["dropped"], third.status) == ("dropped", "no_hint", "dropped")


def test_combine_dispatch(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["wrong. Use Berlin.", "thanks", None])
    done(store, "s")
    with ThreadedServer(scripted_upstream()) as up:
        worker = SeedRulesWorker(
            store,
            RuleJudge(),
            needs_reward=True,
            needs_teacher=True,
            teacher=TeacherClient(up.url, "tiny"),
            render_teacher_prompt=lambda s, hint: [1, 2, 3],
        )
        asyncio.run(worker.run_once())
    a, b, c = store.select()
    assert a.reward == -1.0 and a.teacher_logprobs is not None  # OPD + RL
    assert b.reward == 1.0 and b.teacher_logprobs is None  # RL only
    assert all(s.status == "ready" for s in (a, b, c))


class HangingJudge:
    async def reward(self, sample):
        await asyncio.sleep(3600)
        return Verdict(1.0)

    async def hint(self, sample):
        await asyncio.sleep(3600)


def test_a_hanging_judge_never_stalls_scoring(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["great", None])
    done(store, "s")
    worker = SeedRulesWorker(store, HangingJudge(), needs_reward=True, timeout_s=0.05, max_attempts=2)
    asyncio.run(worker.run_once())
    assert store.counts()["pending"] == 2 and worker.stats["errors"] == 2
    asyncio.run(worker.run_once())  # second attempt: both turns failed for good and are settled as such
    assert store.counts()["pending"] == 0 and worker.stats["judge_failed"] == 2


class FlakyJudge(RuleJudge):
    """The rule judge, except that the turns listed in `fail` raise (a judge outage for those turns)."""

    def __init__(self, fail: set[int]):
        super().__init__()
        self.fail = fail

    async def reward(self, sample):
        if sample.turn_index in self.fail:
            raise ConnectionError("judge unreachable")
        return await super().reward(sample)


def test_turns_the_judge_failed_on_are_never_trained_on(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["that's wrong", "still wrong", None])
    done(store, "s")
    worker = SeedRulesWorker(store, FlakyJudge({0, 1, 2}), needs_reward=True, max_attempts=1)
    assert asyncio.run(worker.run_once()) == 3
    got = store.select()
    assert [s.status for s in got] == ["dropped"] * 3  # not settled as reward 0 and trained on
    assert all(s.meta["dropped"] == "judge_failed" and "judge unreachable" in s.meta["judge_error"] for s in got)
    assert all(s.reward is None for s in got) and store.counts()["ready"] == 0
    assert worker.stats["judge_failed"] == 3


def test_at_least_one_skips_failed_turns_and_turns_without_evidence(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    # turns 0 and 1 score 0, turn 1 (the later, picked first) failed, turn 2 is the last: no next state
    add_session(store, "s", ["ok", "ok", None])
    done(store, "s")
    worker = SeedRulesWorker(store, FlakyJudge({1}), needs_reward=True, max_attempts=1)
    asyncio.run(worker.run_once())
    first, failed, last = store.select()
    assert (failed.status, failed.meta["dropped"]) == ("dropped", "judge_failed")
    assert first.reward == 1.0 and first.meta["at_least_one"] == {"from": 0.0}  # the only turn with evidence
    assert last.reward == 0.0 and "at_least_one" not in last.meta


def test_at_least_one_lifts_nothing_when_no_turn_had_evidence(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", [None])  # a one-turn session: the judge saw no reaction to the reply
    done(store, "s")
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True)
    asyncio.run(worker.run_once())
    [only] = store.select()
    assert only.reward == 0.0 and "at_least_one" not in only.meta


class RecordingEvolver:
    def __init__(self):
        self.calls = []

    def evolve(self, agent_id, failed_turns):
        self.calls.append((agent_id, failed_turns))


def test_failed_turns_go_to_the_skill_evolver(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["wrong", "thanks", None])
    done(store, "s")
    evolver = RecordingEvolver()
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True, evolver=evolver)
    asyncio.run(worker.run_once())
    assert worker.drain_evolution(10)  # the evolver runs on its own thread, off the scoring loop
    [(agent, failed)] = evolver.calls
    assert agent == "default" and [f["reward"] for f in failed] == [-1.0, 0.0]


def test_idle_sessions_go_to_the_skill_evolver(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    ids = add_session(store, "s", ["wrong", None])  # never marked done
    evolver = RecordingEvolver()
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True, session_idle_s=0.0, evolver=evolver)
    asyncio.run(worker.run_once())
    assert worker.drain_evolution(10)
    [(_, failed)] = evolver.calls
    assert [f["sample_id"] for f in failed] == ids and failed[0]["next_state"] == "wrong"


def test_every_n_turns_evolves_before_the_session_ends(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    ids = add_session(store, "s", ["wrong", "thanks", "wrong", None])
    evolver = RecordingEvolver()
    worker = SeedRulesWorker(
        store, RuleJudge(), needs_reward=True, session_idle_s=1e9, evolver=evolver, evolve_every_n_turns=2
    )
    asyncio.run(worker.run_once())  # three turns have a next state; rewards are held for at-least-one
    assert worker.drain_evolution(10) and store.counts()["pending"] == 4
    assert [[f["sample_id"] for f in failed] for _, failed in evolver.calls] == [[ids[0]]]
    done(store, "s")
    asyncio.run(worker.run_once())  # the 4th turn completes the next pair; the session end finds nothing left
    assert worker.drain_evolution(10)
    assert [[f["sample_id"] for f in failed] for _, failed in evolver.calls] == [[ids[0]], [ids[2], ids[3]]]


class BlockingEvolver:
    def __init__(self, fail: bool = False):
        self.release, self.fail, self.calls = threading.Event(), fail, 0

    def evolve(self, agent_id, failed_turns):
        self.release.wait(30)
        self.calls += 1
        if self.fail:
            raise RuntimeError("evolver endpoint exploded")


def test_evolution_runs_off_the_scoring_loop_and_its_failures_are_logged(tmp_path, caplog):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["wrong", None])
    done(store, "s")
    evolver = BlockingEvolver(fail=True)
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True, evolver=evolver)
    assert asyncio.run(worker.run_once()) == 2  # settled while the evolver is still blocked
    assert store.counts()["ready"] == 2 and evolver.calls == 0
    evolver.release.set()
    assert worker.drain_evolution(10)
    assert evolver.calls == 1 and worker.evolution.stats["errors"] == 1
    assert "evolver endpoint exploded" in caplog.text
    from metaclaw.modules.health import HealthMonitor

    monitor = HealthMonitor(str(store.path))
    monitor.attach(worker=worker)
    snap = monitor.snapshot()  # the evolver's health is in the logger too
    assert (snap["skills/evolutions"], snap["skills/unusable"], snap["skills/skipped"]) == (0, 1, 0)
    worker.stop()


class InfiniteTeacher:
    """A teacher endpoint that answers -inf for a token (e.g. a token its top-p cut away)."""

    async def logprobs(self, prompt, response_ids, **distribution):
        return [float("-inf")] + [-0.5] * (len(response_ids) - 1)


def test_a_non_finite_teacher_logprob_drops_the_turn_naming_the_field(tmp_path):
    store = SampleStore(tmp_path / "s.sqlite")
    add_session(store, "s", ["No, that's wrong. Use Berlin.", None])
    done(store, "s")
    worker = SeedRulesWorker(
        store,
        RuleJudge(),
        needs_reward=False,
        needs_teacher=True,
        teacher=InfiniteTeacher(),
        render_teacher_prompt=lambda s, hint: [1, 2, 3],
    )
    assert asyncio.run(worker.run_once()) == 2
    first = store.select()[0]
    assert first.status == "dropped" and first.teacher_logprobs is None
    assert first.meta["dropped"] == "invalid_score: teacher_logprobs must be finite numbers"


def test_a_reaction_ten_minutes_late_reopens_its_turn_and_is_trained(tmp_path):
    """Issue 42: the session went idle (300 s) before the person reacted, so the turn was settled `dropped:
    no_next_state`; the reaction, 10 minutes after the reply, reopens it: scored and ready to train. A reaction
    older than the bound (`late_reaction_max_age_s`) does not reopen it. Clocks are injected: nothing sleeps."""
    wall = [1_000.0]
    store = SampleStore(tmp_path / "s.sqlite", late_reaction_max_age_s=3600.0, clock=lambda: wall[0])
    (turn,) = add_session(store, "s", [None])
    (old,) = add_session(store, "o", [None])
    mono = [0.0]
    worker = SeedRulesWorker(store, RuleJudge(), needs_reward=True, at_least_one=False, no_next_state="drop",
                           session_idle_s=300.0, clock=lambda: mono[0])  # fmt: skip
    assert asyncio.run(worker.run_once()) == 0  # the sessions are fresh: nothing settles yet
    mono[0] = wall[0] = 1_000.0 + 301.0
    assert asyncio.run(worker.run_once()) == 2
    assert [s.meta["dropped"] for s in store.select("dropped")] == ["no_next_state"] * 2
    wall[0] = 1_000.0 + 600.0  # the reaction, 10 minutes after the reply
    store.write_batch(next_states=[(turn, "no, that's wrong")])
    wall[0] = 1_000.0 + 3601.0  # past the bound: the other turn stays dropped
    store.set_next_state(old, "thanks, works")
    reopened = store.get(turn)
    assert reopened.status == "pending" and reopened.meta["late_reaction"] == 600.0
    assert "dropped" not in reopened.meta and store.get(old).status == "dropped"
    assert asyncio.run(worker.run_once()) == 1
    scored = store.get(turn)
    assert (scored.status, scored.reward, scored.text.next_state) == ("ready", -1.0, "no, that's wrong")
