"""The publish gate's decisions and the regression watch's rollbacks (`Gate`), made on `LiveEvaluator`'s thread
(`metaclaw.evaluation.live` holds the callback and the reports, `metaclaw.evaluation.worker` the queue).

Every decision is appended to `<run dir>/gate.jsonl` with its evidence and 95% intervals (docs/learning.md
"Gated updates").

One rule on compliance for both paths (`compliance_test`): a candidate is refused only when the evidence says, with
confidence `1 - alpha`, that it is worse than the served adapter by more than `margin`. Where the evidence cannot
tell (few replies, or few effective turns of the judge fallback), it is served, the record says `inconclusive`,
and the regression watch (`publish.gate.rollback`) judges it on the turns it answers.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from metaclaw.agents import DEFAULT_PROFILE
from metaclaw.evaluation.evaluator import EvalResult
from metaclaw.evaluation.stats import newcombe, wilson
from metaclaw.ops import metrics
from metaclaw.wire.client import CallError, Endpoint, load_adapter, models

log = logging.getLogger("metaclaw.evaluation.live")

HotLoad = Callable[[Path], Any]
COUNTS = (
    "evaluated",
    "skipped",
    "skipped_budget",
    "gate_accepted",
    "gate_rejected",
    "errors",
    "gate_held",
    "rolled_back",
    "gate_inconclusive",
)
RULE = "one-sided upper bound of candidate - served (Newcombe's hybrid score interval) < -margin"


def compliance_test(
    candidate: float, candidate_n: float, served: float, served_n: float, margin: float, alpha: float
) -> dict[str, Any]:
    """The gate's rule on compliance, the same with a verifier and without (every input is in the record):

        refuse  when  high < -margin,   (low, high) = stats.newcombe(candidate, candidate_n, served, served_n, z),
                                        z = Phi^-1(1 - alpha)

    i.e. the one-sided (1 - alpha) upper bound of `candidate - served` says the candidate is worse by more than
    `margin`. Each share's uncertainty counts over its n: the verifier's replies, or the judge fallback's effective
    n (its importance weights often leave 1-3 of 32 turns, where a point estimate is close to a coin flip).
    `finding`: `worse` (refused), `inconclusive` (the point estimate is below `served - margin`, the bound is not:
    served, and the regression watch judges it on the turns it answers), or `within_margin`."""
    z = NormalDist().inv_cdf(1 - alpha)
    _, high = newcombe(candidate, candidate_n, served, served_n, z)
    if high < -margin:
        finding = "worse"
    elif candidate < served - margin:
        finding = "inconclusive"
    else:
        finding = "within_margin"
    return {"rule": RULE, "alpha": alpha, "z": z, "margin": margin, "candidate": candidate,
            "candidate_n": candidate_n, "served": served, "served_n": served_n, "difference": candidate - served,
            "upper_bound": high, "finding": finding}  # fmt: skip


def describe(test: dict[str, Any], what: str = "compliance") -> str:
    """The rule's outcome in words (a refusal's reason; an inconclusive acceptance's note)."""
    figures = (f"{what} {test['candidate']:.2f} (n {test['candidate_n']:.1f}) vs served {test['served']:.2f} "
               f"(n {test['served_n']:.1f})")  # fmt: skip
    bound = f"{100 * (1 - test['alpha']):.0f}% upper bound of the difference {test['upper_bound']:+.2f}"
    if test["finding"] == "worse":
        return f"{figures}: worse by more than margin {test['margin']:.2f} ({bound} < {-test['margin']:+.2f})"
    return (f"{figures}: the point estimate is below served - margin {test['margin']:.2f} but the evidence is "
            f"inconclusive ({bound} >= {-test['margin']:+.2f})")  # fmt: skip


