"""Shared pieces of every policy loss: the output type, the plug-point Protocol and small tensor helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class LossOutput:
    """What every loss returns.

    Attributes:
        loss: Scalar to call ``backward()`` on.
        metrics: Detached scalars for logging (unprefixed; the caller namespaces them, e.g. ``loss/clip_frac``).
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


class PolicyLoss(Protocol):
    """One signature for every policy loss (verl-style); all tensors are ``[B, T]`` over target positions."""

    def __call__(self, logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        """Compute the loss.

        Args:
            logprobs: Current policy log π(a_t) of the sampled tokens, with grad.
            behaviour_logprobs: Log-probs the sampler (behaviour policy) gave the same tokens, no grad.
            advantages: Per-token advantages A_t.
            mask: 1.0 on trained response tokens, 0.0 elsewhere.
        """
        ...


def check_same_shape(**tensors: Tensor) -> None:
    """Raise ValueError naming the tensors whose shapes differ from the first one."""
    (first_name, first), *rest = tensors.items()
    bad = [f"{name}{tuple(t.shape)}" for name, t in rest if t.shape != first.shape]
    if bad:
        raise ValueError(f"shape mismatch: {first_name}{tuple(first.shape)} vs {', '.join(bad)}")
    if first.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got {first_name}{tuple(first.shape)}")


def importance_ratio(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """ρ = exp(log π − log π_behaviour), set to 1 off the mask so padding can never overflow or leak NaN."""
    log_ratio = torch.where(mask > 0, logprobs - behaviour_logprobs.detach(), torch.zeros_like(logprobs))
    return torch.exp(log_ratio)


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` on the mask, exact zeros elsewhere (``where``, not ``*``, so NaN/inf padding stays out)."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


@torch.no_grad()
def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``values`` over masked tokens (0 when the mask is empty)."""
    return masked(values, mask).sum() / (mask > 0).sum().clamp(min=1)


@torch.no_grad()
def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Detached max of ``values`` over masked tokens (0 when the mask is empty)."""
    if not bool((mask > 0).any()):
        return values.new_zeros(())
    return torch.where(mask > 0, values, torch.full_like(values, float("-inf"))).amax()


def ratio_metrics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mean, min and max of the importance ratio over masked tokens: the gap between the behaviour that sampled
    (a quantised engine, an adapter some versions behind) and the trainer's fp32 recomputation."""
    return {"ratio_mean": masked_mean(ratio, mask), "ratio_min": -masked_max(-ratio, mask),
            "ratio_max": masked_max(ratio, mask)}  # fmt: skip
