"""Learning from what people say: context distillation of a stated preference (issue 42).

A correction such as "Your name is Kuro, always introduce yourself as Kuro" says what the person wants even when no
reply has shown it yet, and a scalar reward cannot select a behaviour that never occurs. With the correction in
context the model often does follow it (SmolLM2-135M says "Kuro" in most replies), so:

1. the scorer reads a turn as a correction (reward < 0) and the person's reaction states what they want
   (`stated_preference`: the reaction's sentences without the next question, a follow-up task, an update of the
   person's own request or a bare verdict);
2. `ContextDistiller` asks the teacher (by default our policy server's base model, adapter disabled: OPD's
   teacher) for a reply to the same conversation with that preference in context (`hinted_conversation`);
3. the teacher samples its replies cooler than the turn (`temperature`, 0.5 by default): what the preference
   makes likely, not the tail a 135M model reaches at T=1 (`bench/studies/distill_signal.py`: on SmolLM2's
   `identity`, 58% of the replies accepted at T=1 say Kuro and 95-100% at T=0.7-0.4, in better language);
4. the reply is accepted when the preference explains it: its mean per-token log-probability gain, hinted over
   plain (`token_gain`), both scored under the turn's own distribution, is at least `min_gain` nats; a reply the
   preference did not shape is not trained. It must also answer the request (`relevance`): the request must make
   it at least `min_relevance` nats a token more likely than the preference alone does (`unasked_conversation`).
   A reply about the correction ("I'm unable to provide a number") is as likely without the request, and
   training it teaches the model to talk about the correction, not to follow it;
5. the accepted reply becomes a new `ready` sample on the prompt WITHOUT the correction (the turn's own prompt
   ids, as the server rendered them), marked `meta.distilled`. The trainer gives such rows a cross-entropy term
   (`distill.loss`), never the policy loss: the reply was sampled from the hinted context, so its stored
   behaviour logprobs are the hinted prompt's (under the turn's distribution, whatever the teacher sampled at) and
   no importance ratio against the plain prompt is formed.

The corrected turn itself keeps its reward (-1): a correction never becomes a positive reward for the reply it
corrected. The new sample goes through the store's privacy screen like any captured turn.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from metaclaw.distribution import sample_distribution
from metaclaw.messages import answer_and_reasoning, content_text
from metaclaw.scoring.hints import hinted_messages
from metaclaw.scoring.judges import paragraphs
from metaclaw.scoring.reactions import sentences
from metaclaw.scoring.speech_acts import follow_up, is_question, objection, update
from metaclaw.store import Sample, SampleMeta, SampleText
from metaclaw.store.meta import OriginMeta
from metaclaw.wire.client import Endpoint, chat, teacher_logprobs

log = logging.getLogger(__name__)

HINTED_FORMS = ("system", "prefix", "suffix", "restate")
YIELD_WINDOW = 64
"""The teacher's yield (`TeacherPace.share`) is the accepted share of its last this-many hinted replies; until
a quarter of them are in, it works at full rate."""
CONTEXTS = ("fresh", "turn")
"""Which conversation the preference is distilled into: `fresh`, the turn's request alone as a new conversation (its
system messages and its last user message, without the reaction to an earlier reply that opens a later turn's
message: the scorer's convention, the reaction comes first), which is what the person wants to hold next time, with
no earlier correction in view; or `turn`, the conversation as it happened (a later turn's prompt then already holds
the person's earlier corrections, so the preference adds little and its replies are rarely accepted: 1 of 41 later
turns in docs/results/2026-11-28-learn-from-words.md)."""
"""Where the preference goes in the teacher's context: a system message (merged into the conversation's own, if
any), before the last user message, after it (OPD's hint, `scoring.hints`), or the exchange as it happened with
the last request restated after the correction (`bench/studies/distill_signal.py` measures each)."""


def stated_preference(reaction: str | None) -> str | None:
    """What a reaction says the person wants, in their own words: the sentences of its first paragraph (the
    reaction comes first; what follows a blank line is the next ask) without one-word sentences (a bare "No."),
    a question that does not object (the next question), a follow-up task, an update of the person's own request
    or a lead-in ("Another one:"); None when nothing remains. A verdict of more words ("That's not it.") states
    nothing to follow: the teacher's replies then gain little from it and `accepts` refuses them."""
    first = paragraphs(reaction or "")[:1]
    kept = []
    for sentence in sentences(first[0]) if first else []:
        if len(sentence.split()) < 2 or follow_up(sentence) or update(sentence) or sentence.rstrip().endswith(":"):
            continue  # a bare verdict ("No."), new work, the person's own update, a lead-in ("Another one:")
        if is_question(sentence) and objection(sentence) is None:
            continue
        kept.append(sentence)
    text = " ".join(kept)
    return text if len(text.split()) >= 2 else None


def _last_user(messages: Sequence[dict[str, Any]]) -> int | None:
    """The index of the last user message, None without one."""
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)