@dataclass
class Track:
    """One agent's evaluation: its evaluator, the score of its served adapter, its cadence and counts."""

    agent: str  # the profile whose adapter is evaluated: `default` or an agent id
    evaluator: Any
    served_score: float | None = None
    served_n: float | None = None  # the replies `served_score` was measured on (the rule weighs its uncertainty)
    seen: int = 0
    last: tuple[int, Path, HotLoad] | None = None
    queued: set[int] = field(default_factory=set)
    lora_name: str = "policy"  # the name its adapter is served under
    owner: Callable[[str], bool] | None = None  # which agents' turns are its (None: every agent's)
    report_seen: int | None = None  # the served version the judge fallback's last report looked at
    refused: int = 0  # candidates refused in a row since the last one served (`Gate.rebase`)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    @property
    def prefix(self) -> str:
        """`eval/` for the default agent (the dashboards' names), `agent/<id>/eval/` for the others."""
        return "eval/" if self.agent == DEFAULT_PROFILE else f"agent/{self.agent}/eval/"

    @property
    def by_version(self) -> bool:
        return bool(getattr(self.evaluator, "by_version", False))


UNKNOWN = object()  # what the policy server serves, when it cannot say


@dataclass
class Rebase:
    """`publish.gate.rebase_after`: refused candidates in a row after which the trainer goes back to the served
    adapter (None: never), and the trainer's hook that does it: `to(agent, the served adapter's directory or None
    for the base model)` (`metaclaw.modules.rewind`; None: no trainer in this process to send back)."""

    after: int | None = 2
    to: Callable[[str, Path | None], object] | None = None


