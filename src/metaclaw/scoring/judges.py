"""Judges: score a turn from its next state (PRM reward) and extract a hindsight hint (OPD).

`RuleJudge` is deterministic (regex patterns from config, `judge=rule`). The default for models too small to
judge (`model=tiny`, SmolLM2) is the reaction classifier (`scoring.reactions.ReactionJudge`, `judge=reactions`).
`LLMJudge` asks any OpenAI-compatible endpoint (by default our policy server's base model) with m concurrent
votes, `\\boxed{1|-1|0}` parsed, majority, tie → 0 (seed 002).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from omegaconf import DictConfig

from metaclaw.messages import answer_and_reasoning, content_text
from metaclaw.store import Sample
from metaclaw.thinking import Thinking
from metaclaw.wire.client import CallError, Endpoint, chat

log = logging.getLogger(__name__)

BOXED = re.compile(r"\\boxed\{\s*([+-]?[01])\s*\}")
HINT = re.compile(r"<hint>(.*?)</hint>", re.S)


@dataclass
class Verdict:
    """A judge's reward for one turn and how it got there (votes, errors) for the sample's meta."""

    reward: float
    detail: dict[str, Any] = field(default_factory=dict)


class Judge(Protocol):
    """What the scoring worker needs from a judge; both calls may raise or hang (the worker bounds them)."""

    async def reward(self, sample: Sample) -> Verdict: ...

    async def hint(self, sample: Sample) -> str | None: ...


def majority(votes: list[int | None]) -> float:
    """Majority of the valid votes; a tie for the top count, or no valid vote, gives 0."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0.0
    return float(counts[0][0])


def paragraphs(text: str) -> list[str]:
    """`text` split on blank lines (non-empty parts, in order)."""
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def parse_boxed(text: str) -> int | None:
    """The last `\\boxed{1|-1|0}` in a judge's reply, or None."""
    found = BOXED.findall(text or "")
    return int(found[-1]) if found else None


class RuleJudge:
    """Deterministic judge: regexes over the next state.

    Args:
        negative: next state matching this (case-insensitive) → -1 (checked first).
        positive: next state matching this → +1; anything else → 0.
        no_next_state_reward: reward of a turn that has no next state (the last turn of a session).
        hint_min_chars: a hint shorter than this is no hint.
    """

    def __init__(
        self,
        negative: str = r"wrong|not what|doesn't work|does not work|incorrect|error|failed",
        positive: str = r"thanks|thank you|works|perfect|great|correct",
        no_next_state_reward: float = 0.0,
        hint_min_chars: int = 4,
    ) -> None:
        self.negative, self.positive = re.compile(negative, re.I), re.compile(positive, re.I)
        self.no_next_state_reward, self.hint_min_chars = no_next_state_reward, hint_min_chars

    async def reward(self, sample: Sample) -> Verdict:
        text = sample.text.next_state
        if text is None:
            return Verdict(self.no_next_state_reward, {"rule": "no_next_state"})
        for paragraph in paragraphs(text):  # the reaction comes first: "Thanks.\n\nNext: why did X fail?" is +1
            if self.negative.search(paragraph):
                return Verdict(-1.0, {"rule": "negative"})
            if self.positive.search(paragraph):
                return Verdict(1.0, {"rule": "positive"})
        return Verdict(0.0, {"rule": "neutral"})

    async def hint(self, sample: Sample) -> str | None:
        """The sentences after the first one that signals a correction (or that sentence's remainder), within
        its paragraph: what follows a blank line (the next question) is not part of the correction."""
        for paragraph in paragraphs(sample.text.next_state or ""):
            sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", paragraph) if s.strip()]
            for i, sentence in enumerate(sentences):
                m = self.negative.search(sentence)
                if m:
                    after = " ".join(sentences[i + 1 :]) or sentence[m.end() :].strip(" ,.;:-")
                    return after if len(after) >= self.hint_min_chars else None
            if self.positive.search(paragraph):  # the verdict was positive: no correction to learn from
                return None
        return None


PRM_SYSTEM = (
    "You are a process reward model. Judge whether the assistant's last response was good, using the next "
    "state (the user's reply or the tool output that followed it) as evidence. Think briefly, then answer "
    "\\boxed{1} (good), \\boxed{-1} (bad) or \\boxed{0} (unclear)."
)
HINT_SYSTEM = (
    "You extract hindsight hints. Given an assistant response and what happened next, write one short, concrete "
    "hint that would have let the assistant answer better, inside <hint></hint>. If the next state holds no "
    "useful correction, answer <hint>NONE</hint>."
)


def turn_transcript(sample: Sample) -> str:
    """The request, the response and the next state, as the judges read them."""
    last_user = next(
        (
            content_text(m.get("content"))
            for m in reversed(sample.text.messages or [])
            if m.get("role") in ("user", "tool")
        ),
        "",
    )
    nxt = sample.text.next_state if sample.text.next_state is not None else "(the session ended without a reply)"
    return (
        f"## Request\n{last_user}\n\n## Assistant response\n{sample.text.response_text or ''}\n\n## Next state\n{nxt}"
    )


