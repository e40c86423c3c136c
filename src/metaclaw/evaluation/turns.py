"""`HeldoutTurnsEvaluator`: live evaluation without a verifier (`rollout=proxy|replay`), from the judge.

A share of the agent's real sessions is held out of training (`eval.judge_fallback.heldout_share`; the scoring
worker picks them by a stable hash of the session id, scores them with the configured judge like every turn,
and settles them as `dropped` with reason `heldout`: never trained on). Each turn records the adapter version
that served it, so the held-out turns of one version are a sample of what the user got from that adapter and
how the judge read the user's reaction. For every version that has been replaced (and the last one at the end
of training) this reports the share of held-out turns the judge scored > 0 (`compliance`), the mean reward, and
the same quality figures as the verifier path (the base model's NLL per token of the replies, good, junk).

The publish gate without a verifier (`compare`): a candidate cannot be shown to the user before it is served, but
the held-out turns already say which replies the user took well. Their judged verdicts, reweighted by how much
more (or less) likely the candidate is to write each reply than the served adapter, estimate the candidate's
compliance on the same turns (self-normalised importance sampling, `metaclaw.evaluation.stats.snips`, both
logprobs from the policy server's teacher-logprob route). An adapter that learned to write what users corrected
(trained on inverted rewards) puts its weight on the corrected turns and is refused. The quality guard samples the
candidate's own replies to the newest held-out prompts and scores them under the base model (NLL per token) against
the base NLL of the replies the user actually got to the same prompts.

Many agents (docs/agents.md): one evaluator per adapter, each reading only the held-out turns of the agents that
adapter serves (`owner`, by the sample's `agent_id`); the versions are that adapter's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from metaclaw.evaluation.evaluator import EvalResult
from metaclaw.evaluation.quality import base_nll, fluency, text_stats
from metaclaw.evaluation.stats import snips, wilson
from metaclaw.store import Sample, SampleStore
from metaclaw.wire.client import Endpoint, chat, teacher_logprobs


@dataclass(frozen=True)
class TurnCounts:
    """How many held-out turns count (`HeldoutTurnsEvaluator`'s arguments of the same names)."""

    max_turns: int = 32  # the most recent held-out turns per version that are scored
    min_turns: int = 4  # a version with fewer is reported only at the end of training
    quality_turns: int = 8  # the newest held-out turns whose prompts the candidate answers (quality guard)
    keep_examples: int = 3  # replies kept in the result


@dataclass
class TurnMemo:
    """What the gate asked the server once: a turn's reply under a fixed model does not change."""

    got_nll: dict[int | None, float | None] = field(default_factory=dict)  # sample id -> base NLL of the user's reply
    served_lp: dict[tuple[int, int | None], float] = field(default_factory=dict)  # (version, sample id) -> logprob


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
        concurrency: the gate's requests in flight (the server batches them; one at a time, each would wait
            behind the user's generations: a gate took over 20 minutes on 2 busy cores).
        quality_turns: the newest held-out turns whose prompts the candidate answers for the quality guard.
    """

    by_version = True
    quality_max_tokens = 64  # the most tokens of the candidate's answer to a quality prompt

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
        concurrency: int = 4,
        quality_turns: int = 8,
    ) -> None:
        self.store, self.server_url, self.api_key, self.base_model = store, server_url.rstrip("/"), api_key, base_model
        self.counts = TurnCounts(max_turns, min_turns, max(0, int(quality_turns)), keep_examples)
        self.nll_margin, self.timeout_s, self.owner = nll_margin, timeout_s, owner
        self.concurrency = max(1, int(concurrency))
        self.on_phase: Callable[[str], None] | None = None  # called as each phase of `compare` starts (benches)
        self.reported: set[int] = set()
        self.memo = TurnMemo()  # a turn's reply under a fixed model does not change: the gate asks for each once
        self.reference_nll: float | None = None  # the base model's (version 0) replies: the fluency reference

    @property
    def endpoint(self) -> Endpoint:
        """The policy server asked."""
        return Endpoint(self.server_url, self.api_key)

    def rebind(self, server_url: str) -> None:
        """Ask `server_url` (a policy server's base URL) from now on."""
        self.server_url = server_url.rstrip("/")

    def _heldout(self, version: int | None = None) -> list[Sample]:
        where = {} if version is None else {"adapter_version": version}
        rows = self.store.select(status="dropped", **where)
        return [
            s
            for s in rows
            if s.meta.dropped == "heldout" and s.reward is not None and (self.owner is None or self.owner(s.agent_id))
        ]

    def versions_due(self, final: bool = False, served: int | None = None) -> list[int]:
        """Versions not reported yet: those a newer version replaced (with `min_turns` turns), or all at the end.

        A version is replaced once a newer one has held-out turns or is served now (`served`, the policy server's
        version of the adapter; 0: the base model): the base model's point comes with the first adapter served,
        not with the first held-out session that adapter answers."""
        counts: dict[int, int] = {}
        for s in self._heldout():
            counts[s.adapter_version] = counts.get(s.adapter_version, 0) + 1
        newest = max(max(counts, default=-1), -1 if served is None else served)
        due = [v for v in sorted(counts) if v not in self.reported]
        return due if final else [v for v in due if v < newest and counts[v] >= self.counts.min_turns]

    def score_version(self, version: int) -> EvalResult:
        """The judge's verdicts and the replies' quality for the held-out turns `version` served."""
        t0 = time.monotonic()
        turns = sorted(self._heldout(version), key=lambda s: s.id)[-self.counts.max_turns :]
        if not turns:
            raise RuntimeError(f"eval: no held-out turns judged for adapter version {version}")
        replies = [s.text.response_text or "" for s in turns]
        n = len(turns)
        result = EvalResult(
            model="base" if version == 0 else f"v{version}",
            compliance=sum(s.reward > 0 for s in turns) / n,
            n=n,
            failures={"judge": sum(s.reward <= 0 for s in turns) / n},
            examples=replies[: self.counts.keep_examples],
        )
        result.reward = sum(s.reward for s in turns) / n
        stats = text_stats(replies)
        quality = result.quality
        quality.distinct_2, quality.distinct_replies = stats.distinct_2, stats.distinct_replies
        quality.junk = stats.junk
        if self.base_model:
            nlls = [
                base_nll(self.endpoint, self.base_model, s.prompt_ids, s.response_ids, self.timeout_s) for s in turns
            ]
            compliant = [s.reward > 0 for s in turns]
            if version == 0 and self.reference_nll is None:
                self.reference_nll = fluency(nlls, compliant, None, 0.0)["nll"]
            for key, value in fluency(nlls, compliant, self.reference_nll, self.nll_margin).items():
                setattr(result.quality, key, value)
        result.seconds = time.monotonic() - t0
        self.reported.add(version)
        return result

    # ---- the publish gate without a verifier ----------------------------------------------------------------
    def recent(self) -> list[Sample]:
        """The latest `max_turns` judged held-out turns (every version): the gate's evidence."""
        return sorted(self._heldout(), key=lambda s: s.id)[-self.counts.max_turns :]

    def _logprob(self, model: str, s: Sample) -> float:
        lps = teacher_logprobs(self.endpoint, model, s.prompt_ids, s.response_ids, self.timeout_s,
                               temperature=s.temperature)  # fmt: skip
        return float(sum(lps))

    def _answer(self, model: str, s: Sample, max_tokens: int) -> tuple[list[int], list[int]] | None:
        """`model`'s own reply to `s`'s prompt: (prompt ids, reply ids); None where no messages were kept."""
        if not s.text.messages or not self.base_model:
            return None
        body = {"model": model, "messages": s.text.messages, "max_tokens": max_tokens, "temperature": s.temperature,
                "return_token_ids": True}  # fmt: skip
        if s.meta.chat_template_kwargs:  # rendered as the got reply's prompt was (Qwen3: the same thinking switch)
            body["chat_template_kwargs"] = dict(s.meta.chat_template_kwargs)
        data = chat(self.endpoint, body, self.timeout_s)
        return data.get("prompt_token_ids") or s.prompt_ids, data["choices"][0].get("token_ids") or []

    def _nll(self, answer: tuple[list[int], list[int]] | None) -> float | None:
        if answer is None or not self.base_model:
            return None
        return base_nll(self.endpoint, self.base_model, answer[0], answer[1], self.timeout_s)

    def compare(
        self, candidate: str, served: str, clip: float = 5.0, served_version: int | None = None
    ) -> dict[str, object]:
        """Evidence for the gate: the estimated compliance of `candidate` and of `served` (server model names) on
        the recent held-out turns, each with a Wilson interval over its effective sample size, and the quality
        guard (the base NLL of the candidate's own replies to the newest `quality_turns` prompts vs that of the
        replies the user got to the same prompts). `n` is the turn count.

        `served_version` (the adapter version `served` answers with; 0: the base model): a turn that version
        served needs no request, its log ratio is 0 (behaviour and scoring are one distribution: the ratio-is-1
        tests), and the served version's logprobs and the got replies' NLLs are asked once per turn across gates.
        The requests go `concurrency` at a time, shortest first (the policy server batches the ones in flight);
        `seconds` holds each phase's wall seconds (served and candidate logprobs, the got replies' NLL, the
        candidate's quality sampling and its NLL: `bench/perf/gate_latency.py` adds the server's CPU seconds)."""
        turns = self.recent()
        good = [1.0 if s.reward > 0 else 0.0 for s in turns]
        out: dict[str, object] = {"n": len(turns), "observed": sum(good) / len(turns) if turns else None}
        if not turns:
            return out
        behaviour = [float(sum(s.behaviour_logprobs)) for s in turns]

        def served_lp(s: Sample) -> float | None:  # None: the turn's own behaviour logprob
            if served_version is None:
                return self._logprob(served, s)
            if s.adapter_version == served_version:
                return None
            key = (served_version, s.id)
            if key not in self.memo.served_lp:
                self.memo.served_lp[key] = self._logprob(served, s)
            return self.memo.served_lp[key]

        def got_nll(s: Sample) -> float | None:
            if s.id not in self.memo.got_nll:
                self.memo.got_nll[s.id] = base_nll(self.endpoint, self.base_model, s.prompt_ids, s.response_ids,
                                                   self.timeout_s)  # fmt: skip
            return self.memo.got_nll[s.id]

        seconds: dict[str, float] = {}
        out["seconds"] = seconds

        def timed(phase: str, fn: Callable[[Sample], object], items: list[Sample]) -> list:
            """`fn` over `items`, `concurrency` at a time, sent shortest first: the requests in flight together
            have similar lengths, so the server's batched forward pads little."""
            if self.on_phase is not None:
                self.on_phase(phase)
            t0 = time.monotonic()
            order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_ids) + len(items[i].response_ids))
            results: list = [None] * len(items)
            for i, result in zip(order, pool.map(fn, [items[i] for i in order]), strict=True):
                results[i] = result
            seconds[phase] = round(time.monotonic() - t0, 3)
            return results

        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="gate") as pool:
            served_lps = timed("served_logprobs", served_lp, turns)
            candidate_lps = timed("candidate_logprobs", lambda s: self._logprob(candidate, s), turns)
            for name, model, lps in (("served", served, served_lps), ("candidate", candidate, candidate_lps)):
                ratios = [0.0 if lp is None else lp - b for lp, b in zip(lps, behaviour, strict=True)]
                estimate, n_eff = snips(ratios, good, clip)
                low, high = wilson(estimate * n_eff, n_eff)
                out[name] = {"model": model, "compliance": estimate, "n_eff": n_eff, "ci_low": low, "ci_high": high}
            if self.base_model and self.counts.quality_turns:  # the same prompts both sides
                asked = turns[-self.counts.quality_turns :]
                got = timed("got_nll", got_nll, asked)
                answers = timed("quality_sampling", lambda s: self._answer(candidate, s, self.quality_tokens(s)), asked)
                answer_of = {id(s): a for s, a in zip(asked, answers, strict=True)}
                own = timed("quality_nll", lambda s: self._nll(answer_of[id(s)]), asked)
                pairs = [(g, o) for g, o in zip(got, own, strict=True) if g is not None and o is not None]
                if pairs:
                    out["served_nll"] = sum(g for g, _ in pairs) / len(pairs)
                    out["candidate_nll"] = sum(o for _, o in pairs) / len(pairs)
                    out["quality_turns"] = len(pairs)
        if self.on_phase is not None:
            self.on_phase("done")
        return out

    def quality_tokens(self, s: Sample) -> int:
        """The candidate's budget on `s`'s prompt: the got reply's length, at most `quality_max_tokens`."""
        return max(1, min(len(s.response_ids), self.quality_max_tokens))