def hinted_conversation(
    messages: Sequence[dict[str, Any]], reply: str, preference: str, form: str = "system"
) -> list[dict[str, Any]]:
    """A copy of the conversation `messages` (which ends with the request `reply` answered) with `preference`
    in context, placed as `form` says (`HINTED_FORMS`)."""
    if form not in HINTED_FORMS:
        raise ValueError(f"distill.distiller.form must be one of {HINTED_FORMS}, got {form!r}")
    out = copy.deepcopy(list(messages))
    if form == "suffix":
        return hinted_messages(out, preference)
    last = _last_user(out)
    if form == "system":
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{content_text(out[0].get('content'))}\n\n{preference}".strip()
            return out
        return [{"role": "system", "content": preference}, *out]
    if last is None:
        return [*out, {"role": "user", "content": preference}]
    request = content_text(out[last].get("content"))
    if form == "prefix":
        out[last] = {**out[last], "content": f"{preference}\n\n{request}"}
        return out
    return [*out, {"role": "assistant", "content": reply}, {"role": "user", "content": f"{preference}\n\n{request}"}]


def unasked_conversation(
    messages: Sequence[dict[str, Any]], reply: str, preference: str, form: str = "system"
) -> list[dict[str, Any]]:
    """`hinted_conversation` with the request left out (the last user message emptied): the preference without
    anything asked. A hinted reply as likely here as with the request talks about the preference and answers
    nothing (`relevance`)."""
    out = copy.deepcopy(list(messages))
    last = _last_user(out)
    if last is not None:
        out[last] = {**out[last], "content": ""}
    hinted = hinted_conversation(out, reply, preference, form)
    for m in hinted:
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            m["content"] = m["content"].strip()
    return hinted


def _reacts(sentence: str) -> bool:
    """Whether a sentence that opens a later turn's message belongs to the reaction to the earlier reply: a bare
    verdict or aside ("Ace.", "Anyway."), a lead-in ("Next:") or a sentence `stated_preference` would keep (a
    preference, a complaint, praise); not a question that does not object, a follow-up task or the person's update."""
    if len(sentence.split()) < 2 or sentence.rstrip().endswith((":", "：")):
        return True
    return stated_preference(sentence) is not None


def without_reaction(message: str) -> str:
    """A later turn's message without the reaction to the earlier reply that opens it: the paragraphs after the
    first when there are several; in one paragraph, the text from the first sentence that is not part of the
    reaction ("You're Kuro. Anyway. What is the population of Canada?" → "What is the population of Canada?").
    The message as it is when nothing or everything reads as reaction."""
    parts = paragraphs(message)
    if len(parts) >= 2:
        return "\n\n".join(parts[1:])
    if not parts:
        return message
    text, start = parts[0], 0
    for i, sentence in enumerate(sentences(text)):
        at = text.find(sentence, start)
        if not _reacts(sentence):
            return text[at:].strip() if i else message
        start = at + len(sentence)
    return message


def fresh_conversation(messages: Sequence[dict[str, Any]], turn_index: int) -> list[dict[str, Any]]:
    """The turn's request as a new conversation: the leading system messages and the last user message; at a later
    turn (`turn_index` > 0) that message opens with the reaction to the earlier reply (the scorer reads it so: the
    reaction comes first), which is left out when a request follows it (`without_reaction`): a preference the person
    stated earlier in it would otherwise be in the plain prompt too, and the hinted replies would gain nothing over
    it. A copy; `messages` is unchanged."""
    out = copy.deepcopy(list(messages))
    system = []
    for m in out:
        if m.get("role") not in ("system", "developer"):
            break
        system.append(m)
    last = next((m for m in reversed(out) if m.get("role") == "user"), None)
    if last is None:
        return out
    if turn_index > 0:
        text = content_text(last.get("content"))
        request = without_reaction(text)
        if request != text:
            last = {"role": "user", "content": request}
    return [*system, last]


