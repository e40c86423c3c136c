"""Advantage estimators (RL, OPD, combined), plugged by Hydra ``_target_`` from ``conf/method/``."""

from metaclaw.advantages.base import NORMALIZE_MODES, AdvantageEstimator, normalize_rewards
from metaclaw.advantages.combine import CombineAdvantage
from metaclaw.advantages.opd import OPDAdvantage
from metaclaw.advantages.rl import RLAdvantage

__all__ = [
    "NORMALIZE_MODES",
    "AdvantageEstimator",
    "CombineAdvantage",
    "OPDAdvantage",
    "RLAdvantage",
    "normalize_rewards",
]
