"""`ScoringWorker`: the background loop that turns pending samples into `ready` (or `dropped`) ones.

A pending sample is scored once its next state is known or its session is finished (marked done, or idle for
`session_idle_s`). What is computed follows the method (seed 002):
- `rl`: PRM reward; with `at_least_one` (off by default), a session's rewards are settled together when it
  finishes, and if every turn scored ≤ 0 the best *neutral* one with evidence (reward 0, a next state the judge
  saw, no feedback) gets +1: a turn the user or the judge called bad is never lifted.
- `opd`: hint from the next state, then teacher logprobs of the response under prompt + hint; no hint → dropped.
- `combine`: both; a sample is ready with either signal (the advantage dispatches three ways).
Judges run under a timeout with bounded attempts, so a hanging judge never stalls training. A turn whose scoring
failed `max_attempts` times is settled `dropped` (reason `judge_failed`): it is never trained on (a reward of 0
made up during an outage is noise) and takes no part in at-least-one.
With an evolver, every scored turn is noted and an agent's turns with judge reward ≤ 0 go to it when one of its
sessions finishes and every `evolve_every_n_turns` turns (`EvolutionScheduler`: its own thread, one at a time).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from metaclaw.distribution import sample_distribution
from metaclaw.scoring.distill import ContextDistiller, stated_preference
from metaclaw.scoring.feedback import FeedbackRule, feedback_of
from metaclaw.scoring.judges import Judge
from metaclaw.scoring.teacher import TeacherClient
from metaclaw.skills.hooks import EvolutionScheduler, SkillEvolverLike
from metaclaw.store import Sample, SampleStore, SampleValidationError, open_session_log

log = logging.getLogger(__name__)

FEEDBACK = FeedbackRule()  # the default rule: the user's score is the reward (`rollout.scoring.feedback`)


@dataclass
class TurnScore:
    reward: float | None = None
    hint: str | None = None
    teacher: list[float] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    failed: bool = False  # scoring failed `max_attempts` times: settled as dropped, never trained on
    feedback: dict[str, Any] | None = None  # the feedback this score was computed with
    preference: str | None = None  # what the person's correction says they want: distilled once the turn settles


DISTILL_BACKLOG = 32
"""Corrections waiting to be distilled (`ScoringWorker`); the newest is distilled first, the oldest dropped when full:
a preference the person keeps stating comes back in their next correction, and an old one's turn ages out anyway."""


class DistillQueue:
    """Settled corrections waiting to be distilled: at most `DISTILL_BACKLOG`, the newest out first."""

    def __init__(self, limit: int = DISTILL_BACKLOG) -> None:
        self.limit, self._items, self._lock = limit, deque[tuple[Sample, str]](), threading.Lock()

    def push(self, sample: Sample, preference: str) -> bool:
        """Queue a settled correction; True when the queue was full and its oldest one was dropped for it."""
        with self._lock:
            full = len(self._items) >= self.limit
            if full:
                self._items.popleft()
            self._items.append((sample, preference))
            return full

    def pop(self) -> tuple[Sample, str] | None:
        with self._lock:
            return self._items.pop() if self._items else None

    def __len__(self) -> int:
        return len(self._items)


def is_heldout(session_id: str, share: float) -> bool:
    """Whether a session is held out of training (`share` of sessions, by a stable hash of its id)."""
    return share > 0 and zlib.crc32(session_id.encode()) % 10_000 < share * 10_000


@dataclass(frozen=True)
class ScoringPolicy:
    """What the method consumes and how turns settle (`ScoringWorker`'s arguments of the same names)."""

    needs_reward: bool
    needs_teacher: bool
    at_least_one: bool
    heldout_share: float
    drop_unanswered: bool  # `no_next_state=drop`: a turn nothing reacted to is settled `dropped`
    drop_no_verdict: bool = True  # `no_verdict=drop`: a turn whose next message judges nothing is settled `dropped`


@dataclass(frozen=True)
class ScoringPace:
    """How often and how long the worker works (`ScoringWorker`'s arguments of the same names)."""

    poll_s: float
    session_idle_s: float
    timeout_s: float
    max_attempts: int
    concurrency: int


@dataclass
class ScoringProgress:
    """The worker's memory between passes: scores computed, failed attempts, each session's last change, and the
    settled corrections waiting to be distilled."""

    scores: dict[int, TurnScore] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    last_change: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    distill: DistillQueue = field(default_factory=DistillQueue)


