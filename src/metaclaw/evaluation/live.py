"""`LiveEvaluator`: held-out compliance of every published adapter, measured in the background; optional gate.

It is a thin Lightning callback over four parts: the queue worker (`metaclaw.evaluation.worker.EvalWorker`), the
gate (`metaclaw.evaluation.gate.Gate`), the budget (`metaclaw.evaluation.budget.EvalBudget`) and the records
(`EvalRecords`: eval.jsonl and the metrics the training thread logs).

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L

from metaclaw.agents import DEFAULT_PROFILE
from metaclaw.evaluation.budget import EvalBudget
from metaclaw.evaluation.evaluator import ComplianceEvaluator, EvalResult
from metaclaw.evaluation.gate import Gate, HotLoad, Track
from metaclaw.evaluation.regression import RegressionWatch
from metaclaw.evaluation.worker import FINAL_TURNS, TURNS, EvalWorker, Item

log = logging.getLogger(__name__)


def _label(unfinished: dict[str, Any]) -> str:
    step = unfinished["step"]
    return f"{unfinished['agent_id']} {'served versions' if step is None else f'step {step}'}"


class EvalRecords:
    """eval.jsonl and the metrics waiting for the training thread (the loggers are not thread-safe).

    `lock` is the worker's: a record and the end of training's summary never disagree."""

    def __init__(self, path: Path, lock: Any) -> None:
        self.path, self.lock = path, lock
        self.results: list[dict[str, Any]] = []
        self._unlogged: list[tuple[int, dict[str, float]]] = []

    def append(self, record: dict[str, Any]) -> None:
        self.results.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def metrics(self, step: int, figures: dict[str, float]) -> None:
        """Queue `figures` for the training thread's loggers at `step`."""
        with self.lock:
            self._unlogged.append((step, figures))

    def flush(self, trainer: L.Trainer) -> None:
        """Log the queued figures through the trainer's loggers (from the training thread)."""
        with self.lock:
            done, self._unlogged = self._unlogged, []
        for step, metrics in done:
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=step)