def token_gain(hinted: Sequence[float], plain: Sequence[float]) -> float:
    """Mean per-token log-probability gain of a reply, hinted context over plain (nats): how much the preference
    explains it."""
    if len(hinted) != len(plain) or not hinted:
        raise ValueError(f"need equally many logprobs, got {len(hinted)} hinted and {len(plain)} plain")
    return statistics.fmean(h - p for h, p in zip(hinted, plain, strict=True))


def accepts(gain: float, min_gain: float = 0.5, relevance: float | None = None, min_relevance: float | None = None
            ) -> bool:  # fmt: skip
    """Whether a hinted reply is trained: the preference made its tokens at least `min_gain` nats more likely on
    average, and (with `min_relevance`) the request made them at least `min_relevance` nats more likely than the
    preference alone (`relevance`: the reply answers what was asked)."""
    if gain < min_gain:
        return False
    return min_relevance is None or (relevance is not None and relevance >= min_relevance)


class TeacherPace:
    """How much of the time the distiller's teacher may be busy, by what it yields (`ContextDistiller`'s
    `target_yield` and `min_share`). `recent`: accepted or not, its last `YIELD_WINDOW` hinted replies."""

    def __init__(self, target_yield: float | None = 0.1, min_share: float = 0.25) -> None:
        if (target_yield is not None and not 0 < target_yield <= 1) or not 0 < min_share <= 1:
            raise ValueError(f"distill.distiller: target_yield in (0, 1] or null and min_share in (0, 1], got "
                             f"{target_yield!r}, {min_share!r}")  # fmt: skip
        self.target_yield, self.min_share = target_yield, min_share
        self.recent: deque[bool] = deque(maxlen=YIELD_WINDOW)

    def share(self) -> float:
        """The share of the time the teacher may be busy: 1 while its yield (the accepted share of `recent`) is at
        least `target_yield` or fewer than a quarter of the window are in; below, in proportion to the yield,
        never less than `min_share`."""
        if self.target_yield is None or len(self.recent) < YIELD_WINDOW // 4:
            return 1.0
        return max(self.min_share, min(1.0, statistics.fmean(self.recent) / self.target_yield))

    def rest_s(self, busy_s: float) -> float:
        """How long the teacher rests after a distillation that took `busy_s`, so that it is busy `share()` of the
        time."""
        return max(0.0, busy_s) * (1.0 / self.share() - 1.0)