class ScoringWorker:
    """Polls the store and scores pending samples; run it with `start()`/`stop()` (a thread) or `await run_once()`.

    Args:
        store: the sample store (the worker opens its own connection to the same file).
        judge: reward and hint judge.
        needs_reward / needs_teacher: what the training method consumes (`cfg.method`).
        teacher: teacher-logprob client (required when `needs_teacher`).
        render_teacher_prompt: `(sample, hint) -> prompt ids` (the chat template with the hint).
        poll_s: pause between passes.
        session_idle_s: a session with no new turn for this long counts as finished.
        at_least_one: seed 002's guarantee (RL): if every judged turn of a finished session scored ≤ 0, the
            latest neutral one (reward 0) with a next state and no feedback gets +1; never one scored < 0. Off by
            default: it holds every reward until the session ends and invents a reward nobody gave.
        timeout_s: per judge/teacher call.
        max_attempts: a turn whose scoring failed this many times is settled as `dropped` (`judge_failed`).
        concurrency: turns scored at once.
        evolver: optional skill evolver, given an agent's turns with judge reward ≤ 0 (before at-least-one).
        evolve_every_n_turns: besides at session end, evolve after this many scored main turns of an agent
            (None or 0: only at session end).
        feedback: how explicit feedback (`meta.feedback`) combines with the judge: `{mode, weight}`
            (`scoring.feedback.FeedbackRule`). A turn with feedback is scored without waiting for its next state
            and never takes part in at-least-one.
        heldout_share: share of sessions held out of training for the judge-based live evaluation
            (`eval.judge_fallback`): chosen by a hash of the session id (`is_heldout`), scored like every turn,
            then settled as `dropped` with reason `heldout` (reward kept), never trained on.
        no_next_state: a turn nothing reacted to (no next state, no feedback: a session's last turn) is judged
            like any other (`score`: e.g. the rule judge's `no_next_state_reward`) or settled `dropped` with
            reason `no_next_state` (`drop`, the default: the judge has no evidence, and a made-up 0
            centred over a batch of corrected turns is a push towards the unreacted reply). A reaction that
            arrives later reopens such a turn (the store: `LATE_REACTION_MAX_AGE_S`) and it is scored then.
        no_verdict: a turn whose next message says nothing about it (the judge's reward is exactly 0: the next
            question alone, a follow-up task, an update of the person's own request; no feedback, no teacher signal)
            is settled `dropped` with reason `no_verdict` (`drop`, the default), or trained with reward 0 (`score`).
            Centred over a step's batch, a 0 among corrections is a push towards that reply, and one among approvals
            a push away from it: a verdict the person never gave (session 24's human-mode run of `summary_first`
            trained 243 such zeros among 506 turns). A turn lifted by `at_least_one` or held out settles as before.
        clock: the monotonic clock of session idleness (tests pass their own).
        distiller: learning from the words (`distill`, `scoring.distill`): a turn read as a correction whose
            correction states what the person wants gets a second, new sample: the teacher's reply with that
            preference in context, trained on the prompt without it. The corrected turn keeps its own score.
            Never for held-out sessions; a distillation that fails is logged and counted, the turn still settles.
            It runs off the scoring path: a turn settles with its own score at once and is queued
            (`DISTILL_BACKLOG`, newest first, the oldest dropped and counted), so the teacher's generation never
            holds back the scores training waits for (it held them for 6 minutes at a time under load).
    """

    def __init__(
        self,
        store: SampleStore,
        judge: Judge,
        needs_reward: bool = True,
        needs_teacher: bool = False,
        teacher: TeacherClient | None = None,
        render_teacher_prompt: Callable[[Sample, str], list[int]] | None = None,
        poll_s: float = 0.5,
        session_idle_s: float = 300.0,
        at_least_one: bool = False,
        timeout_s: float = 60.0,
        max_attempts: int = 3,
        concurrency: int = 4,
        evolver: SkillEvolverLike | None = None,
        evolve_every_n_turns: int | None = None,
        feedback: FeedbackRule | Any = FEEDBACK,
        heldout_share: float = 0.0,
        no_next_state: str = "drop",
        no_verdict: str = "drop",
        clock: Callable[[], float] = time.monotonic,
        distiller: ContextDistiller | Any = None,
    ) -> None:
        if not 0.0 <= heldout_share < 1.0:
            raise ValueError(f"eval.judge_fallback.heldout_share must be in [0, 1), got {heldout_share}")
        for key, value in (("no_next_state", no_next_state), ("no_verdict", no_verdict)):
            if value not in ("score", "drop"):
                raise ValueError(f"rollout.scoring.{key} must be 'score' or 'drop', got {value!r}")
        if needs_teacher and (teacher is None or render_teacher_prompt is None):
            raise ValueError("a method that needs teacher logprobs needs a teacher client and a prompt renderer")
        self.store, self.judge, self.teacher, self.render = store, judge, teacher, render_teacher_prompt
        self.policy = ScoringPolicy(
            needs_reward, needs_teacher, at_least_one, heldout_share, no_next_state == "drop", no_verdict == "drop"
        )
        self.pace = ScoringPace(poll_s, session_idle_s, timeout_s, max_attempts, concurrency)
        self.clock = clock
        self.evolution = EvolutionScheduler(evolver, evolve_every_n_turns) if evolver is not None else None
        self.sessions = open_session_log(store)
        self.feedback = FeedbackRule.of(feedback)
        self.progress = ScoringProgress()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.distiller = distiller
        self.stats = {"scored": 0, "ready": 0, "dropped": 0, "errors": 0, "judge_failed": 0, "heldout": 0,
                      "distilled": 0, "distill_failed": 0, "distill_backlog_dropped": 0,
                      "distill_rest_s": 0.0}  # fmt: skip

    # ---- one pass -----------------------------------------------------------------------------------------
    async def run_once(self, drain_distill: bool = True) -> int:
        """Score what can be scored now and settle what can be settled; returns how many samples were settled.
        With `drain_distill` the distillations the settled turns queued run before it returns (the background
        loop runs them beside the next passes instead)."""
        pending = await asyncio.to_thread(self.store.select, "pending")
        done = await asyncio.to_thread(self.sessions.done_sessions)
        groups: dict[tuple[str, str], list[Sample]] = {}
        for s in pending:
            groups.setdefault((s.agent_id, s.session_id), []).append(s)
        now = self.clock()
        finished: dict[tuple[str, str], bool] = {}
        todo: list[Sample] = []
        scores = self.progress.scores
        for key, samples in groups.items():
            newest = max(s.id for s in samples)
            if self.progress.last_change.get(key, (None,))[0] != newest:
                self.progress.last_change[key] = (newest, now)
            finished[key] = key in done or now - self.progress.last_change[key][1] >= self.pace.session_idle_s
            for s in samples:  # feedback that arrived after a score was computed: score again
                if s.id in self.progress.scores and self.progress.scores[s.id].feedback != feedback_of(s.meta):
                    del self.progress.scores[s.id]
            todo += [
                s
                for s in samples
                if s.id not in scores and (s.text.next_state is not None or finished[key] or feedback_of(s.meta))
            ]
        sem = asyncio.Semaphore(self.pace.concurrency)

        async def guarded(s: Sample) -> None:
            async with sem:
                await self._score(s)

        await asyncio.gather(*(guarded(s) for s in todo))
        settled = 0
        for key, samples in groups.items():
            settled += await asyncio.to_thread(self._settle, key, samples, finished[key])
        if drain_distill:
            while await self.distill_next():
                pass
        return settled

    async def _score(self, s: Sample) -> None:
        try:
            score, fb = TurnScore(), feedback_of(s.meta)
            if self.policy.drop_unanswered and s.text.next_state is None and fb is None:
                self.progress.scores[s.id] = score  # settled `dropped` (no_next_state): nothing to ask a judge about
                return
            if self.policy.needs_reward and (fb is None or self.feedback.needs_judge):
                verdict = await asyncio.wait_for(self.judge.reward(s), self.pace.timeout_s)
                score.reward, score.meta["judge"] = verdict.reward, verdict.detail
            if fb is not None:
                score.meta["judge_reward"] = score.reward
                score.reward = self.feedback.reward(score.reward, fb["score"]) if self.policy.needs_reward else None
                score.hint = fb.get("text") or None
            if self.policy.needs_teacher and score.hint is None and s.text.next_state:
                score.hint = await asyncio.wait_for(self.judge.hint(s), self.pace.timeout_s)
            if self.policy.needs_teacher and score.hint:
                prompt = await asyncio.to_thread(self.render, s, score.hint)
                dist = sample_distribution(s.temperature, s.meta)  # the student's: docs/training.md
                score.teacher = await asyncio.wait_for(
                    self.teacher.logprobs(prompt, s.response_ids, **dist), self.pace.timeout_s
                )
            score.feedback = fb
            if self.distiller is not None and not is_heldout(s.session_id, self.policy.heldout_share):
                self._wants_distill(s, score)
            self.progress.scores[s.id] = score
            self.stats["scored"] += 1
            if self.evolution is not None:
                self.evolution.note(
                    s.agent_id, s.id, score.reward, s.text.messages, s.text.response_text, s.text.next_state
                )
        except Exception as e:  # noqa: BLE001 - a judge may fail in any way; bounded retries below
            n = self.progress.attempts[s.id] = self.progress.attempts.get(s.id, 0) + 1
            self.stats["errors"] += 1
            log.warning("Scoring sample %d failed (attempt %d/%d): %r", s.id, n, self.pace.max_attempts, e)
            if n >= self.pace.max_attempts:
                fb = feedback_of(s.meta)
                if fb is not None and self.policy.needs_reward:  # the user's score stands without the judge
                    reward = self.feedback.reward(None, fb["score"])
                    why = {"judge_error": repr(e)[:300]}
                    self.progress.scores[s.id] = TurnScore(reward=reward, meta=why, feedback=fb)
                else:
                    why = {"judge_error": repr(e)[:300]}
                    self.progress.scores[s.id] = TurnScore(meta=why, failed=True, feedback=fb)
                    self.stats["judge_failed"] += 1
                if self.evolution is not None:  # counted as a turn, but no verdict to learn from
                    self.evolution.note(s.agent_id, s.id, None)

    def _wants_distill(self, s: Sample, score: TurnScore) -> None:
        """Learning from the words: a correction whose words state what the person wants is distilled once the
        turn settles (`score.preference`); the turn's own reward is left as it is."""
        corrected = (score.reward or 0) < 0 if self.policy.needs_reward else bool(score.hint)
        if not corrected:
            return
        words = (score.feedback or {}).get("text") or s.text.next_state  # the person's own words, not a judge's summary
        score.preference = stated_preference(words)
        score.meta["distill"] = {"skipped": "no stated preference"} if score.preference is None else {"queued": True}

    async def distill_next(self) -> bool:
        """Distil the newest queued correction (a fresh preference first); False when none is queued. Its
        accepted replies are stored as new samples; what happened is noted on the corrected turn (`meta.distill`)."""
        item = self.progress.distill.pop()
        if item is None:
            return False
        s, preference = item
        assert self.distiller is not None  # only queued with one
        try:
            new, info = await self.distiller.distill(s, preference)
        except Exception as e:  # noqa: BLE001 - the turn's own score stands; the failure is counted and said
            self.stats["distill_failed"] += 1
            new, info = [], {"error": repr(e)[:300]}
            log.warning("Sample %d: context distillation failed: %r", s.id, e)
        if new:
            await asyncio.to_thread(self._store_distilled, s, new)
        await asyncio.to_thread(self.store.note, s.id, "distill", info)
        return True

    # ---- settling -----------------------------------------------------------------------------------------
    def _settle(self, key: tuple[str, str], samples: list[Sample], finished: bool) -> int:
        scored = [s for s in samples if s.id in self.progress.scores]
        complete = finished and len(scored) == len(samples)
        hold = self.policy.needs_reward and self.policy.at_least_one
        explicit = all(feedback_of(s.meta) for s in samples)  # re-opened by feedback: nothing to wait for
        if hold and not explicit:
            if not complete:
                return 0
            self._at_least_one(scored)
        for s in scored:
            self._finalize(s, self.progress.scores.pop(s.id))
        if complete:
            self.progress.last_change.pop(key, None)
            if self.evolution is not None:
                self.evolution.session_finished(*key)
        return len(scored)

    def _at_least_one(self, scored: list[Sample]) -> None:
        """If every judged turn of a finished session scored ≤ 0, lift the latest neutral one with evidence to +1.

        Turns whose scoring failed take no part (their rewards are unknown, not ≤ 0), and a turn without a next
        state is never picked: the judge saw no reaction to it, so +1 there would be a reward without evidence.
        A turn the judge scored < 0 or the user rated (feedback) is never lifted: the user called it bad, or
        has spoken.
        """
        judged = [s for s in scored if not self.progress.scores[s.id].failed]
        rewards = [self.progress.scores[s.id].reward for s in judged]
        if not judged or not all(r is not None and r <= 0 for r in rewards):
            return
        # a turn with explicit feedback counts towards "all <= 0" but is never lifted: the user has spoken
        candidates = [
            i
            for i, s in enumerate(judged)
            if s.text.next_state is not None and not feedback_of(s.meta) and rewards[i] == 0
        ]
        if not candidates:
            return
        best = max(candidates, key=lambda i: (rewards[i], judged[i].turn_index))
        sc = self.progress.scores[judged[best].id]
        sc.meta["at_least_one"] = {"from": sc.reward}
        sc.reward = 1.0

    def _finalize(self, s: Sample, score: TurnScore) -> None:
        self.progress.attempts.pop(s.id, None)
        reward = score.reward if self.policy.needs_reward and not score.failed else None
        teacher = score.teacher if self.policy.needs_teacher and not score.failed else None
        meta = dict(score.meta)
        if score.hint:
            meta["hint"] = score.hint
        usable = reward is not None or teacher is not None
        if self.policy.drop_unanswered and s.text.next_state is None and score.feedback is None and not score.failed:
            meta["dropped"], usable = "no_next_state", False  # nothing reacted to it: no evidence either way
        elif usable and is_heldout(s.session_id, self.policy.heldout_share):  # evaluation data: never trained on
            meta["dropped"], usable = "heldout", False
            self.stats["heldout"] += 1
        elif self._no_verdict(reward, teacher, score):
            meta["dropped"], usable = "no_verdict", False  # the next message judged nothing: no evidence either way
        elif score.failed:
            meta["dropped"] = "judge_failed"
        elif not usable:
            meta["dropped"] = "no_hint" if self.policy.needs_teacher else "no_reward"
        try:
            settled = self.store.set_score(
                s.id, reward=reward, teacher_logprobs=teacher, status="ready" if usable else "dropped", meta=meta,
                expect_meta={"feedback": score.feedback},
            )  # fmt: skip
            if not settled:
                return  # feedback arrived while this was scored: scored again with it on the next pass
        except SampleValidationError as e:  # e.g. a teacher that returned -inf: refused, named, never trained on
            log.warning("Sample %d: the score was refused (%s); dropping the turn", s.id, e)
            usable, reward = False, None
            self.store.set_score(s.id, status="dropped", meta={**meta, "dropped": f"invalid_score: {e}"})
        s.reward = reward
        self.stats["ready" if usable else "dropped"] += 1
        if score.preference is not None and usable and self.progress.distill.push(s, score.preference):
            self.stats["distill_backlog_dropped"] += 1  # queued; the oldest waiting correction made room

    def _no_verdict(self, reward: float | None, teacher: Any, score: TurnScore) -> bool:
        """Whether a scored turn carries no verdict (`no_verdict`): reward exactly 0, from the judge alone (no
        feedback, no teacher signal, not lifted by `at_least_one`)."""
        lifted = "at_least_one" in score.meta
        return self.policy.drop_no_verdict and reward == 0 and teacher is None and score.feedback is None and not lifted

    def _store_distilled(self, source: Sample, new: list[Sample]) -> None:
        """Store the distilled samples (`ready`; the store's privacy screen applies as to any captured turn)."""
        try:
            self.store.insert_many(new)
            self.stats["distilled"] += len(new)
        except SampleValidationError as e:
            self.stats["distill_failed"] += 1
            log.warning("Sample %d: the distilled replies were refused (%s)", source.id, e)

    # ---- background thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        async def distilling() -> None:
            while not self._stop.is_set():
                try:
                    t0 = time.monotonic()
                    if not await self.distill_next():
                        await asyncio.sleep(self.pace.poll_s)
                        continue
                    rest = self.distiller.pace.rest_s(time.monotonic() - t0)  # the teacher's time follows its yield
                    if rest > 0:
                        self.stats["distill_rest_s"] += rest
                        await asyncio.sleep(rest)
                except Exception:  # noqa: BLE001 - keep distilling whatever one correction hit
                    log.exception("Distillation failed")

        async def main() -> None:
            background = asyncio.create_task(distilling()) if self.distiller is not None else None
            while not self._stop.is_set():
                try:
                    n = await self.run_once(drain_distill=False)
                    if n:
                        log.debug("Scored %d samples; store: %s", n, await asyncio.to_thread(self.store.counts))
                except Exception:  # noqa: BLE001 - keep scoring whatever one pass hit
                    log.exception("Scoring pass failed")
                await asyncio.sleep(self.pace.poll_s)
            if background is not None:
                background.cancel()

        asyncio.run(main())

    def start(self) -> ScoringWorker:
        self._thread = threading.Thread(target=self._loop, name="scoring-worker", daemon=True)
        self._thread.start()
        return self

    def drain_evolution(self, timeout_s: float | None = 30.0) -> bool:
        """Wait for the skill evolutions started so far (tests, shutdown); True when none is left running."""
        return self.evolution is None or self.evolution.drain(timeout_s)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout)
        if self.evolution is not None:
            self.evolution.close(timeout)
