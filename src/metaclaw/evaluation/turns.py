"""`HeldoutTurnsEvaluator`: live evaluation without a verifier (`rollout=proxy|replay`), from the judge.

A share of the agent's real sessions is held out of training (`eval.judge_fallback.heldout_share`; the scoring
worker picks them by a stable hash of the session id, scores them with the configured judge like every turn,
and settles them as `dropped` with reason `heldout`: never trained on). Each turn records the adapter version
that served it, so the held-out turns of one version are a sample of what the user got from that adapter and
how the judge read the user's reaction. For every version that has been replaced (and the last one at the end
of training) this reports the share of held-out turns the judge scored > 0 (`compliance`), the mean reward, and
the same quality figures as the verifier path (the base model's NLL per token of the replies, good, junk).

Unlike the verifier path it cannot score a candidate before it is served (the reaction is the user's), so it
cannot gate; `publish.gate` still needs a verifier.

Many agents (docs/agents.md): one evaluator per adapter, each reading only the held-out turns of the agents that
adapter serves (`owner`, by the sample's `agent_id`); the versions are that adapter's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from metaclaw.evaluation.evaluator import EvalResult
from metaclaw.evaluation.quality import base_nll, fluency, text_stats
from metaclaw.store import Sample, SampleStore


class HeldoutTurnsEvaluator:
    """Judge rewards and quality of the held-out turns, per served adapter version.

    Args:
        store: the run's sample store.
        server_url / api_key: the policy server (the base model scores the replies' NLL).
        base_model: the base model's name (None: no NLL, no `good`).
        max_turns: the most recent held-out turns per version that are scored.
        min_turns: a version with fewer scored held-out turns is reported only at the end of training.
        nll_margin: as `ComplianceEvaluator`: fluent = NLL within this of the base version's mean.
        keep_examples: replies kept in the result.
        owner: which agents' turns count (`agent_id` -> bool); None: every agent's.
    """

    by_version = True

    def __init__(
        self,
        store: SampleStore,
        server_url: str,
        base_model: str | None,
        api_key: str | None = None,
        max_turns: int = 32,
        min_turns: int = 4,
        nll_margin: float = 1.0,
        keep_examples: int = 3,
        timeout_s: float = 120.0,
        owner: Callable[[str], bool] | None = None,
    ) -> None:
        self.store, self.server_url, self.api_key, self.base_model = store, server_url.rstrip("/"), api_key, base_model
        self.max_turns, self.min_turns, self.nll_margin = max_turns, min_turns, nll_margin
        self.keep_examples, self.timeout_s, self.owner = keep_examples, timeout_s, owner
        self.reported: set[int] = set()
        self.reference_nll: float | None = None  # the base model's (version 0) replies: the fluency reference

    def _heldout(self, version: int | None = None) -> list[Sample]:
        where = {} if version is None else {"adapter_version": version}
        rows = self.store.select(status="dropped", **where)
        return [
            s
            for s in rows
            if (s.meta or {}).get("dropped") == "heldout"
            and s.reward is not None
            and (self.owner is None or self.owner(s.agent_id))
        ]

    def versions_due(self, final: bool = False) -> list[int]:
        """Versions not reported yet: those a newer version replaced (with `min_turns` turns), or all at the end."""
        counts: dict[int, int] = {}
        for s in self._heldout():
            counts[s.adapter_version] = counts.get(s.adapter_version, 0) + 1
        newest = max(counts, default=-1)
        due = [v for v in sorted(counts) if v not in self.reported]
        return due if final else [v for v in due if v < newest and counts[v] >= self.min_turns]

    def score_version(self, version: int) -> EvalResult:
        """The judge's verdicts and the replies' quality for the held-out turns `version` served."""
        t0 = time.monotonic()
        turns = sorted(self._heldout(version), key=lambda s: s.id)[-self.max_turns :]
        if not turns:
            raise RuntimeError(f"eval: no held-out turns judged for adapter version {version}")
        replies = [s.response_text or "" for s in turns]
        n = len(turns)
        result = EvalResult(
            model="base" if version == 0 else f"v{version}",
            compliance=sum(s.reward > 0 for s in turns) / n,
            n=n,
            failures={"judge": sum(s.reward <= 0 for s in turns) / n},
            examples=replies[: self.keep_examples],
        )
        result.reward = sum(s.reward for s in turns) / n
        stats = text_stats(replies)
        result.distinct_2, result.distinct_replies, result.junk = stats.distinct_2, stats.distinct_replies, stats.junk
        if self.base_model:
            nlls = [
                base_nll(self.server_url, self.base_model, s.prompt_ids, s.response_ids, self.api_key, self.timeout_s)
                for s in turns
            ]
            compliant = [s.reward > 0 for s in turns]
            if version == 0 and self.reference_nll is None:
                self.reference_nll = fluency(nlls, compliant, None, 0.0)["nll"]
            for key, value in fluency(nlls, compliant, self.reference_nll, self.nll_margin).items():
                setattr(result, key, value)
        result.seconds = time.monotonic() - t0
        self.reported.add(version)
        return result
