"""What evaluation costs: Wilson intervals on every point, the bounded base-reply cache, the time budget."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from metaclaw.evaluation import LiveEvaluator
from metaclaw.evaluation.cache import BaselineCache, model_fingerprint
from metaclaw.evaluation.evaluator import EvalResult, wilson_interval


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (32, 32, 0.8928, 1.0), (9, 32, 0.1556, 0.4537)],
)
def test_wilson_interval_matches_hand_computed_values(k, n, low, high):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_the_cache_keeps_its_newest_entries_and_the_fingerprint_follows_the_files(tmp_path):
    cache = BaselineCache(tmp_path / "c", max_entries=2)
    keys = [cache.key({"i": i}) for i in range(3)]
    assert len(set(keys)) == 3
    for i, key in enumerate(keys):
        cache.put(key, [{"text": str(i), "nll": None}], {"i": i})
    assert cache.get(keys[0]) is None and cache.get(keys[2]) == [{"text": "2", "nll": None}]
    assert len(list((tmp_path / "c").glob("*.json"))) == 2
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.safetensors").write_bytes(b"a" * 100)
    before = model_fingerprint(model)
    (model / "w.safetensors").write_bytes(b"b" * 100)  # same size, other content
    assert model_fingerprint(model) != before


class CostlyEvaluator:
    """Each evaluation reports that it took `seconds` (no clock involved: the budget reads the result)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.scored = seconds, []
        self.done = threading.Event()

    def score(self, model: str) -> EvalResult:
        self.scored.append(model)
        return EvalResult(model, 0.5, n=4, seconds=self.seconds)


def test_evaluations_during_training_stay_within_the_budget_but_the_final_adapter_is_measured(tmp_path):
    costly = CostlyEvaluator(seconds=1000.0)  # far above 15% of the time since start
    live = LiveEvaluator(costly, tmp_path, base_model="base", server_url="http://unused", max_share=0.15)
    live.gatekeeper.load_candidate = lambda path: None
    live.start()
    try:
        assert live.wait(30)  # the base model: always measured
        live.submit(1, tmp_path / "step-000001", lambda path: None)
        assert live.wait(30)
        assert live.counts["skipped_budget"] == 1 and [r["adapter"] for r in live.results] == ["base"]
        live.on_train_end(SimpleNamespace(loggers=[]), None)  # the final adapter is measured whatever it costs
    finally:
        live.stop()
    assert [r["adapter"] for r in live.results] == ["base", "step-000001"]
    assert live.results[-1]["counts"]["skipped_budget"] == 1


def test_without_a_budget_every_due_adapter_is_measured(tmp_path):
    costly = CostlyEvaluator(seconds=1000.0)
    live = LiveEvaluator(costly, tmp_path, base_model="base", server_url="http://unused", max_share=None)
    live.gatekeeper.load_candidate = lambda path: None
    live.start()
    try:
        live.submit(1, tmp_path / "step-000001", lambda path: None)
        assert live.wait(30)
    finally:
        live.stop()
    assert [r["adapter"] for r in live.results] == ["base", "step-000001"]


class UncachedEvaluator(CostlyEvaluator):
    def has_cached(self, model: str) -> bool:
        return False


def test_an_uncached_base_model_is_measured_after_training_beside_the_final_adapter(tmp_path):
    """First run on a machine: the first samples do not wait behind the base model's evaluation."""
    ev = UncachedEvaluator(seconds=1.0)
    live = LiveEvaluator(ev, tmp_path, base_model="base", server_url="http://unused", baseline="auto", max_share=0.15)
    live.gatekeeper.load_candidate = lambda path: None
    live.start()
    try:
        live.submit(1, tmp_path / "step-000001", lambda path: None)
        assert live.wait(30)
        assert ev.scored == [] and live.counts["skipped_budget"] == 1  # nothing measured during training
        live.on_train_end(SimpleNamespace(loggers=[]), None)
    finally:
        live.stop()
    assert [r["adapter"] for r in live.results] == ["base", "step-000001"]


class CachedBaseEvaluator(CostlyEvaluator):
    """The base model's replies come from the cache (free); every adapter costs `seconds`."""

    def score(self, model: str) -> EvalResult:
        result = super().score(model)
        result.cached = model == "base"
        return result


def test_with_the_gate_a_candidate_over_the_budget_is_neither_measured_nor_served(tmp_path):
    """The gate's measurements are evaluations too: within `max_share` of the run's time. A candidate over the
    budget stays on disk unserved (a `skipped` record says why); the final adapter is still measured and gated."""
    costly = CachedBaseEvaluator(seconds=1000.0)
    served: list[str] = []
    live = LiveEvaluator(costly, tmp_path, base_model="base", server_url=None, max_share=0.15, gate=True,
                         max_nll_increase=None)  # fmt: skip
    live.gatekeeper.load_candidate = lambda path: None
    live.start()
    try:
        assert live.wait(30)
        live.submit(1, tmp_path / "step-000001", lambda path: served.append(path.name))  # the first: measured
        assert live.wait(30)
        live.submit(2, tmp_path / "step-000002", lambda path: served.append(path.name))  # 1000 s spent: skipped
        assert live.wait(30)
        assert costly.scored == ["base", "metaclaw-eval"] and served == ["step-000001"]
        assert live.counts["skipped_budget"] == 1
        live.on_train_end(SimpleNamespace(loggers=[]), None)
    finally:
        live.stop()
    assert served == ["step-000001", "step-000002"]  # the final adapter: measured and gated whatever it costs
    records = [json.loads(line) for line in (tmp_path / "gate.jsonl").read_text().splitlines()]
    assert [(r["step"], r["decision"]) for r in records] == [(1, "accepted"), (2, "skipped"), (2, "accepted")]
    assert "eval.max_share" in records[1]["reasons"][0]