class LiveEvaluator(L.Callback):
    """Evaluates published adapters on a thread of its own; gates hot-swaps when `gate` is on.

    Args:
        evaluator: scores a served model name (`ComplianceEvaluator`); may be bound later with `bind`.
        run_dir: where `eval.jsonl` and `gate.jsonl` go.
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
        rebase_after: refused candidates in a row after which the trainer goes back to the served adapter
            (`Gate._rebase`; the trainer's hook is `gatekeeper.rebase.to`); None: never.
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
        rebase_after: int | None = 2,
    ) -> None:
        if every_n_adapters < 1:
            raise ValueError("eval.every_n_adapters and eval.max_pending must be >= 1")
        run_dir = Path(run_dir)
        self.base_model, self.every_n_adapters, self.gate = base_model, every_n_adapters, gate
        self.final_timeout_s, self.watch_every_s = final_timeout_s, watch_every_s
        self.tracks: dict[str, Track] = {DEFAULT_PROFILE: Track(DEFAULT_PROFILE, evaluator)}
        self.budget = EvalBudget(max_share, baseline)
        self.worker = EvalWorker(max_pending, self._handle, self._idle, self._idle_s, self._dropped)
        self.records = EvalRecords(run_dir / "eval.jsonl", self.worker.cond)
        self.gatekeeper = Gate(self.tracks, self.records.metrics, run_dir / "gate.jsonl", base_model, margin, alpha,
                               max_nll_increase, min_turns, eval_name, rebase_after)  # fmt: skip
        self.gatekeeper.server_url, self.gatekeeper.api_key, self.gatekeeper.watch = server_url, api_key, watch
        self.before_final_wait: Callable[[], Any] | None = None  # e.g. stop the simulated user first

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
    def results(self) -> list[dict[str, Any]]:
        """Every record appended to eval.jsonl by this run."""
        return self.records.results

    @property
    def unfinished(self) -> list[dict[str, Any]]:
        """The evaluations the end of training did not wait for (the summary names them)."""
        return self.worker.unfinished

    @property
    def watch(self) -> RegressionWatch | None:
        """The regression watch (`publish.gate.rollback`); None: no watch."""
        return self.gatekeeper.watch

    @watch.setter
    def watch(self, value: RegressionWatch | None) -> None:
        self.gatekeeper.watch = value

    @property
    def frozen(self) -> Callable[[], str | None] | None:
        """A reason not to serve a candidate now (a user's rollback stands); None: nothing holds them."""
        return self.gatekeeper.frozen

    @frozen.setter
    def frozen(self, value: Callable[[], str | None] | None) -> None:
        self.gatekeeper.frozen = value

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
        self.gatekeeper.server_url = server_url.rstrip("/")
        self.gatekeeper._eval_url = eval_url.rstrip("/") if eval_url else None
        if api_key is not None:
            self.gatekeeper.api_key = api_key
        if evaluator is not None:
            self.evaluator = evaluator

    def start(self, baseline: bool = True) -> LiveEvaluator:
        """Start the worker; with `baseline`, the base model is evaluated first (step 0), for every agent."""
        if all(t.evaluator is None for t in self.tracks.values()):
            raise RuntimeError("LiveEvaluator has no evaluator: bind one before start()")
        self.budget.start()
        self.worker.start()
        for track in self.tracks.values():
            if baseline and track.evaluator is not None and not track.by_version:
                if self.budget.defer_baseline(track, self.base_model, self.gate):
                    log.info("Eval: the base model (%s) is measured after training (not cached yet)", track.agent)
                else:
                    self._put(track.agent, 0, None, None)
        return self

    @property
    def by_version(self) -> bool:
        """The judge fallback: served versions' held-out turns, not candidates sampled on held-out prompts."""
        return any(t.by_version for t in self.tracks.values())

    def rebind_eval(self) -> None:
        """Evaluation's own server is gone (past its restarts): measure on the agent's server from now on."""
        self.gatekeeper._eval_url = None
        for track in self.tracks.values():
            if track.evaluator is not None:
                track.evaluator.rebind(self.gatekeeper.server_url)

    def in_use(self) -> set[Path]:
        """What the publisher's retention (`publish.keep_last`) must keep: the candidates waiting or being measured,
        and the adapter served before the one served now (the regression watch's rollback target)."""
        paths = self.worker.paths()
        if self.watch is not None:
            for versions in list(self.watch.paths.values()):
                seen = dict(versions)
                paths.update(Path(seen[v]) for v in sorted(seen)[-2:] if seen[v])
        return paths

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
        if self.worker.put((agent, step, path, hot_load)):
            self.tracks[agent].queued.add(step)

    def _dropped(self, item: Item) -> None:
        """A waiting candidate pushed out by a newer one (the worker's queue bound)."""
        agent, step, path, hot_load = item
        self.tracks[agent].counts["skipped"] += 1
        log.info("Eval: skipping %s adapter v%d (a newer one is waiting)", agent, step)
        if hot_load is not None and path is not None:  # a gated candidate: never served, said so
            self.gatekeeper.log_skipped(agent, step, path, "a newer candidate was waiting: it is measured instead")

    # ---- the worker's thread --------------------------------------------------------------------------------
    def _idle_s(self) -> float | None:
        return self.watch_every_s if self.watch or self.by_version else None

    def _idle(self) -> None:
        """A quiet spell: look for regressions and versions replaced since."""
        self.gatekeeper.check_regressions()
        self._report_replaced()

    def _handle(self, item: Item) -> None:
        track, step, path, hot_load = self.tracks[item[0]], item[1], item[2], item[3]
        if self.budget.over(track, step, path, hot_load):
            track.counts["skipped_budget"] += 1
            track.queued.discard(step)  # the end of training measures it if it is the final one
            why = self.budget.why()
            log.info("Eval: skipping %s adapter v%d (%s)", track.agent, step, why)
            if hot_load is not None and path is not None:  # a gated candidate: never served unmeasured, said so
                self.gatekeeper.log_skipped(track.agent, step, path, f"not measured within the evaluation budget: "
                                            f"{why}; a later candidate is measured when the budget allows")  # fmt: skip
            return
        try:
            self._evaluate(track, step, path, hot_load)
        except Exception as e:  # noqa: BLE001 - evaluation never takes training down; said loudly
            track.counts["errors"] += 1
            log.warning("Eval of %s adapter v%d failed: %r", track.agent, step, e)
            if hot_load is not None:  # gate: an adapter that could not be evaluated is not served
                log.warning("Gate: %s adapter v%d not hot-swapped (evaluation failed)", track.agent, step)

    def _evaluate(self, track: Track, step: int, path: Path | None, hot_load: HotLoad | None) -> None:
        evaluator = track.evaluator
        if step in (TURNS, FINAL_TURNS):
            self._report_versions(track, final=step == FINAL_TURNS)
            return
        if track.by_version:  # the judge fallback: gate this candidate, then report the versions replaced
            try:
                if path is not None and hot_load is not None:
                    self.gatekeeper.decide_turns(track, step, path, hot_load)
            finally:
                self._report_versions(track)
            return
        if path is None:
            result = evaluator.score(self.base_model)
        else:
            self.gatekeeper.load_candidate(path)
            result = evaluator.score(self.gatekeeper.eval_name)
        gate = None
        if path is None:
            if track.served_score is None:
                track.served_score, track.served_n = result.compliance, result.n
        elif hot_load is not None:
            gate = self.gatekeeper.decide(track, step, path, result, hot_load)
        self._report(track, step, path.name if path else "base", result, gate)

    def _report_versions(self, track: Track, final: bool = False, served: int | None = None) -> None:
        """The judge fallback: report the held-out turns of every version replaced (every version at the end)."""
        if served is None and not final:
            served = self.gatekeeper.served_version(track)
        track.report_seen = served
        for version in track.evaluator.versions_due(final=final, served=served):
            label = "base" if version == 0 else f"v{version}"
            self._report(track, version, label, track.evaluator.score_version(version))

    def _report_replaced(self) -> None:
        """Between evaluations: a version replaced since the last report (the gate's hot-load lands after its
        decision; a user's or the watch's rollback) gets its point on the curve without waiting for a publish."""
        for track in list(self.tracks.values()):
            if not track.by_version or self.worker.closed:  # stop closes too
                continue
            try:
                served = self.gatekeeper.served_version(track)
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
        self.budget.charge(result)
        if gate is not None:
            record["gate"] = gate
        with self.records.lock:
            if self.worker.closed:  # the summary is written already: a late record would contradict it
                log.warning("Eval of %s %s finished after the end of training stopped waiting: not recorded",
                            track.agent, adapter)  # fmt: skip
                return
            track.counts["evaluated"] += 1
            record["counts"] = dict(track.counts)
            self.records.append(record)
        figures = {"compliance": result.compliance, "n": float(result.n), "errors": float(result.errors)}
        figures.update({k: getattr(result, k) for k in ("ci_low", "ci_high") if getattr(result, k) is not None})
        figures.update({f"fail_{k}": v for k, v in result.failures.items()})
        quality = {k: getattr(result.quality, k) for k in ("nll", "fluent", "good", "distinct_2", "distinct_replies",
                                                            "junk")}  # fmt: skip
        quality["reward"] = result.reward
        figures.update({k: float(v) for k, v in quality.items() if v is not None})
        figures.update({k: float(v) for k, v in track.counts.items()})
        self.records.metrics(step, {f"{track.prefix}{k}": v for k, v in figures.items()})
        ci = "" if result.ci_low is None else f" [95% CI {100 * result.ci_low:.0f}-{100 * result.ci_high:.0f}%]"
        log.info(
            "Eval %s%s: held-out compliance %.0f%%%s, good %s, base NLL %s (%d replies, %s)%s",
            "" if track.agent == DEFAULT_PROFILE else f"agent {track.agent} ",
            record["adapter"],
            100 * result.compliance,
            ci,
            "-" if result.quality.good is None else f"{100 * result.quality.good:.0f}%",
            "-" if result.quality.nll is None else f"{result.quality.nll:.2f}",
            result.n,
            "cached" if result.cached else f"{result.seconds:.0f}s",
            f" gate: {record['gate']['decision']}" if "gate" in record else "",
        )

    # ---- Lightning hooks (training thread) ------------------------------------------------------------------
    def flush(self, trainer: L.Trainer) -> None:
        """Log finished evaluations through the trainer's loggers (from the training thread)."""
        self.records.flush(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.flush(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.budget.training_over = True
        if self.before_final_wait is not None:
            self.before_final_wait()
        for agent in self.budget.take_deferred():
            self._put(agent, 0, None, None)
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
        return self.worker.wait(timeout_s)

    def close(self) -> list[dict[str, Any]]:
        """Record nothing from now on: the running and queued evaluations go to `unfinished` (the summary names
        them), and one that finishes later is logged and dropped, so eval.jsonl and the summary agree."""
        with self.worker.cond:
            was_closed = self.worker.closed
            unfinished = self.worker.close()
        if unfinished and not was_closed:
            log.warning("Eval: left out of the summary, not finished within eval.final_timeout_s (%.0fs): %s",
                        self.final_timeout_s, ", ".join(_label(u) for u in unfinished))  # fmt: skip
        return unfinished

    def stop(self, timeout: float = 10.0) -> None:
        self.close()
        self.worker.stop(timeout)
