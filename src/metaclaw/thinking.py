"""How metaclaw's own callers get an answer from a thinking model (Qwen3 thinks first unless told not to).

One setting, `model.thinking` (conf/model/*.yaml), read by every caller that asks the policy server for text: the
demo's simulated user, the replay driver, the evaluator, the gate's quality answers, the LLM judge (PRM votes and
OPD hints) and the skill evolver. `template_kwargs` go out as the request's `chat_template_kwargs`
(`{enable_thinking: false}`: Qwen3's template prefills an empty `<think>\\n\\n</think>` block, so every sampled token
is the answer); `budget` tokens are added to each caller's `max_tokens` for a model that thinks anyway (a template
without such a switch), so the reasoning does not eat the answer. The teacher needs neither: it scores the tokens
a sample already has, under the prompt rendered as the sample's was (the sample's own `chat_template_kwargs`).
Reading the reply, callers take the answer, never the reasoning (`metaclaw.messages.answer_and_reasoning`); a reply
that is all reasoning is said in the log (`read_answer`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metaclaw.messages import answer_and_reasoning, content_text

log = logging.getLogger(__name__)

_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Thinking:
    """`model.thinking`: what internal callers send so a thinking model answers within their `max_tokens`.

    Args:
        template_kwargs: sent as `chat_template_kwargs` ({} sends none: an endpoint that refuses the field).
        budget: tokens added to every internal caller's `max_tokens` (0: none).
    """

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    budget: int = 0

    def __post_init__(self) -> None:
        kwargs = dict(self.template_kwargs or {})
        if not all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in kwargs.items()):
            raise ValueError(f"model.thinking.template_kwargs must map names to scalars, got {kwargs!r}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"model.thinking.budget must be an integer >= 0, got {self.budget!r}")
        object.__setattr__(self, "template_kwargs", kwargs)

    @classmethod
    def of(cls, node: Thinking | Mapping[str, Any] | None) -> Thinking:
        """From a config node (None: send nothing, add nothing)."""
        if isinstance(node, Thinking):
            return node
        node = dict(node or {})
        return cls(template_kwargs=dict(node.get("template_kwargs") or {}), budget=int(node.get("budget") or 0))

    def max_tokens(self, n: int | None) -> int | None:
        """A caller's `max_tokens` with the thinking budget added (None stays None: no cap)."""
        return None if n is None else n + self.budget

    def fields(self, max_tokens: int | None) -> dict[str, Any]:
        """The request fields: `max_tokens` (+ budget; left out when None) and `chat_template_kwargs` (when set)."""
        out: dict[str, Any] = {}
        if max_tokens is not None:
            out["max_tokens"] = self.max_tokens(max_tokens)
        if self.template_kwargs:
            out["chat_template_kwargs"] = dict(self.template_kwargs)
        return out


class _Said:
    """Warn the first time and every `every`-th time after, per caller (loud, never a flood)."""

    def __init__(self, every: int = 100) -> None:
        self.every, self.counts, self.lock = every, Counter[str](), threading.Lock()

    def __call__(self, who: str) -> int | None:
        with self.lock:
            self.counts[who] += 1
            n = self.counts[who]
        return n if n == 1 or n % self.every == 0 else None


_said = _Said()


def read_answer(message: Mapping[str, Any] | None, finish_reason: str | None, who: str, max_tokens: int | None) -> str:
    """The answer of a chat reply (reasoning never passes for it); a reply that ran out inside its reasoning is
    logged as a warning naming `who` and the setting that fixes it (`model.thinking`)."""
    message = dict(message or {})
    answer, reasoning = answer_and_reasoning(message)
    content = content_text(message.get("content"))
    if "<think>" not in content and "</think>" not in content:
        answer = content  # as sent (whitespace kept: the next turn repeats it, and the server's prefix cache matches)
    if not answer.strip() and (reasoning or finish_reason == "length"):
        say_no_answer(who, bool(reasoning), finish_reason, max_tokens)
    return answer


def say_no_answer(who: str, reasoning: bool, finish_reason: str | None, max_tokens: int | None) -> None:
    """Warn (first time, then every 100th, per `who`) that a reply came back without an answer, and what fixes it."""
    n = _said(who)
    if n is not None:
        log.warning(
            "%s: the reply has no answer (%s, finish_reason=%s, max_tokens=%s; %d so far): a thinking model spent its "
            "budget thinking. Set model.thinking.template_kwargs={enable_thinking: false} where the chat template has "
            "the switch (Qwen3; or send chat_template_kwargs), or model.thinking.budget to the tokens it thinks",
            who, "reasoning only" if reasoning else "empty", finish_reason, max_tokens, n,
        )  # fmt: skip