@dataclass(frozen=True)
class HintedReply:
    """The teacher's reply with the preference in context: its tokens and their logprobs as sampled."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


class ContextDistiller:
    """Samples replies with a stated preference in context and returns those the preference explains as training
    samples on the prompt without the preference.

    Args:
        base_url: the teacher server (with or without `/v1`); None: our policy server, bound by the live loop (`bind`).
        model: the model asked (the base model name: adapter disabled, like OPD's teacher).
        api_key: bearer key of `base_url`.
        form: where the preference goes in context (`HINTED_FORMS`).
        samples: hinted replies asked per correction (one request, `n`): each is accepted or not on its own; 0:
            none, only the corrected reply's own row (`own_reply`; the teacher renders the hinted prompt, one
            forward instead of `samples` generations).
        min_gain: the acceptance bound of `accepts` (nats per token).
        min_relevance: the request's bound of `accepts` (nats per token, hinted over `unasked_conversation`; one
            more forward per reply that passes `min_gain`); None: not checked.
        target_yield: the teacher's time follows what it yields (`pace`: `TeacherPace`): while at least this share
            of its last `YIELD_WINDOW` hinted replies was accepted it works whenever a correction waits; below, it
            rests so that it is busy at most `yield / target_yield` of the time, and never less than `min_share`. The
            teacher's generations take the CPU the rollouts and the trainer need (session 25's main job, 5% of
            hinted replies accepted: 14-24% fewer steps). None: always at full rate.
        min_share: the least share of the time the teacher keeps working at any yield (a preference it starts to
            follow is noticed).
        temperature: the temperature the hinted replies are sampled at, with the turn's top-p/top-k (a turn
            sampled cooler keeps its own; None: the turn's own). The gain and the stored logprobs are scored
            under the turn's distribution all the same (one more forward per reply when they differ), so a row
            reads as the turn's distribution, like every sample.
        context: the conversation the preference is distilled into (`CONTEXTS`).
        own_reply: the corrected reply itself also becomes a distilled row, trained toward what the teacher (with
            the preference in context) would have said at each of its tokens (`distill.top_k`, SDPO's and CLaaS's
            self-distillation): every stated correction teaches, whether or not a hinted reply is accepted. Off by
            default: it did not measure better on CLaaS identity (session 18: 22.9 and 30.0% at the last point within
            20 minutes, session 17's design without it 32.9 and 34.3% with the same seeds).
        replays: each accepted reply is trained this many more times, in the steps after its first (the store
            copies it as it is claimed, `SampleStore.claim_batch`; a copy keeps the original's capture time, so
            `data.max_age_s` bounds it like any sample; no version bound applies: `store.claims`). A handful of
            accepted replies is what a correction yields; one gradient step each moved nothing in 20 minutes. 4
            (session 29; 2 before): the teacher is the bottleneck, so what it accepts teaches in more steps (CLaaS
            identity at minute 19, median of 3: 94.3% against 75.7%).
        max_tokens: the reply budget when the turn's own reply was not cut at its budget (then that length).
        timeout_s: per request.
    """

    def __init__(
        self,
        base_url: str | None,
        model: str,
        api_key: str | None = None,
        form: str = "prefix",
        samples: int = 4,
        min_gain: float = 0.5,
        max_tokens: int = 256,
        timeout_s: float = 120.0,
        context: str = "fresh",
        replays: int = 4,
        own_reply: bool = False,
        temperature: float | None = 0.5,
        min_relevance: float | None = 0.1,
        target_yield: float | None = 0.1,
        min_share: float = 0.25,
    ) -> None:
        if form not in HINTED_FORMS:
            raise ValueError(f"distill.distiller.form must be one of {HINTED_FORMS}, got {form!r}")
        if context not in CONTEXTS or not 0 <= replays <= 8:
            raise ValueError(
                f"distill.distiller: context in {CONTEXTS} and replays in [0, 8], got {context!r}, {replays}"
            )
        if max_tokens < 1 or not 0 <= samples <= 16 or (samples == 0 and not own_reply):
            raise ValueError(f"distill.distiller: max_tokens >= 1 and samples in [0, 16] (0 only with own_reply), got "
                             f"{max_tokens}, {samples}")  # fmt: skip
        if temperature is not None and not 0 < temperature <= 2:
            raise ValueError(f"distill.distiller.temperature must be in (0, 2] or null, got {temperature!r}")
        self.temperature = temperature
        self.pace = TeacherPace(target_yield, min_share)
        self.endpoint = Endpoint(base_url, api_key) if base_url else None
        self.model = model
        self.form, self.samples, self.min_gain, self.min_relevance = form, samples, min_gain, min_relevance
        self.context, self.replays, self.own_reply = context, replays, own_reply
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self.stats = {"asked": 0, "accepted": 0, "rejected": 0, "failed": 0, "off_request": 0, "duplicates": 0}
        self.redact: Callable[[Sample], Sample] | None = None  # set when the teacher is off this machine

    async def distill(self, sample: Sample, preference: str) -> tuple[list[Sample], dict[str, Any]]:
        """`(new samples, what happened)` for a turn whose correction states `preference`."""
        if self.endpoint is None:
            raise RuntimeError("the context distiller has no teacher server (distill.distiller.base_url)")
        self.stats["asked"] += 1
        dist = sample_distribution(sample.temperature, sample.meta)
        seen = self.redact(sample) if self.redact is not None else sample  # what the teacher may read
        plain_messages, prompt_ids = seen.text.messages or [], list(sample.prompt_ids)
        if self.context == "fresh":
            fresh = fresh_conversation(plain_messages, sample.turn_index)
            if fresh != plain_messages:  # a later turn: the new conversation's prompt, as the server renders it
                plain_messages = fresh
                prompt_ids = await asyncio.to_thread(self._render, self._body(sample, fresh, 1, 1, dist))
        messages = hinted_conversation(plain_messages, seen.text.response_text or "", preference, self.form)
        budget = len(sample.response_ids) if sample.meta.origin.finish_reason == "length" else self.max_tokens
        sampling = self._sampling(dist)
        if self.samples:
            body = self._body(sample, messages, budget, self.samples, sampling)
            replies, hinted_ids = await asyncio.to_thread(self._ask, body)
            if sampling["temperature"] != dist["temperature"]:  # scored again under the turn's distribution
                replies = [await asyncio.to_thread(self._rescored, r, hinted_ids, dist) for r in replies]
        else:  # the corrected reply alone: the teacher only renders the hinted prompt (one forward)
            replies, hinted_ids = [], await asyncio.to_thread(self._render, self._body(sample, messages, 1, 1, dist))
        gains = []
        for reply in replies:
            plain = await asyncio.to_thread(
                teacher_logprobs, self.endpoint, self.model, prompt_ids, reply.token_ids, self.timeout_s,
                dist["temperature"], dist["top_p"], dist["top_k"],
            )  # fmt: skip
            gains.append(token_gain(reply.logprobs, plain))
        reply_text = seen.text.response_text or ""
        relevances = await self._relevances(sample, plain_messages, reply_text, preference, replies, gains, dist)
        ok = [accepts(g, self.min_gain, rel, self.min_relevance) for g, rel in zip(gains, relevances, strict=True)]
        kept = [(r, g, rel) for r, g, rel, y in zip(replies, gains, relevances, ok, strict=True) if y]
        info = {"from": sample.id, "preference": preference, "form": self.form, "context": self.context,
                "teacher": self.model, "gains": [round(g, 4) for g in gains], "accepted": len(kept),
                "relevances": [None if r is None else round(r, 4) for r in relevances],
                "sampled_at": sampling["temperature"]}  # fmt: skip
        self.stats["accepted"] += len(kept)
        self.stats["rejected"] += len(gains) - len(kept)
        self.pace.recent.extend(ok)
        self.stats["off_request"] += sum(rel is not None and not y for rel, y in zip(relevances, ok, strict=True))
        words = dataclasses.replace(sample.text, messages=plain_messages)
        base = dataclasses.replace(sample, prompt_ids=prompt_ids, text=words)
        extra = {"replays_left": self.replays}
        # an accepted reply is trained on its own tokens (cross-entropy): it was selected because the preference
        # explains it, a sharper target than the teacher's whole distribution (session 18: with the teacher's top-k
        # instead, CLaaS identity reached 4.3%, against 28.6-34.3% with its tokens)
        out = [self._sample(base, reply, {**info, "gain": round(g, 4), "kind": "hinted", **extra,
                                          "relevance": None if rel is None else round(rel, 4)})
               for reply, g, rel in kept]  # fmt: skip
        if self.own_reply and hinted_ids:
            own = HintedReply(list(sample.response_ids), list(sample.behaviour_logprobs),
                              seen.text.response_text or "", sample.meta.origin.finish_reason)  # fmt: skip
            out.append(self._sample(base, own, {**info, "kind": "own", "teacher_prompt_ids": hinted_ids, **extra}))
        info["own_reply"] = bool(self.own_reply and hinted_ids)
        return out, info

    async def _relevances(self, sample: Sample, plain_messages: list[dict[str, Any]], reply_text: str,
                          preference: str, replies: Sequence[HintedReply], gains: Sequence[float],
                          dist: dict[str, Any]) -> list[float | None]:  # fmt: skip
        """Each reply's `relevance`: mean per-token log-probability, hinted over the preference alone
        (`unasked_conversation`), under the turn's distribution; None where it is not needed (no `min_relevance`,
        or the reply fails `min_gain` anyway)."""
        assert self.endpoint is not None  # checked by `distill`
        todo = [i for i, g in enumerate(gains) if self.min_relevance is not None and accepts(g, self.min_gain)]
        out: list[float | None] = [None] * len(replies)
        if not todo:
            return out
        unasked = unasked_conversation(plain_messages, reply_text, preference, self.form)  # as the hinted one
        ids = await asyncio.to_thread(self._render, self._body(sample, unasked, 1, 1, dist))
        for i in todo:
            lp = await asyncio.to_thread(
                teacher_logprobs, self.endpoint, self.model, ids, replies[i].token_ids, self.timeout_s,
                dist["temperature"], dist["top_p"], dist["top_k"],
            )  # fmt: skip
            out[i] = token_gain(replies[i].logprobs, lp)
        return out

    def _sampling(self, dist: dict[str, Any]) -> dict[str, Any]:
        """The distribution the hinted replies are sampled from: the turn's, cooled to `temperature` (never
        hotter than the turn's own; a greedy turn is scored as T=1 and sampled at `temperature`)."""
        if self.temperature is None or dist["temperature"] <= self.temperature:
            return dist
        return {**dist, "temperature": self.temperature}

    def _rescored(self, reply: HintedReply, hinted_ids: list[int], dist: dict[str, Any]) -> HintedReply:
        """`reply` with its logprobs under the turn's distribution `dist` on the hinted prompt (it was sampled
        cooler): the gain compares two prompts under one distribution, and the row stores that distribution's."""
        assert self.endpoint is not None  # checked by `distill`
        if not hinted_ids:
            raise RuntimeError(
                "the teacher did not return prompt_token_ids (return_token_ids): a reply sampled at "
                "distill.distiller.temperature cannot be scored under the turn's distribution"
            )
        logprobs = teacher_logprobs(self.endpoint, self.model, hinted_ids, reply.token_ids, self.timeout_s,
                                    dist["temperature"], dist["top_p"], dist["top_k"])  # fmt: skip
        return dataclasses.replace(reply, logprobs=logprobs)

    def _body(self, sample: Sample, messages: list[dict[str, Any]], budget: int, n: int, dist: dict[str, Any]
              ) -> dict[str, Any]:  # fmt: skip
        """A chat request to the teacher for `messages` in the turn's own setting (tools, template arguments)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": budget, "logprobs": True,
            "return_token_ids": True, "n": n, **dist,
        }  # fmt: skip
        if sample.meta.tools:
            body["tools"] = sample.meta.tools
        if sample.meta.chat_template_kwargs:
            body["chat_template_kwargs"] = sample.meta.chat_template_kwargs
        return body

    def _render(self, body: dict[str, Any]) -> list[int]:
        """The prompt ids the teacher renders for `body` (its `prompt_token_ids`; one token is generated)."""
        assert self.endpoint is not None  # checked by `distill`
        ids = chat(self.endpoint, body, self.timeout_s).get("prompt_token_ids")
        if not ids:
            raise RuntimeError("the teacher did not return prompt_token_ids (return_token_ids) for the fresh prompt")
        return [int(t) for t in ids]

    @staticmethod
    def _sample(source: Sample, reply: HintedReply, info: dict[str, Any]) -> Sample:
        """The accepted reply as a `ready` sample on `source`'s prompt (without the preference)."""
        meta = SampleMeta(
            sampling=source.meta.sampling, chat_template_kwargs=source.meta.chat_template_kwargs,
            tools=source.meta.tools, origin=OriginMeta(finish_reason=reply.finish_reason,
                                                 session_source=source.meta.origin.session_source),
            skills=source.meta.skills, skill_generation=source.meta.skill_generation, distilled=info,
        )  # fmt: skip
        return Sample(
            prompt_ids=list(source.prompt_ids),  # the prompt WITHOUT the preference: what the adapter learns to answer
            response_ids=reply.token_ids,
            behaviour_logprobs=reply.logprobs,  # the hinted distribution's (the teacher sampled it there)
            agent_id=source.agent_id,
            session_id=source.session_id,
            turn_index=source.turn_index,
            adapter_version=source.adapter_version,  # freshness as the turn it came from
            temperature=source.temperature,
            status="ready",
            text=SampleText(messages=copy.deepcopy(source.text.messages), response_text=reply.text),
            meta=meta,
        )

    def _ask(self, body: dict[str, Any]) -> tuple[list[HintedReply], list[int]]:
        """The teacher's hinted replies and the prompt ids it read (`prompt_token_ids`; empty when the server does
        not return them: the rows then train on their sampled tokens only)."""
        assert self.endpoint is not None  # checked by `distill`
        replies: list[HintedReply] = []
        seen: set[tuple[int, ...]] = set()
        answer = chat(self.endpoint, body, self.timeout_s)
        for choice in answer.get("choices") or []:
            ids = [int(t) for t in choice.get("token_ids") or []]
            logprobs = [float(e["logprob"]) for e in (choice.get("logprobs") or {}).get("content") or []]
            if not ids or len(logprobs) != len(ids):
                self.stats["failed"] += 1
                raise RuntimeError(f"the teacher's hinted reply has {len(ids)} token ids and {len(logprobs)} "
                                   "logprobs (it must return both: return_token_ids, logprobs)")  # fmt: skip
            if (key := tuple(ids)) in seen:  # the same reply twice (a short one, sampled cool): one row, scored once
                self.stats["duplicates"] += 1
                continue
            seen.add(key)
            text = answer_and_reasoning(choice.get("message") or {})[0]
            replies.append(HintedReply(ids, logprobs, text, choice.get("finish_reason")))
        if not replies:
            raise RuntimeError("the teacher returned no choices")
        return replies, [int(t) for t in answer.get("prompt_token_ids") or []]
