"""`LiveEvaluator`: held-out compliance of every published adapter, measured in the background; optional gate.

The publisher hands each new adapter to `submit(step, path, hot_load)` instead of hot-loading it itself:

- gate off: the adapter is hot-loaded at once; every `every_n_adapters`-th one is queued for evaluation.
- gate on (`publish.gate.enabled`): every candidate is queued; the evaluator loads it under its own name
  (`eval_name`, never the one the agent is served), scores it, and hot-loads it only when its compliance is
  no worse than the served adapter's (the base model's, before any) by more than `margin` **and** its replies
  have not collapsed: their mean base-model NLL per token is at most the base model's own plus `max_nll_increase`
  (a rule-passing adapter that writes junk is refused too). A refused adapter stays on disk; the refusal is
  logged and counted (`eval/gate_rejected`).

Without a verifier (`rollout=proxy|replay`) the evaluator may be a `HeldoutTurnsEvaluator` (`by_version`):
each publish queues a pass that reports the judge's verdicts on the held-out turns of every adapter version
that has been replaced (the step of such a record is the served version; the last one at the end).

One background thread does the work; the queue holds at most `max_pending` adapters and drops the oldest
waiting one when a newer arrives (counted as `eval/skipped`): training and serving never wait for it. Results
are appended to `<run dir>/eval.jsonl` at once and logged as `eval/*` metrics from the training thread (the
loggers are not thread-safe). At the end of training it waits up to `final_timeout_s` for the queue to drain.
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

from metaclaw.evaluation.evaluator import ComplianceEvaluator, EvalResult
from metaclaw.serving.client import load_adapter

log = logging.getLogger(__name__)

HotLoad = Callable[[Path], Any]
TURNS, FINAL_TURNS = -1, -2  # queue markers of the judge fallback: report replaced versions / all versions


class LiveEvaluator(L.Callback):
    """Evaluates published adapters on a thread of its own; gates hot-swaps when `gate` is on.

    Args:
        evaluator: scores a served model name (`ComplianceEvaluator`); may be bound later with `bind`.
        run_dir: where `eval.jsonl` goes.
        base_model: the server's base model name (the baseline, evaluated first).
        every_n_adapters: evaluation cadence when the gate is off (the gate evaluates every candidate).
        gate: refuse to hot-swap a candidate scoring worse than the served adapter by more than `margin`.
        margin: allowed drop in compliance (absolute, 0..1).
        max_nll_increase: allowed rise of the replies' mean base NLL over the base model's own (nats/token);
            None: quality is measured but not gated.
        eval_name: the name candidates are loaded under for evaluation.
        server_url / api_key: the policy server (to load the candidate under `eval_name`).
        max_pending: queue bound (oldest waiting adapter dropped first).
        final_timeout_s: how long the end of training waits for pending evaluations.
    """

    def __init__(
        self,
        evaluator: ComplianceEvaluator | None,
        run_dir: str | Path,
        base_model: str,
        every_n_adapters: int = 1,
        gate: bool = False,
        margin: float = 0.1,
        max_nll_increase: float | None = 0.5,
        eval_name: str = "metaclaw-eval",
        server_url: str | None = None,
        api_key: str | None = None,
        max_pending: int = 2,
        final_timeout_s: float = 300.0,
    ) -> None:
        if every_n_adapters < 1 or max_pending < 1:
            raise ValueError("eval.every_n_adapters and eval.max_pending must be >= 1")
        self.evaluator, self.run_dir, self.base_model = evaluator, Path(run_dir), base_model
        self.every_n_adapters, self.gate, self.margin, self.eval_name = every_n_adapters, gate, margin, eval_name
        self.server_url, self.api_key, self.final_timeout_s = server_url, api_key, final_timeout_s
        self.max_nll_increase = max_nll_increase
        self.path = self.run_dir / "eval.jsonl"
        self.results: list[dict[str, Any]] = []
        self.counts = {"evaluated": 0, "skipped": 0, "gate_accepted": 0, "gate_rejected": 0, "errors": 0}
        self.served_score: float | None = None
        self._queue: deque[tuple[int, Path | None, HotLoad | None]] = deque()
        self._max_pending = max_pending
        self._unlogged: list[tuple[int, dict[str, float]]] = []
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._seen = 0
        self._last: tuple[int, Path] | None = None
        self._queued_steps: set[int] = set()
        self.before_final_wait: Callable[[], Any] | None = None  # e.g. stop the simulated user first

    # ---- wiring ---------------------------------------------------------------------------------------------
    def bind(
        self, server_url: str, evaluator: ComplianceEvaluator | None = None, api_key: str | None = None
    ) -> None:
        """Point at the policy server the live loop started, with its key (and the evaluator, when built late)."""
        self.server_url = server_url.rstrip("/")
        if api_key is not None:
            self.api_key = api_key
        if evaluator is not None:
            self.evaluator = evaluator

    def start(self, baseline: bool = True) -> LiveEvaluator:
        """Start the worker; with `baseline`, the base model is evaluated first (step 0)."""
        if self.evaluator is None:
            raise RuntimeError("LiveEvaluator has no evaluator: bind one before start()")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="live-evaluator", daemon=True)
            self._thread.start()
        if baseline and not self.by_version:
            self._put(0, None, None)
        return self

    @property
    def by_version(self) -> bool:
        """The judge fallback: served versions' held-out turns, not candidates sampled on held-out prompts."""
        return bool(getattr(self.evaluator, "by_version", False))

    # ---- the publisher's hook -------------------------------------------------------------------------------
    def submit(self, step: int, path: Path, hot_load: HotLoad) -> None:
        """A new adapter was written: hot-load it now (gate off) or after it passed evaluation (gate on)."""
        self._seen += 1
        self._last = (step, path)
        if not self.gate:
            hot_load(path)
            if self.by_version:
                self._put(TURNS, None, None)
            elif self.evaluator is not None and self._seen % self.every_n_adapters == 0:
                self._put(step, path, None)
            return
        self._put(step, path, hot_load)

    def _put(self, step: int, path: Path | None, hot_load: HotLoad | None) -> None:
        with self._cond:
            while len(self._queue) >= self._max_pending:
                dropped = self._queue.popleft()
                self.counts["skipped"] += 1
                log.info("Eval: skipping adapter v%d (a newer one is waiting)", dropped[0])
            self._queue.append((step, path, hot_load))
            self._queued_steps.add(step)
            self._cond.notify_all()

    # ---- worker ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop and not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                self._evaluate(*item)
            except Exception as e:  # noqa: BLE001 - evaluation never takes training down; said loudly
                self.counts["errors"] += 1
                log.warning("Eval of adapter v%d failed: %r", item[0], e)
                if item[2] is not None:  # gate: an adapter that could not be evaluated is not served
                    log.warning("Gate: adapter v%d not hot-swapped (evaluation failed)", item[0])
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _load_candidate(self, path: Path) -> None:
        load_adapter(self.server_url, self.eval_name, str(path.resolve()), self.api_key, 60.0).raise_for_status()

    def _evaluate(self, step: int, path: Path | None, hot_load: HotLoad | None) -> None:
        if step in (TURNS, FINAL_TURNS):
            for version in self.evaluator.versions_due(final=step == FINAL_TURNS):
                self._report(version, "base" if version == 0 else f"v{version}", self.evaluator.score_version(version))
            return
        if path is None:
            result = self.evaluator.score(self.base_model)
        else:
            self._load_candidate(path)
            result = self.evaluator.score(self.eval_name)
        gate = None
        if path is None:
            self.served_score = result.compliance if self.served_score is None else self.served_score
        elif hot_load is not None:
            gate = self._decide(step, path, result, hot_load)
        self._report(step, path.name if path else "base", result, gate)

    def _report(self, step: int, adapter: str, result: EvalResult, gate: dict[str, Any] | None = None) -> None:
        """Append the record to eval.jsonl, queue its metrics for the training thread, log a line."""
        record: dict[str, Any] = {"step": step, "adapter": adapter, "time": time.time()}
        record.update({k: v for k, v in result.as_dict().items() if k != "model"})
        if gate is not None:
            record["gate"] = gate
        self.counts["evaluated"] += 1
        record["counts"] = dict(self.counts)
        self._append(record)
        metrics = {"eval/compliance": result.compliance, "eval/n": float(result.n), "eval/errors": float(result.errors)}
        metrics.update({f"eval/fail_{k}": v for k, v in result.failures.items()})
        quality = {k: getattr(result, k) for k in ("nll", "fluent", "good", "distinct_2", "distinct_replies", "junk")}
        quality["reward"] = result.reward
        metrics.update({f"eval/{k}": float(v) for k, v in quality.items() if v is not None})
        metrics.update({f"eval/{k}": float(v) for k, v in self.counts.items()})
        with self._cond:
            self._unlogged.append((step, metrics))
        log.info(
            "Eval %s: held-out compliance %.0f%%, good %s, base NLL %s (%d replies, %.0fs)%s",
            record["adapter"],
            100 * result.compliance,
            "-" if result.good is None else f"{100 * result.good:.0f}%",
            "-" if result.nll is None else f"{result.nll:.2f}",
            result.n,
            result.seconds,
            f" gate: {record['gate']['decision']}" if "gate" in record else "",
        )

    def _decide(self, step: int, path: Path, result: EvalResult, hot_load: HotLoad) -> dict[str, Any]:
        served = self.served_score
        if served is None:  # nothing measured yet: measure the base model first
            served = self.served_score = self.evaluator.score(self.base_model).compliance
        decision: dict[str, Any] = {"served": served, "candidate": result.compliance}
        reference = getattr(self.evaluator, "reference_nll", None)
        if self.max_nll_increase is not None and reference is not None and result.nll is not None:
            decision.update(base_nll=reference, candidate_nll=result.nll)
        reasons = []
        if result.compliance < served - self.margin:
            reasons.append(f"compliance {result.compliance:.2f} < served {served:.2f} - margin {self.margin:.2f}")
        if "candidate_nll" in decision and result.nll > reference + self.max_nll_increase:
            reasons.append(
                f"quality collapsed: base NLL {result.nll:.2f} > base model's {reference:.2f} + {self.max_nll_increase}"
            )
        if reasons:
            self.counts["gate_rejected"] += 1
            why = "; ".join(reasons)
            log.warning("Gate: adapter v%d refused (%s): kept on disk at %s, not served", step, why, path)
            return {"decision": "rejected", **decision, "reasons": reasons}
        hot_load(path)
        self.counts["gate_accepted"] += 1
        self.served_score = result.compliance
        return {"decision": "accepted", **decision}

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
        if self.before_final_wait is not None:
            self.before_final_wait()
        if self.by_version:
            self._put(FINAL_TURNS, None, None)
        elif self._last is not None and self._last[0] not in self._queued_steps and self.evaluator is not None:
            self._put(*self._last, None)  # the final adapter is always measured (it is already served)
        self.wait(self.final_timeout_s)
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
                    log.warning("Eval: %d evaluations still pending after %.0fs", len(self._queue), timeout_s)
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread:
            self._thread.join(timeout)
