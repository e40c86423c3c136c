"""The statistics the publish gate and the regression watch state with every decision.

- `wilson`: the Wilson score interval of a share (k good of n), the interval every curve point and gate record
  carries; with importance weights, `n` is the effective sample size.
- `snips`: the self-normalised importance-sampling estimate of a share under another policy, from turns sampled by
  the served one (the off-policy estimate of a candidate's held-out compliance, `metaclaw.evaluation.turns`).
- `one_sided_p`: the two-proportion z-test's one-sided p-value that share 1 is below share 2 (the regression watch).
- `newcombe`: the interval of the difference of two shares from their Wilson intervals (the publish gate's rule,
  `metaclaw.evaluation.gate.compliance_test`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959964


def wilson(k: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of the share `k / n` (`(0, 1)` when `n` is 0); `k` and `n` may be fractional."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(k / n, 0.0), 1.0)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def snips(log_ratios: Sequence[float], values: Sequence[float], clip: float = 5.0) -> tuple[float, float]:
    """`(estimate, effective n)` of the mean of `values` under the target policy, from samples of the behaviour
    policy with per-sample `log_ratios` (target - behaviour logprob of the whole reply), each clipped to
    `[-clip, clip]` so one reply cannot carry the whole estimate. Effective n = (sum w)^2 / sum w^2."""
    if not values:
        return 0.0, 0.0
    top = max(min(max(x, -clip), clip) for x in log_ratios)
    weights = [math.exp(min(max(x, -clip), clip) - top) for x in log_ratios]  # shifted: no overflow
    total = sum(weights)
    estimate = sum(w * v for w, v in zip(weights, values, strict=True)) / total
    return estimate, total * total / sum(w * w for w in weights)


def one_sided_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """p-value of the one-sided two-proportion z-test that share `k1/n1` is below `k2/n2` (pooled variance)."""
    if n1 <= 0 or n2 <= 0:
        return 1.0
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 0.0 if k1 / n1 < k2 / n2 else 1.0
    z = (k1 / n1 - k2 / n2) / se
    return 0.5 * math.erfc(-z / math.sqrt(2))  # P(Z <= z)


def newcombe(p1: float, n1: float, p2: float, n2: float, z: float = Z95) -> tuple[float, float]:
    """Interval of the difference `p1 - p2` of two independent shares over `n1` and `n2` samples (fractional: effective
    sizes): Newcombe's hybrid score interval (Newcombe 1998, "Interval estimation for the difference between
    independent proportions", method 10), each share's Wilson interval at `z` combined. Unlike the Wald interval it
    stays honest at shares of 0 or 1 and at small n; with an `n` of 0 it spans every difference that share allows."""
    p1, p2 = min(max(p1, 0.0), 1.0), min(max(p2, 0.0), 1.0)
    l1, u1 = wilson(p1 * n1, n1, z)
    l2, u2 = wilson(p2 * n2, n2, z)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
