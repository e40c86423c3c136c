"""A one-forward verdict judge (`judge=verdict`, issue 42): for a user who configures an instruct model that can read
people (0.5B and up), one forward pass per turn instead of the LLM judge's votes of up to 256 tokens each.

The judge model reads the request, the reply and the user's next message, and is asked which of three it is:
A, the next message objects to the reply (a correction, a complaint, a question or a need the reply missed);
B, it approves of it; C, neither (a new question, a follow-up task, small talk). It writes nothing: the request
asks for one token with `top_logprobs`, and the verdict is read from the probabilities the model gives the three
letters at that position (`letter_shares`). The reward is -1 for A and +1 for B when that letter holds at least
`min_share` of the three letters' mass, else 0 (no verdict); C is always 0. So a correction is never read as +1
unless the model is sure it is approval, and a model that puts its mass elsewhere (it does not follow the format)
gives no verdict and says so (`detail["letters"]`, the warning below).

Any OpenAI-compatible server that answers `top_logprobs` works: vLLM, and metaclaw's own policy server (HF and ONNX
engines). `base_url: null` asks our policy server's base model (adapter disabled), as the LLM judge does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from metaclaw.scoring.distill import stated_preference
from metaclaw.scoring.judges import ServerJudge, Verdict, turn_transcript
from metaclaw.store import Sample
from metaclaw.thinking import Thinking
from metaclaw.wire.client import CallError, chat

log = logging.getLogger(__name__)

VERDICT_SYSTEM = (
    "You read one turn of a conversation: the user's request, the assistant's response, and the user's next "
    "message. Say what the next message says about the response. Answer with one letter:\n"
    "A - it objects to the response or wants it different: a correction, a complaint, a question or a need "
    "that the response missed, a preference it did not follow\n"
    "B - it approves of the response: thanks, praise, agreement\n"
    "C - neither: a new question, a follow-up task, small talk"
)
LETTERS = {"A": -1.0, "B": 1.0, "C": 0.0}
TOP = 20  # alternatives read at the answer position (OpenAI's most)


def letter_shares(top: Sequence[Mapping[str, Any]]) -> tuple[dict[str, float], float]:
    """`(shares, mass)` from one position's `top_logprobs` (`{token, logprob}`): each letter's probability (the
    tokens that are that letter once stripped and upper-cased, " A" and "a" alike) over the three letters' sum, and
    that sum (how much of the model's mass went to the format at all)."""
    import math

    prob = dict.fromkeys(LETTERS, 0.0)
    for entry in top:
        letter = str(entry.get("token", "")).strip().upper()
        if letter in prob:
            prob[letter] += math.exp(float(entry["logprob"]))
    mass = sum(prob.values())
    return ({k: v / mass for k, v in prob.items()} if mass > 0 else prob), mass


class VerdictJudge(ServerJudge):
    """One forward per turn: the verdict from the judge model's probabilities of three letters.

    Args:
        base_url: an OpenAI-compatible server that answers `top_logprobs` (with or without `/v1`); None: our policy
            server, bound by the live loop.
        model: the model asked (our server: the base model name, adapter disabled).
        api_key: bearer key of `base_url`.
        min_share: the share of the three letters' mass a verdict needs (below it: 0, no verdict).
        min_mass: below this much mass on the three letters the model did not follow the format: no verdict, and
            a warning (once, then every 100th).
        no_next_state_reward: the reward of a turn with nothing after it.
        timeout_s, max_retries: per request (`wire.client`).
        thinking: `model.thinking`: its `chat_template_kwargs` go with the request (a thinking model answers at once).
    """

    def __init__(
        self,
        base_url: str | None,
        model: str,
        api_key: str | None = None,
        min_share: float = 0.6,
        min_mass: float = 0.2,
        no_next_state_reward: float = 0.0,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        thinking: Thinking | Mapping[str, Any] | None = None,
    ) -> None:
        if not 0.5 <= min_share <= 1 or not 0 <= min_mass <= 1:
            raise ValueError(f"judge: min_share in [0.5, 1] and min_mass in [0, 1], got {min_share}, {min_mass}")
        super().__init__(base_url, model, api_key, timeout_s, max_retries, thinking)
        self.min_share, self.min_mass, self.no_next_state_reward = min_share, min_mass, no_next_state_reward
        self.off_format = 0

    async def reward(self, sample: Sample) -> Verdict:
        if sample.text.next_state is None:
            return Verdict(self.no_next_state_reward, {"rule": "no_next_state"})
        if self.endpoint is None:
            raise RuntimeError("the verdict judge has no endpoint: set judge.base_url (or run it in the live loop)")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": VERDICT_SYSTEM},
                         {"role": "user", "content": f"{turn_transcript(sample)}\n\nAnswer with A, B or C."}],
            "temperature": 1.0, "logprobs": True, "top_logprobs": TOP, **self.thinking.fields(None), "max_tokens": 1,
        }  # fmt: skip
        try:
            reply = await asyncio.to_thread(chat, self.endpoint, body, self.timeout_s, self.max_retries)
            top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        except (CallError, ValueError, KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"verdict request failed: {e!r}") from e
        if not top:
            raise RuntimeError("the judge server answered no top_logprobs: it cannot be a verdict judge")
        return self.decide(top)

    def decide(self, top: Sequence[Mapping[str, Any]]) -> Verdict:
        """The verdict from the answer position's `top_logprobs`."""
        shares, mass = letter_shares(top)
        detail = {"judge": "verdict", "letters": {k: round(v, 3) for k, v in shares.items()}, "mass": round(mass, 3)}
        if mass < self.min_mass:
            self.off_format += 1
            if self.off_format == 1 or self.off_format % 100 == 0:
                log.warning("The verdict judge (%s) put %.0f%% of its mass on A/B/C (%d turns so far): no verdict; "
                            "is it an instruct model of 0.5B or more?", self.model, 100 * mass,
                            self.off_format)  # fmt: skip
            return Verdict(0.0, {**detail, "rule": "off_format"})
        best = max(shares, key=lambda k: shares[k])
        sure = shares[best] >= self.min_share
        return Verdict(LETTERS[best] if sure else 0.0, {**detail, "rule": best if sure else "unsure"})

    async def hint(self, sample: Sample) -> str | None:
        """What the next message says the person wants (`scoring.distill.stated_preference`), for OPD."""
        return stated_preference(sample.text.next_state)