class ServerJudge:
    """What the judges that ask a model server share: the server (None until the live loop binds our policy
    server: `bind`), the model asked, the per-request bounds and the model's thinking setting."""

    def __init__(self, base_url: str | None, model: str, api_key: str | None, timeout_s: float, max_retries: int,
                 thinking: Thinking | Mapping[str, Any] | None) -> None:  # fmt: skip
        self.endpoint = Endpoint(base_url, api_key) if base_url else None
        self.model = model
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.thinking = Thinking.of(thinking)

    def bind(self, server_url: str) -> None:
        """Point a judge configured with `base_url: null` at the policy server."""
        if self.endpoint is None:
            self.endpoint = Endpoint(server_url)


class LLMJudge(ServerJudge):
    """PRM votes and hint extraction through an OpenAI-compatible chat endpoint.

    Args:
        base_url: e.g. `http://127.0.0.1:8000` or `http://127.0.0.1:8000/v1` (both work); None: the policy server,
            bound later by the live loop (`bind`).
        model: the model asked (the server's base model name, so the adapter is not judging itself).
        api_key: bearer key.
        votes: m, PRM samples per turn, sent concurrently.
        temperature: sampling temperature of the votes.
        max_tokens: per judge reply.
        timeout_s: per request.
        max_retries: the SDK's retries (transport errors, read timeouts, 408/409/429, 5xx; `wire.client`).
        thinking: `model.thinking` (`metaclaw.thinking.Thinking`): its `chat_template_kwargs` go with every request
            (`{enable_thinking: false}` for Qwen3: a thinking judge can spend its whole budget before the verdict)
            and its budget is added to `max_tokens`; a verdict or hint found only in the reasoning is used when the
            answer has none.
    """

    def __init__(
        self,
        base_url: str | None,
        model: str,
        api_key: str | None = None,
        votes: int = 3,
        temperature: float = 0.6,
        max_tokens: int = 256,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        thinking: Thinking | Mapping[str, Any] | None = None,
    ) -> None:
        if votes < 1:
            raise ValueError(f"judge.votes must be >= 1, got {votes}")
        super().__init__(base_url, model, api_key, timeout_s, max_retries, thinking)
        self.votes, self.temperature, self.max_tokens = votes, temperature, max_tokens

    async def _ask(self, system: str, user: str, temperature: float) -> tuple[str, str]:
        """`(answer, reasoning)` of one judge reply (see `answer_and_reasoning`)."""
        if self.endpoint is None:
            raise RuntimeError("the judge has no endpoint: set judge.base_url (or run it in the live loop)")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": temperature,
            **self.thinking.fields(self.max_tokens),  # e.g. {enable_thinking: false}: Qwen3 answers without thinking
        }
        try:
            reply = await asyncio.to_thread(chat, self.endpoint, body, self.timeout_s, self.max_retries)
            choice = reply["choices"][0]
        except (CallError, ValueError, KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"judge request failed after {self.max_retries + 1} attempts: {e!r}") from e
        answer, reasoning = answer_and_reasoning(choice.get("message"))
        if not answer and choice.get("finish_reason") == "length":
            log.warning(
                "The judge used its whole budget (judge.max_tokens=%d + model.thinking.budget=%d) %s; "
                "raise model.thinking.budget or ask for no thinking "
                "(model.thinking.template_kwargs: {enable_thinking: false})",
                self.max_tokens, self.thinking.budget, "thinking" if reasoning else "without an answer",
            )  # fmt: skip
        return answer, reasoning

    async def reward(self, sample: Sample) -> Verdict:
        user = turn_transcript(sample)
        replies = await asyncio.gather(
            *(self._ask(PRM_SYSTEM, user, self.temperature) for _ in range(self.votes)), return_exceptions=True
        )
        votes = [None if isinstance(r, BaseException) else _verdict(*r) for r in replies]
        errors = [repr(r) for r in replies if isinstance(r, BaseException)]
        if errors and len(errors) == len(replies):
            raise RuntimeError(f"every judge vote failed: {errors[0]}")
        return Verdict(majority(votes), {"votes": votes, "errors": len(errors)})

    async def hint(self, sample: Sample) -> str | None:
        if not sample.text.next_state:
            return None
        answer, reasoning = await self._ask(HINT_SYSTEM, turn_transcript(sample), 0.0)
        found = HINT.findall(answer) or HINT.findall(reasoning)  # the answer's tag wins; the reasoning's if none
        hint = found[-1].strip() if found else ""
        return None if not hint or hint.upper() == "NONE" else hint


def _verdict(answer: str, reasoning: str) -> int | None:
    """The answer's `\\boxed{}` verdict; the reasoning's last one only when the answer has none."""
    vote = parse_boxed(answer)
    return vote if vote is not None else parse_boxed(reasoning)


def select_judge(model: str, cpu_judge_for_models: list[str], cpu: Judge | Any, llm: Judge | Any) -> Judge:
    """`judge=auto`: the CPU judge (the reaction classifier) for the listed models (too small to judge), the LLM
    judge for every other. Given config nodes (`_recursive_: false`), only the chosen one is built: the LLM judge
    path never loads the classifier's encoder, and the CPU path never needs a judge endpoint."""
    chosen = cpu if model in cpu_judge_for_models else llm
    if isinstance(chosen, Mapping | DictConfig) and "_target_" in chosen:
        from hydra.utils import instantiate

        return instantiate(chosen)
    return chosen
