"""Live evaluation of published adapters (held-out compliance), the publish gate, and the run's summary/plot."""

from metaclaw.evaluation.evaluator import ComplianceEvaluator, EvalResult
from metaclaw.evaluation.live import LiveEvaluator

__all__ = ["ComplianceEvaluator", "EvalResult", "LiveEvaluator"]
