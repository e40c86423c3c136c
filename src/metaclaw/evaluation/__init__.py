"""Live evaluation of published adapters (held-out compliance), the publish gate, and the run's summary/plot.

The names below load on first use: `metaclaw status` and the dashboard of a finished run read `stats` and the run's
files without importing torch and Lightning (seconds on a small machine).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from metaclaw.evaluation.evaluator import ComplianceEvaluator, EvalResult
    from metaclaw.evaluation.live import LiveEvaluator

__all__ = ["ComplianceEvaluator", "EvalResult", "LiveEvaluator"]
_HOMES = {"ComplianceEvaluator": "evaluator", "EvalResult": "evaluator", "LiveEvaluator": "live"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(f"metaclaw.evaluation.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'metaclaw.evaluation' has no attribute {name!r}")