class Gate:
    """Accept, refuse or hold a candidate; roll a regressed adapter back. Every decision goes to `gate.jsonl`.

    `tracks` are the agents' tracks (shared with `LiveEvaluator`, which owns them); `metrics` receives the
    `eval/rolled_back` figures for the training thread to log."""

    def __init__(
        self,
        tracks: dict[str, Track],
        metrics: Callable[[int, dict[str, float]], None],
        path: Path,
        base_model: str,
        margin: float = 0.1,
        alpha: float = 0.05,
        max_nll_increase: float | None = 1.0,
        min_turns: int = 8,
        eval_name: str = "metaclaw-eval",
        rebase_after: int | None = 2,
    ) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"publish.gate.alpha must be in (0, 1), got {alpha}")
        if rebase_after is not None and rebase_after < 1:
            raise ValueError(f"publish.gate.rebase_after must be >= 1 or null, got {rebase_after}")
        self.tracks, self.metrics, self.gate_path, self.base_model = tracks, metrics, path, base_model
        self.margin, self.alpha, self.max_nll_increase, self.min_turns = margin, alpha, max_nll_increase, min_turns
        self.eval_name, self.rebase = eval_name, Rebase(rebase_after)
        self.server_url: str | None = None  # the agent's policy server (`LiveEvaluator.bind`)
        self._eval_url: str | None = None  # evaluation's own server (`devices.eval_server`); None: `server_url`
        self.api_key: str | None = None
        self.watch: Any = None  # a `RegressionWatch` (`publish.gate.rollback`); None: no watch
        self.frozen: Callable[[], str | None] | None = None  # a reason not to serve now (a user's rollback)

    @property
    def eval_url(self) -> str | None:
        """Where candidates are loaded and measured: evaluation's own server, else the agent's."""
        return self._eval_url or self.server_url

    def load_candidate(self, path: Path) -> None:
        """Load `path` on the evaluation server under `eval_name` (never the name the agent is served)."""
        if self.eval_url is None:
            raise RuntimeError("no policy server to measure the candidate on: bind one first")
        load_adapter(Endpoint(self.eval_url, self.api_key), self.eval_name, str(path.resolve()), 60.0)

    def check_regressions(self) -> list[dict[str, Any]]:
        """Run the regression watch over every track with a server (its records go to gate.jsonl)."""
        out = []
        if self.watch is None or not self.server_url:
            return out
        for track in list(self.tracks.values()):
            try:
                served = self.watch.served(Endpoint(self.server_url, self.api_key), track.lora_name)
                agent = None if track.agent == DEFAULT_PROFILE else track.agent
                record = self.watch.check(served, track.lora_name, agent, track.owner)
            except Exception as e:  # noqa: BLE001 - the watch never takes training down; said loudly
                log.warning("Regression watch of %s failed: %r", track.agent, e)
                continue
            if record is not None:
                if record["decision"] == "rolled_back":
                    track.counts["rolled_back"] += 1
                    track.served_score = track.served_n = None  # measured again before the next candidate
                self.log(record)
                self.metrics(0, {f"{track.prefix}rolled_back": float(track.counts["rolled_back"])})
                out.append(record)
        return out

    def log(self, record: dict[str, Any]) -> None:
        metrics.count_gate(record)  # metaclaw_gate_decisions, metaclaw_rollbacks
        self.gate_path.parent.mkdir(parents=True, exist_ok=True)
        with self.gate_path.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def decide(self, track: Track, step: int, path: Path, result: EvalResult, hot_load: HotLoad) -> dict[str, Any]:
        """Serve `path` unless `compliance_test` shows it worse than `track`'s served adapter or its replies
        collapsed (base NLL above the base model's own by more than `max_nll_increase`)."""
        if track.served_score is None or track.served_n is None:  # not measured yet: what answers the agent now
            # (the base model at first; after a rollback, the restored adapter: never the base model in its place)
            now = self.served_model(track)[0] if self.server_url else self.base_model
            measured = track.evaluator.score(now)
            track.served_score, track.served_n = measured.compliance, measured.n
        served = track.served_score
        test = compliance_test(result.compliance, result.n, served, track.served_n, self.margin, self.alpha)
        decision: dict[str, Any] = {"served": served, "candidate": result.compliance, "served_n": track.served_n,
                                    "finding": test["finding"], "compliance_test": test}  # fmt: skip
        reference = getattr(track.evaluator, "reference_nll", None)
        nll = result.quality.nll
        if self.max_nll_increase is not None and reference is not None and nll is not None:
            decision.update(base_nll=reference, candidate_nll=nll, max_nll_increase=self.max_nll_increase)
        reasons = []
        if test["finding"] == "worse":
            reasons.append(describe(test))
        if "candidate_nll" in decision and nll > reference + self.max_nll_increase:
            reasons.append(
                f"quality collapsed: base NLL {nll:.2f} > base model's {reference:.2f} + {self.max_nll_increase}"
            )
        decision["candidate_ci"] = list(wilson(result.compliance * result.n, result.n))
        decision["n"] = result.n
        if reasons:
            return self._refuse(track, step, path, decision, reasons)
        out = self._accept(track, step, path, hot_load, decision)
        if out["decision"] == "accepted":
            track.served_score, track.served_n = result.compliance, result.n
        return out

    def _refuse(self, track: Track, step: int, path: Path, decision: dict[str, Any], reasons: list[str],
                outcome: str = "rejected") -> dict[str, Any]:  # fmt: skip
        track.counts["gate_rejected" if outcome == "rejected" else "gate_held"] += 1
        log.warning("Gate: %s adapter v%d %s (%s): kept on disk at %s, not served", track.agent, step,
                    "refused" if outcome == "rejected" else "not measurable yet", "; ".join(reasons), path)  # fmt: skip
        out = {"decision": outcome, **decision, "reasons": reasons}
        if outcome == "rejected":
            track.refused += 1
            rebased = self._rebase(track)
            if rebased is not None:
                out["rebased_to"] = rebased
        self.log({"time": time.time(), "kind": "gate", "agent_id": track.agent, "step": step,
                        "adapter": path.name, "path": str(path), "margin": self.margin, **out})  # fmt: skip
        return out

    def _accept(self, track: Track, step: int, path: Path, hot_load: HotLoad, decision: dict[str, Any]) -> dict:
        frozen = self.frozen() if self.frozen is not None else None
        if frozen:  # the user rolled back: a candidate measured since does not replace their choice
            return self._refuse(track, step, path, decision, [frozen], "held")
        hot_load(path)
        track.counts["gate_accepted"] += 1
        track.refused = 0
        test = decision.get("compliance_test") or {}
        if test.get("finding") == "inconclusive":  # served on evidence that cannot tell: said, and who guards it
            track.counts["gate_inconclusive"] += 1
            guard = "publish.gate.rollback" if self.watch is not None else None
            decision = {**decision, "note": describe(test, "estimated compliance" if "evidence" in decision
                                                     else "compliance"), "guarded_by": guard}  # fmt: skip
            log.warning("Gate: %s adapter v%d served on inconclusive evidence (%s); %s", track.agent, step,
                        decision["note"], "the regression watch (publish.gate.rollback) rolls it back if the user's "
                        "verdicts on its turns drop" if guard else "NOTHING watches it after serving: "
                        "no regression watch (publish.gate.rollback.enabled is false)")  # fmt: skip
        else:  # one INFO line per gate decision (a refusal is a warning in `_refuse`)
            log.info("Gate: %s adapter v%d served (%s)", track.agent, step, f"compliance {test['candidate']:.2f} vs "
                     f"served {test['served']:.2f}: {test['finding']}" if test else "measured")  # fmt: skip
        out = {"decision": "accepted", **decision}
        self.log({"time": time.time(), "kind": "gate", "agent_id": track.agent, "step": step,
                        "adapter": path.name, "path": str(path), "margin": self.margin, **out})  # fmt: skip
        if self.watch is not None and self.server_url:  # remember the version's path: a later rollback's target
            try:
                self.watch.served(Endpoint(self.server_url, self.api_key), track.lora_name)
            except Exception as e:  # noqa: BLE001
                log.warning("Regression watch: cannot read the served adapter: %r", e)
        return out

    def _rebase(self, track: Track) -> str | None:
        """After `rebase_after` refusals in a row, send the trainer back to the adapter the agent is served (its
        weights, fresh optimizer moments): a refused candidate is worse than what is served, and the trainer's
        samples come from the served one, so each step on from the candidate's weights drifts further from the
        behaviour it learns from (the main job's trainer, 128 steps past a served adapter the gate kept, fell from
        87.5% to 18.8% held-out compliance while every reward was +1). Returns the served adapter's path ("base":
        the base model), None when no rebase happens."""
        after, to = self.rebase.after, self.rebase.to
        if to is None or not after or track.refused < after or not self.server_url:
            return None
        card = self._served_card_said(track, "to send the trainer back to it")
        if card is UNKNOWN:
            return None
        root = card.get("root") if card is not None else None
        if card is not None and not root:
            log.warning("Gate: the policy server names no path for %s: the trainer stays on its weights",
                        track.lora_name)  # fmt: skip
            return None
        target = Path(root) if root else None
        to(track.agent, target)
        log.warning("Gate: %d %s candidates refused in a row: the trainer goes back to the served %s with fresh "
                    "optimizer moments (publish.gate.rebase_after)", track.refused, track.agent,
                    target or "base model")  # fmt: skip
        track.refused = 0
        return str(target) if target else "base"

    def _served_card_said(self, track: Track, why: str) -> Any:
        """`_served_card`, or `UNKNOWN` when the server cannot say (a warning naming `why` it was asked)."""
        try:
            return self._served_card(track)
        except (CallError, ValueError) as e:
            log.warning("Gate: cannot read the served adapter of %s %s: %r", track.agent, why, e)
            return UNKNOWN

    def _served_card(self, track: Track) -> dict[str, Any] | None:
        """The policy server's `/v1/models` card of `track`'s adapter (None: the base model answers the agent)."""
        cards = [c for c in models(Endpoint(self.server_url or "", self.api_key)) if c.get("id") == track.lora_name]
        return cards[0] if cards else None

    def served_model(self, track: Track) -> tuple[str, int | None]:
        """The name the agent is answered by now and its adapter version: its adapter when the server lists it
        (version None when the card has none), else the base model (version 0)."""
        card = self._served_card(track)
        if card is None:
            return self.base_model, 0
        version = card.get("adapter_version")
        self._mirror_served(track, card)
        return track.lora_name, int(version) if isinstance(version, int) else None

    def _mirror_served(self, track: Track, card: dict[str, Any]) -> None:
        """With evaluation on a server of its own (`devices.eval_server`), the adapter the agent is served is
        loaded there too, under the same name and version, so the gate measures the served side where it measures
        the candidate (the same settings: one distribution). Asked each decision: a restarted server is refilled."""
        if not self._eval_url or self._eval_url == self.server_url:
            return
        version, root = card.get("adapter_version"), card.get("root")
        evaluation = Endpoint(self._eval_url, self.api_key)
        there = [c for c in models(evaluation) if c.get("id") == track.lora_name]
        if there and there[0].get("adapter_version") == version and there[0].get("root") == root:
            return
        if not root:
            raise RuntimeError(f"the policy server names no path for {track.lora_name!r}: the evaluation server "
                               "cannot load the served adapter")  # fmt: skip
        load_adapter(evaluation, track.lora_name, str(root), 60.0,
                     version=int(version) if isinstance(version, int) else None)  # fmt: skip

    def served_version(self, track: Track) -> int | None:
        """The adapter version the agent is answered by now (0: the base model; None: the server cannot say)."""
        if not self.server_url:
            return None
        card = self._served_card_said(track, "for its version")
        if card is UNKNOWN:
            return None
        if card is None:
            return 0
        version = card.get("adapter_version")
        return int(version) if isinstance(version, int) else None

    def decide_turns(self, track: Track, step: int, path: Path, hot_load: HotLoad) -> dict[str, Any]:
        """The judge fallback's gate: the candidate against the served adapter on the recent held-out turns."""
        served, served_version = self.served_model(track)
        n = len(track.evaluator.recent())
        if n < self.min_turns:
            why = f"{n} judged held-out turns < publish.gate.min_turns {self.min_turns}"
            return self._refuse(track, step, path, {"n": n, "min_turns": self.min_turns}, [why], "held")
        self.load_candidate(path)
        evidence = track.evaluator.compare(self.eval_name, served, served_version=served_version)
        evidence["candidate"]["model"] = path.name
        return self.decide_on_turns(track, step, path, evidence, hot_load)

    def decide_on_turns(
        self, track: Track, step: int, path: Path, evidence: dict[str, Any], hot_load: HotLoad
    ) -> dict[str, Any]:
        """The judge fallback's decision on `compare`'s evidence: the same rule as the verifier's, over each
        estimate's effective n; the quality guard on the same held-out prompts."""
        cand, cur = evidence["candidate"], evidence["served"]
        test = compliance_test(cand["compliance"], cand["n_eff"], cur["compliance"], cur["n_eff"], self.margin,
                               self.alpha)  # fmt: skip
        decision = {"evidence": evidence, "served": cur["compliance"], "candidate": cand["compliance"],
                    "candidate_ci": [cand["ci_low"], cand["ci_high"]], "served_ci": [cur["ci_low"], cur["ci_high"]],
                    "n": evidence["n"], "statistic": "self-normalised importance-sampled share of good verdicts",
                    "finding": test["finding"], "compliance_test": test}  # fmt: skip
        reasons = []
        if test["finding"] == "worse":
            reasons.append(f"{describe(test, 'estimated compliance')} on {evidence['n']} held-out turns")
        nll, ref = evidence.get("candidate_nll"), evidence.get("served_nll")
        if self.max_nll_increase is not None and nll is not None and ref is not None:
            decision.update(base_nll=ref, candidate_nll=nll, max_nll_increase=self.max_nll_increase,
                            quality_turns=evidence.get("quality_turns"))  # fmt: skip
            if nll > ref + self.max_nll_increase:
                reasons.append(f"quality collapsed: base NLL {nll:.2f} of its replies > {ref:.2f} of the replies "
                               f"the user got to the same {evidence.get('quality_turns')} prompts + "
                               f"{self.max_nll_increase}")  # fmt: skip
        if reasons:
            return self._refuse(track, step, path, decision, reasons)
        return self._accept(track, step, path, hot_load, decision)

    def log_skipped(self, agent: str, step: int, path: Path, reason: str) -> None:
        """A gated candidate that is never measured nor served, and why, in gate.jsonl."""
        self.log({"time": time.time(), "kind": "gate", "agent_id": agent, "step": step, "adapter": path.name,
                  "path": str(path), "decision": "skipped", "reasons": [reason]})  # fmt: skip
