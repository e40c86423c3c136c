"""`LiveEvaluator`: held-out compliance of every published adapter, measured in the background; optional gate.

The publisher hands each new adapter to `submit(step, path, hot_load)` instead of hot-loading it itself:

- gate off: the adapter is hot-loaded at once; every `every_n_adapters`-th one is queued for evaluation.
- gate on (`publish.gate.enabled`): every candidate is queued; the evaluator loads it under its own name
  (`eval_name`, never the one the agent is served), scores it, and hot-loads it unless the evidence says, with
  confidence `1 - alpha`, that its compliance is below the served adapter's (the base model's, before any) by more
  than `margin` (`metaclaw.evaluation.gate.compliance_test`; evidence that cannot tell serves it, logged and
  counted as `eval/gate_inconclusive`, and the regression watch guards it) **or** its replies collapsed: their
  mean base-model NLL per token is above the base model's own plus `max_nll_increase` (a rule-passing adapter that
  writes junk is refused too). A refused adapter stays on disk; the refusal is logged and counted
  (`eval/gate_rejected`).

Without a verifier (`rollout=proxy|replay`) the evaluator may be a `HeldoutTurnsEvaluator` (`by_version`):
each publish queues a pass that reports the judge's verdicts on the held-out turns of every adapter version
that has been replaced (the step of such a record is the served version; the last one at the end). With the gate
on, its candidates are gated on those turns (`HeldoutTurnsEvaluator.compare`: the judged verdicts reweighted by
the candidate's likelihood of each reply against the served adapter's), and a candidate is served only when at
least `min_turns` judged held-out turns exist (before that it waits on disk: nothing unmeasured is served).

Every gate decision (and every automatic rollback of the `RegressionWatch`, run between evaluations every
`watch_every_s`) is appended to `<run dir>/gate.jsonl` with its evidence and 95% Wilson intervals. The
decisions themselves are in `metaclaw.evaluation.gate`.

Cost (`max_share`): an adapter evaluation during training, gated or not, is skipped (`eval/skipped_budget`; a
gated candidate then stays on disk, unserved, with a `skipped` record in gate.jsonl, and a later one is measured)
when it would bring the evaluator's busy time above `max_share` of the time since it started (the cost of the
next one is taken to be the last one's); the base model and the final adapter are always measured. On a CPU an
evaluation competes with training for the same cores, so the budget is what keeps the training going. With
`baseline="auto"` the base model is measured first when its replies are cached (free), else after training, beside
the final adapter, when the first samples no longer wait behind it (the gate always measures it first); such a
first run measures no adapter during training (each would need the base model's figures first).

One background thread does the work; the queue holds at most `max_pending` adapters and drops the oldest
waiting one when a newer arrives (counted as `eval/skipped`): training and serving never wait for it. Results
are appended to `<run dir>/eval.jsonl` at once and logged as `eval/*` metrics from the training thread (the
loggers are not thread-safe). At the end of training it waits up to `final_timeout_s` for the queue to drain.

Many agents (docs/agents.md): each agent with an adapter of its own can have its own evaluator (`add_agent`):
its base model baseline and adapters are scored with that agent's evaluator (its preference, its skills; or its
held-out turns), the gate compares a candidate with that agent's served adapter, records carry `agent_id`, and
its metrics are `agent/<id>/eval/*` (the default agent's stay `eval/*`). One thread and one queue serve them all.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L

from metaclaw.agents import DEFAULT_PROFILE
from metaclaw.evaluation.evaluator import ComplianceEvaluator, EvalResult
from metaclaw.evaluation.gate import GateDecisions, HotLoad, Track
from metaclaw.evaluation.regression import RegressionWatch
from metaclaw.wire.client import Endpoint, load_adapter

log = logging.getLogger(__name__)

TURNS, FINAL_TURNS = -1, -2  # queue markers of the judge fallback: report replaced versions / all versions


def _label(unfinished: dict[str, Any]) -> str:
    step = unfinished["step"]
    return f"{unfinished['agent_id']} {'served versions' if step is None else f'step {step}'}"




class LiveEvaluator(GateDecisions, L.Callback):
    """Evaluates published adapters on a thread of its own; gates hot-swaps when `gate` is on.

    Args:
        evaluator: scores a served model name (`ComplianceEvaluator`); may be bound later with `bind`.
        run_dir: where `eval.jsonl` goes.
        base_model: the server's base model name (the baseline, evaluated first).
        every_n_adapters: evaluation cadence when the gate is off (the gate evaluates every candidate).
        gate: refuse to hot-swap a candidate scoring worse than the served adapter by more than `margin`.
        margin: allowed drop in compliance (absolute, 0..1).
        alpha: a drop refuses only when the one-sided (1 - alpha) bound of the difference says so (`compliance_test`).
        max_nll_increase: allowed rise of the replies' mean base NLL over the reference replies' (nats/token);
            None: quality is measured but not gated.
        eval_name: the name candidates are loaded under for evaluation.
        server_url / api_key: the policy server (to load the candidate under `eval_name`).
        max_pending: queue bound (oldest waiting adapter dropped first).
        final_timeout_s: how long the end of training waits for pending evaluations.
        max_share: the most of the run's time evaluations during training may take (None: no limit); see the
            module docstring.
        baseline: `first` (the base model before any adapter) or `auto` (first when cached, else at the end).
        min_turns: the judge fallback's gate serves nothing before this many judged held-out turns exist.
        watch: rolls a served adapter back when its verdicts regress (`RegressionWatch`); None: no watch.
        watch_every_s: how often the watch looks (between evaluations, on the evaluator's thread).
    """

    def __init__(
        self,
        evaluator: ComplianceEvaluator | None,
        run_dir: str | Path,
        base_model: str,
        every_n_adapters: int = 1,
        gate: bool = False,
        margin: float = 0.1,
        max_nll_increase: float | None = 1.0,
        eval_name: str = "metaclaw-eval",
        server_url: str | None = None,
        api_key: str | None = None,
        max_pending: int = 2,
        final_timeout_s: float = 300.0,
        max_share: float | None = None,
        baseline: str = "first",
        min_turns: int = 8,
        watch: RegressionWatch | None = None,
        watch_every_s: float = 30.0,
        alpha: float = 0.05,
    ) -> None:
        if baseline not in ("first", "auto"):
            raise ValueError(f"eval.baseline must be first or auto, got {baseline!r}")
        if max_share is not None and not 0 < max_share <= 1:
            raise ValueError(f"eval.max_share must be in (0, 1] or null, got {max_share}")
        if every_n_adapters < 1 or max_pending < 1:
            raise ValueError("eval.every_n_adapters and eval.max_pending must be >= 1")
        self.run_dir, self.base_model = Path(run_dir), base_model
        self.every_n_adapters, self.gate, self.margin, self.eval_name = every_n_adapters, gate, margin, eval_name
        self.server_url, self.api_key, self.final_timeout_s = server_url, api_key, final_timeout_s
        self._eval_url: str | None = None  # evaluation's own server (`bind`); None: `server_url`
        if not 0 < alpha < 1:
            raise ValueError(f"publish.gate.alpha must be in (0, 1), got {alpha}")
        self.max_nll_increase, self.min_turns, self.alpha = max_nll_increase, min_turns, alpha
        self.watch, self.watch_every_s = watch, watch_every_s
        self.frozen: Callable[[], str | None] | None = None  # a reason not to serve now (a user's rollback)
        self.path, self.gate_path = self.run_dir / "eval.jsonl", self.run_dir / "gate.jsonl"
        self.results: list[dict[str, Any]] = []
        self.tracks: dict[str, Track] = {DEFAULT_PROFILE: Track(DEFAULT_PROFILE, evaluator)}
        self._queue: deque[tuple[str, int, Path | None, HotLoad | None]] = deque()
        self._max_pending = max_pending
        self._unlogged: list[tuple[int, dict[str, float]]] = []
        self._cond = threading.Condition()
        self._busy = False
        self._current: tuple[str, int] | None = None  # (agent, step) being evaluated
        self._current_path: Path | None = None  # the candidate being measured (kept on disk meanwhile)
        self._stop = False
        self._closed = False  # nothing is recorded after the end of training stopped waiting
        self.unfinished: list[dict[str, Any]] = []  # evaluations the end of training did not wait for
        self._thread: threading.Thread | None = None
        self.before_final_wait: Callable[[], Any] | None = None  # e.g. stop the simulated user first
        self.max_share = max_share
        self._started_at: float | None = None
        self.busy_s, self._last_cost = 0.0, 0.0  # seconds spent evaluating (cache hits cost none)
        self._training_over = False
        self.baseline = baseline
        self._deferred: list[str] = []  # agents whose base model is measured after training

    # ---- wiring ---------------------------------------------------------------------------------------------
    @property
    def evaluator(self) -> Any:
        """The default agent's evaluator."""
        return self.tracks[DEFAULT_PROFILE].evaluator

    @evaluator.setter
    def evaluator(self, value: Any) -> None:
        self.tracks[DEFAULT_PROFILE].evaluator = value

    @property
    def counts(self) -> dict[str, int]:
        """The default agent's counts (each agent's are in `tracks[id].counts`)."""
        return self.tracks[DEFAULT_PROFILE].counts

    @property
    def served_score(self) -> float | None:
        return self.tracks[DEFAULT_PROFILE].served_score

    def add_agent(
        self, agent: str, evaluator: Any, lora_name: str | None = None, owner: Callable[[str], bool] | None = None
    ) -> None:
        """Evaluate (and, with the gate, release) `agent`'s own adapter (served as `lora_name`) with `evaluator`;
        `default` replaces the default agent's evaluator."""
        if agent == DEFAULT_PROFILE:
            self.evaluator = evaluator
        else:
            self.tracks[agent] = Track(agent, evaluator)
        track = self.tracks[agent]
        track.lora_name, track.owner = lora_name or track.lora_name, owner

    def bind(
        self,
        server_url: str,
        evaluator: ComplianceEvaluator | None = None,
        api_key: str | None = None,
        eval_url: str | None = None,
    ) -> None:
        """Point at the policy server the live loop started, with its key (and the evaluator, when built late).

        `eval_url`: evaluation's own server (`devices.eval_server`, the same settings and key), where candidates
        are loaded and measured; the agent's server (`server_url`) is then only asked what it serves and told
        what to serve. None: both on `server_url`."""
        self.server_url = server_url.rstrip("/")
        self._eval_url = eval_url.rstrip("/") if eval_url else None
        if api_key is not None:
            self.api_key = api_key
        if evaluator is not None:
            self.evaluator = evaluator

    def start(self, baseline: bool = True) -> LiveEvaluator:
        """Start the worker; with `baseline`, the base model is evaluated first (step 0), for every agent."""
        if all(t.evaluator is None for t in self.tracks.values()):
            raise RuntimeError("LiveEvaluator has no evaluator: bind one before start()")
        if self._started_at is None:
            self._started_at = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="live-evaluator", daemon=True)
            self._thread.start()
        for track in self.tracks.values():
            if baseline and track.evaluator is not None and not track.by_version:
                if self._defer_baseline(track):
                    self._deferred.append(track.agent)
                    log.info("Eval: the base model (%s) is measured after training (not cached yet)", track.agent)
                else:
                    self._put(track.agent, 0, None, None)
        return self

    def _defer_baseline(self, track: Track) -> bool:
        if self.baseline != "auto" or self.gate:
            return False
        cached = getattr(track.evaluator, "has_cached", None)
        return cached is not None and not cached(self.base_model)

    @property
    def by_version(self) -> bool:
        """The judge fallback: served versions' held-out turns, not candidates sampled on held-out prompts."""
        return any(t.by_version for t in self.tracks.values())

    # ---- the publisher's hook -------------------------------------------------------------------------------
    def submit(self, step: int, path: Path, hot_load: HotLoad, agent: str = DEFAULT_PROFILE) -> None:
        """`agent`'s new adapter was written: hot-load it now (gate off) or after it passed evaluation (gate on).

        An agent without an evaluator of its own is served at once and not evaluated."""
        track = self.tracks.get(agent)
        if track is None or track.evaluator is None:
            hot_load(path)
            return
        track.seen += 1
        track.last = (step, path, hot_load)
        if self.gate and track.seen % self.every_n_adapters:  # off cadence: its training reaches the next one
            track.counts["gate_held"] += 1
            log.info("Gate: %s adapter v%d kept on disk, not served (the gate measures every %d-th candidate)",
                     agent, step, self.every_n_adapters)  # fmt: skip
            if track.by_version:  # the held-out curve keeps up with the served versions
                self._put(agent, TURNS, None, None)
            return
        if not self.gate:
            hot_load(path)
            if track.by_version:
                self._put(agent, TURNS, None, None)
            elif track.evaluator is not None and track.seen % self.every_n_adapters == 0:
                self._put(agent, step, path, None)
            return
        self._put(agent, step, path, hot_load)

    def _put(self, agent: str, step: int, path: Path | None, hot_load: HotLoad | None) -> None:
        with self._cond:  # at most `max_pending` waiting per agent: its oldest waiting one is dropped
            waiting = [item for item in self._queue if item[0] == agent]
            if step == TURNS and waiting:  # any waiting pass of the judge fallback reports the replaced versions
                return
            while len(waiting) >= self._max_pending:
                # a report-only pass goes first (the newcomer reports too): it never pushes a candidate out
                dropped = next((item for item in waiting if item[1] == TURNS), waiting[0])
                waiting.remove(dropped)
                self._queue.remove(dropped)
                if dropped[1] == TURNS:
                    continue
                self.tracks[agent].counts["skipped"] += 1
                log.info("Eval: skipping %s adapter v%d (a newer one is waiting)", agent, dropped[1])
                if dropped[3] is not None and dropped[2] is not None:  # a gated candidate: never served, said so
                    self._log_skipped(agent, dropped[1], dropped[2], "a newer candidate was waiting: it is measured "
                                      "instead")  # fmt: skip
            self._queue.append((agent, step, path, hot_load))
            self.tracks[agent].queued.add(step)
            self._cond.notify_all()

    def _log_skipped(self, agent: str, step: int, path: Path, reason: str) -> None:
        """A gated candidate that is never measured nor served, and why, in gate.jsonl."""
        self._gate_log({"time": time.time(), "kind": "gate", "agent_id": agent, "step": step, "adapter": path.name,
                        "path": str(path), "decision": "skipped", "reasons": [reason]})  # fmt: skip

    # ---- worker ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    if not self._cond.wait(self.watch_every_s if self.watch or self.by_version else None):
                        break  # a quiet spell: look for regressions and versions replaced since
                if self._stop and not self._queue:
                    return
                item = self._queue.popleft() if self._queue else None
                if item is not None:
                    self._busy, self._current, self._current_path = True, (item[0], item[1]), item[2]
            if item is None:
                self.check_regressions()
                self._report_replaced()
                continue
            track = self.tracks[item[0]]
            if self._over_budget(track, item[1], item[2], item[3]):
                track.counts["skipped_budget"] += 1
                track.queued.discard(item[1])  # the end of training measures it if it is the final one
                why = (f"evaluations took {self.busy_s:.0f}s of {time.monotonic() - (self._started_at or 0.0):.0f}s "
                       f"(eval.max_share {self.max_share})")  # fmt: skip
                log.info("Eval: skipping %s adapter v%d (%s)", track.agent, item[1], why)
                if item[3] is not None and item[2] is not None:  # a gated candidate: never served unmeasured, said
                    self._log_skipped(track.agent, item[1], item[2], f"not measured within the evaluation budget: "
                                      f"{why}; a later candidate is measured when the budget allows")  # fmt: skip
                with self._cond:
                    self._busy, self._current, self._current_path = False, None, None
                    self._cond.notify_all()
                continue
            try:
                self._evaluate(track, *item[1:])
            except Exception as e:  # noqa: BLE001 - evaluation never takes training down; said loudly
                track.counts["errors"] += 1
                log.warning("Eval of %s adapter v%d failed: %r", track.agent, item[1], e)
                if item[3] is not None:  # gate: an adapter that could not be evaluated is not served
                    log.warning("Gate: %s adapter v%d not hot-swapped (evaluation failed)", track.agent, item[1])
            finally:
                with self._cond:
                    self._busy, self._current, self._current_path = False, None, None
                    self._cond.notify_all()

    def _over_budget(self, track: Track, step: int, path: Path | None, hot_load: HotLoad | None) -> bool:
        """A mid-training adapter evaluation (not the base, not the final; a gated candidate too) that would exceed
        the budget; with the base model deferred, every ungated one (its quality figures would measure the base
        model now). The judge fallback's gate is not budgeted here (it measures served turns, not replies)."""
        if path is None or step < 0 or self._training_over or (hot_load is not None and track.by_version):
            return False
        if track.agent in self._deferred and hot_load is None:
            return True
        if self.max_share is None:
            return False
        elapsed = time.monotonic() - (self._started_at or time.monotonic())
        return self.busy_s + self._last_cost > self.max_share * (elapsed + self._last_cost)

    def in_use(self) -> set[Path]:
        """What the publisher's retention (`publish.keep_last`) must keep: the candidates waiting or being measured,
        and the adapter served before the one served now (the regression watch's rollback target)."""
        with self._cond:
            paths = {item[2] for item in self._queue if item[2] is not None}
            if self._current_path is not None:
                paths.add(self._current_path)
        if self.watch is not None:
            for versions in list(self.watch.paths.values()):
                seen = dict(versions)
                paths.update(Path(seen[v]) for v in sorted(seen)[-2:] if seen[v])
        return paths

    @property
    def eval_url(self) -> str | None:
        """Where candidates are loaded and measured: evaluation's own server, else the agent's."""
        return self._eval_url or self.server_url

    def rebind_eval(self) -> None:
        """Evaluation's own server is gone (past its restarts): measure on the agent's server from now on."""
        self._eval_url = None
        for track in self.tracks.values():
            if track.evaluator is not None:
                track.evaluator.rebind(self.server_url)

    def _load_candidate(self, path: Path) -> None:
        load_adapter(Endpoint(self.eval_url or "", self.api_key), self.eval_name, str(path.resolve()), 60.0)

    def _evaluate(self, track: Track, step: int, path: Path | None, hot_load: HotLoad | None) -> None:
        evaluator = track.evaluator
        if step in (TURNS, FINAL_TURNS):
            self._report_versions(track, final=step == FINAL_TURNS)
            return
        if track.by_version:  # the judge fallback: gate this candidate, then report the versions replaced
            try:
                if path is not None and hot_load is not None:
                    self._decide_turns(track, step, path, hot_load)
            finally:
                self._report_versions(track)
            return
        if path is None:
            result = evaluator.score(self.base_model)
        else:
            self._load_candidate(path)
            result = evaluator.score(self.eval_name)
        gate = None
        if path is None:
            if track.served_score is None:
                track.served_score, track.served_n = result.compliance, result.n
        elif hot_load is not None:
            gate = self._decide(track, step, path, result, hot_load)
        self._report(track, step, path.name if path else "base", result, gate)

    def _report_versions(self, track: Track, final: bool = False, served: int | None = None) -> None:
        """The judge fallback: report the held-out turns of every version replaced (every version at the end)."""
        if served is None and not final:
            served = self.served_version(track)
        track.report_seen = served
        for version in track.evaluator.versions_due(final=final, served=served):
            label = "base" if version == 0 else f"v{version}"
            self._report(track, version, label, track.evaluator.score_version(version))

    def _report_replaced(self) -> None:
        """Between evaluations: a version replaced since the last report (the gate's hot-load lands after its
        decision; a user's or the watch's rollback) gets its point on the curve without waiting for a publish."""
        for track in list(self.tracks.values()):
            if not track.by_version or self._closed or self._stop:
                continue
            try:
                served = self.served_version(track)
                if served is not None and served != track.report_seen:
                    self._report_versions(track, served=served)
            except Exception as e:  # noqa: BLE001 - evaluation never takes training down; said loudly
                track.counts["errors"] += 1
                log.warning("Eval of %s's replaced versions failed: %r", track.agent, e)

    def _report(
        self, track: Track, step: int, adapter: str, result: EvalResult, gate: dict[str, Any] | None = None
    ) -> None:
        """Append the record to eval.jsonl, queue its metrics for the training thread, log a line."""
        record: dict[str, Any] = {"step": step, "adapter": adapter, "agent_id": track.agent, "time": time.time()}
        record.update({k: v for k, v in result.as_dict().items() if k != "model"})
        if not result.cached:
            self.busy_s += result.seconds
            self._last_cost = result.seconds
        if gate is not None:
            record["gate"] = gate
        with self._cond:
            if self._closed:  # the summary is written already: a late record would contradict it
                log.warning("Eval of %s %s finished after the end of training stopped waiting: not recorded",
                            track.agent, adapter)  # fmt: skip
                return
            track.counts["evaluated"] += 1
            record["counts"] = dict(track.counts)
            self._append(record)
        figures = {"compliance": result.compliance, "n": float(result.n), "errors": float(result.errors)}
        figures.update({k: getattr(result, k) for k in ("ci_low", "ci_high") if getattr(result, k) is not None})
        figures.update({f"fail_{k}": v for k, v in result.failures.items()})
        quality = {k: getattr(result, k) for k in ("nll", "fluent", "good", "distinct_2", "distinct_replies", "junk")}
        quality["reward"] = result.reward
        figures.update({k: float(v) for k, v in quality.items() if v is not None})
        figures.update({k: float(v) for k, v in track.counts.items()})
        with self._cond:
            self._unlogged.append((step, {f"{track.prefix}{k}": v for k, v in figures.items()}))
        ci = "" if result.ci_low is None else f" [95% CI {100 * result.ci_low:.0f}-{100 * result.ci_high:.0f}%]"
        log.info(
            "Eval %s%s: held-out compliance %.0f%%%s, good %s, base NLL %s (%d replies, %s)%s",
            "" if track.agent == DEFAULT_PROFILE else f"agent {track.agent} ",
            record["adapter"],
            100 * result.compliance,
            ci,
            "-" if result.good is None else f"{100 * result.good:.0f}%",
            "-" if result.nll is None else f"{result.nll:.2f}",
            result.n,
            "cached" if result.cached else f"{result.seconds:.0f}s",
            f" gate: {record['gate']['decision']}" if "gate" in record else "",
        )

    def _append(self, record: dict[str, Any]) -> None:
        self.results.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    # ---- Lightning hooks (training thread) ------------------------------------------------------------------
    def flush(self, trainer: L.Trainer) -> None:
        """Log finished evaluations through the trainer's loggers (from the training thread)."""
        with self._cond:
            done, self._unlogged = self._unlogged, []
        for step, metrics in done:
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=step)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.flush(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training_over = True
        if self.before_final_wait is not None:
            self.before_final_wait()
        for agent in self._deferred:
            self._put(agent, 0, None, None)
        self._deferred = []
        for track in self.tracks.values():
            if track.by_version:
                self._put(track.agent, FINAL_TURNS, None, None)
            elif track.last is not None and track.last[0] not in track.queued and track.evaluator is not None:
                step, path, hot_load = track.last  # the final adapter is always measured (and gated with the gate)
                self._put(track.agent, step, path, hot_load if self.gate else None)
        if not self.wait(self.final_timeout_s):
            self.close()
        self.flush(trainer)
        for lg in trainer.loggers:
            lg.save()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is drained (True) or `timeout_s` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    log.warning("Eval: %d evaluations still running and %d queued after %.0fs", int(self._busy),
                                len(self._queue), timeout_s)  # fmt: skip
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> list[dict[str, Any]]:
        """Record nothing from now on: the running and queued evaluations go to `unfinished` (the summary names
        them), and one that finishes later is logged and dropped, so eval.jsonl and the summary agree."""
        with self._cond:
            if not self._closed:
                self._closed = True
                pending = ([self._current] if self._current else []) + [(a, s) for a, s, *_ in self._queue]
                self.unfinished = [{"agent_id": a, "step": s if s >= 0 else None} for a, s in pending]
                self._queue.clear()
                self._cond.notify_all()
                if self.unfinished:
                    log.warning(
                        "Eval: left out of the summary, not finished within eval.final_timeout_s (%.0fs): %s",
                        self.final_timeout_s, ", ".join(_label(u) for u in self.unfinished),
                    )
            return self.unfinished

    def stop(self, timeout: float = 10.0) -> None:
        self.close()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread:
            self._thread.join(timeout)
