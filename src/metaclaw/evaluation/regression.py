"""`RegressionWatch`: roll a served adapter back when the user's verdicts on its turns turn negative.

The gate measures a candidate before it is served; this watches it after. For every agent with an adapter of its
own it compares the judged turns (every scored turn, trained or held out; a `/v1/feedback` score is the turn's
reward) of the served adapter version with those of the version served before it:

    rollback when  n_served >= min_turns  and  n_previous >= min_turns
              and  share_served(reward > 0) < share_previous - margin
              and  the one-sided two-proportion z-test gives p < alpha

and then serves the previous version's adapter again through the control plane's rollback (which pauses training
when there is a scheduler), says so in the log, appends the evidence to `<run dir>/gate.jsonl` and counts it
(`eval/rolled_back`). The previous version must be an adapter (a regression against the base model is said
loudly, not undone: there is no adapter to go back to). Versions are the policy server's (`/v1/models`), whose
paths name the step to roll back to.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from metaclaw.evaluation.stats import one_sided_p, wilson
from metaclaw.runfiles.layout import adapter_version
from metaclaw.store import SampleStore
from metaclaw.wire.client import Endpoint, models

log = logging.getLogger(__name__)


class RegressionWatch:
    """Compare the served version's verdicts with the previous version's; roll back on a significant drop.

    Args:
        store: the run's sample store.
        rollback: `(step, agent or None) -> dict`, the control plane's rollback.
        min_turns: judged turns each version needs before it is compared.
        margin: the drop in the share of good verdicts that counts (absolute).
        alpha: significance of the one-sided two-proportion z-test.
    """

    def __init__(
        self,
        store: SampleStore,
        rollback: Callable[[int, str | None], dict[str, Any]],
        min_turns: int = 8,
        margin: float = 0.1,
        alpha: float = 0.05,
    ) -> None:
        self.store, self.rollback = store, rollback
        self.min_turns, self.margin, self.alpha = min_turns, margin, alpha
        self.paths: dict[str, dict[int, str]] = {}  # lora name -> {served version: adapter path}
        self.done: set[tuple[str, int]] = set()  # (lora name, version) already rolled back

    def served(self, server: Endpoint, lora_name: str) -> tuple[int, str] | None:
        """`(version, path)` the policy server serves under `lora_name` now (None: the base model)."""
        for card in models(server):
            if card.get("id") == lora_name and card.get("adapter_version") is not None:
                version, path = int(card["adapter_version"]), str(card.get("root") or "")
                self.paths.setdefault(lora_name, {})[version] = path
                return version, path
        return None

    def verdicts(self, version: int, owner: Callable[[str], bool] | None) -> tuple[int, int]:
        """`(good, judged)`: turns of `version` whose reward is > 0, and all its turns with a reward."""
        db = sqlite3.connect(f"file:{self.store.path}?mode=ro", uri=True, timeout=10)  # counts, not whole samples
        try:
            rows = db.execute("SELECT agent_id, reward FROM samples WHERE adapter_version=? AND reward IS NOT NULL",
                              (version,)).fetchall()  # fmt: skip
        finally:
            db.close()
        rows = [(a, r) for a, r in rows if owner is None or owner(a)]
        return sum(r > 0 for _, r in rows), len(rows)

    def check(
        self, served: tuple[int, str] | None, lora_name: str, agent: str | None,
        owner: Callable[[str], bool] | None = None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """The decision record when the served version regressed (after rolling back), else None."""
        if served is None or (lora_name, served[0]) in self.done:
            return None
        version = served[0]
        earlier = sorted((v for v in self.paths.get(lora_name, {}) if v < version), reverse=True)
        k1, n1 = self.verdicts(version, owner)
        if n1 < self.min_turns:
            return None
        previous = next((v for v in earlier if self.verdicts(v, owner)[1] >= self.min_turns), None)
        k2, n2 = self.verdicts(previous, owner) if previous is not None else self.verdicts(0, owner)
        if n2 < self.min_turns:
            return None
        p1, p2, p = k1 / n1, k2 / n2, one_sided_p(k1, n1, k2, n2)
        if not (p1 < p2 - self.margin and p < self.alpha):
            return None
        self.done.add((lora_name, version))
        record: dict[str, Any] = {
            "time": time.time(), "kind": "regression", "agent_id": agent or "default", "lora_name": lora_name,
            "served": {"version": version, "path": served[1], "good": k1, "n": n1, "share": p1,
                       "ci": list(wilson(k1, n1))},
            "previous": {"version": previous or 0, "path": self.paths.get(lora_name, {}).get(previous or 0),
                         "good": k2, "n": n2, "share": p2, "ci": list(wilson(k2, n2))},
            "statistic": "one-sided two-proportion z-test of good-verdict shares", "p_value": p,
            "alpha": self.alpha, "margin": self.margin, "min_turns": self.min_turns,
        }  # fmt: skip
        path = record["previous"]["path"]
        step = adapter_version(path) if path else None  # the version the folder records (runfiles.layout)
        if previous is None or step is None:
            record["decision"] = "regression_not_undone"
            log.warning(
                "Regression: %s v%d good verdicts %.0f%% (n=%d) vs the base model's %.0f%% (n=%d), p=%.3g; no "
                "earlier adapter to roll back to", lora_name, version, 100 * p1, n1, 100 * p2, n2, p,
            )  # fmt: skip
            return record
        try:
            answer = self.rollback(step, agent)
        except Exception as e:  # noqa: BLE001 - said loudly and recorded; the watch goes on
            record.update(decision="rollback_failed", error=str(e))
            log.warning("Regression: rolling %s back to %s failed: %s", lora_name, path, e)
            return record
        record.update(decision="rolled_back", rollback=answer)
        log.warning("Regression: %s v%d good verdicts %.0f%% (n=%d) vs v%d's %.0f%% (n=%d), p=%.3g < %.2g: rolled "
                    "back to %s", lora_name, version, 100 * p1, n1, previous, 100 * p2, n2, p, self.alpha,
                    path)  # fmt: skip
        return record
