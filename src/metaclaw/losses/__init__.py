"""Policy losses (one per file, plugged by Hydra ``_target_``) and their shared aggregation."""

from metaclaw.losses.aggregation import AGGREGATION_MODES, aggregate
from metaclaw.losses.base import LossOutput, PolicyLoss
from metaclaw.losses.cispo import CISPOLoss
from metaclaw.losses.cross_entropy import CrossEntropyLoss
from metaclaw.losses.importance_sampling import ImportanceSamplingLoss
from metaclaw.losses.kl import KL_ESTIMATORS, KLPenalty, kl_per_token
from metaclaw.losses.ppo import PPOLoss

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "CISPOLoss",
    "CrossEntropyLoss",
    "ImportanceSamplingLoss",
    "KLPenalty",
    "LossOutput",
    "PPOLoss",
    "PolicyLoss",
    "aggregate",
    "kl_per_token",
]
