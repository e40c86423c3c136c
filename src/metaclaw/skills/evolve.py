"""Skill evolution: ask an LLM to turn a session's failed turns into new or edited skills.

The live loop decides when (session end, every N main turns: `metaclaw.skills.hooks.EvolutionScheduler`,
driven by the scoring worker) and calls `SkillEvolver.evolve`. Every proposal,
accepted or not, is logged in the agent's JSONL history; every accepted change bumps the agent's generation.

Proposals are untrusted (`metaclaw.skills.untrusted`): one that copies the conversation or carries a link or a
command is refused; one that passes waits in quarantine (`approval: manual`, the default: on a keyless proxy any
local caller can name an agent) unless the owner sets `approval: auto_safe`, which serves it at once for an agent
of its own (never `default`, which every header-less client shares); a quarantined one waits for
`python -m metaclaw skills approve NAME --agent ID`. Each skill file keeps its provenance (agent, source sample and
session ids) in its front matter, so forgetting a sample can find the skills it led to.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metaclaw.messages import answer_and_reasoning, content_text
from metaclaw.skills.library import DEFAULT_AGENT_ID, SHARED_POOL, SkillLibrary, default_root
from metaclaw.skills.proposals import ProposalError, parse_reply, validate_proposal
from metaclaw.skills.ranking import BM25Ranker, SkillRanker
from metaclaw.skills.skill import Skill
from metaclaw.skills.untrusted import UntrustedContentError, check_untrusted, turn_text
from metaclaw.thinking import Thinking
from metaclaw.wire.client import CallError, Endpoint, Refused, chat

logger = logging.getLogger(__name__)

MIN_TURN_CHARS = 400  # a request that overflows the endpoint's context is retried smaller, down to one turn of this
APPROVALS = ("manual", "auto_safe")
LINE = "\n"  # list-of-parts content: one line per part


class ContextTooLong(RuntimeError):
    """The endpoint refused the request as longer than its model's context (400 `context_length_exceeded`)."""


SYSTEM_PROMPT = """You improve the skill library of an AI assistant. A skill is a short Markdown instruction \
that is injected into the system prompt when it is relevant. You get turns where the assistant did badly \
(reward <= 0) and the list of existing skills. Find the general lesson behind the failures and propose at most \
{max_proposals} skills: "add" a new one, or "edit" an existing one (same name) when it should have prevented the \
failure. Skills must be general and reusable, not about one conversation. Do not duplicate existing skills.

Reply with JSON only, in this shape:
{{"skills": [{{"action": "add" | "edit", "name": "lowercase-slug", "description": "one line: when to apply it", \
"category": "lowercase-slug", "body": "Markdown bullet points, under {max_body_chars} characters"}}]}}
Reply {{"skills": []}} if no skill would help."""


@dataclass(frozen=True)
class FailedTurn:
    """One turn that scored badly.

    Attributes:
        sample_id: id of the stored sample (logged as the source of any change; the store's ids are ints).
        prompt: the conversation as OpenAI messages, or already-rendered prompt text.
        response: the assistant's reply.
        reward: the judge's score (≤ 0 for a failure).
        feedback: what came next (the user's reply or tool output the judge read), if known.
    """

    sample_id: str | int
    prompt: str | Sequence[Mapping[str, Any]]
    response: str
    reward: float = 0.0
    feedback: str | None = None
    session_id: str | None = None

    @classmethod
    def coerce(cls, turn: FailedTurn | Mapping[str, Any]) -> FailedTurn:
        """Accept a `FailedTurn` or a dict with `sample_id`, `messages`/`prompt`, `response`, `reward` and
        optionally `next_state`/`feedback`."""
        if isinstance(turn, FailedTurn):
            return turn
        prompt = turn.get("messages", turn.get("prompt", turn.get("prompt_text", "")))
        response = turn.get("response", turn.get("response_text", ""))
        try:
            reward = float(turn.get("reward") or 0.0)
        except (TypeError, ValueError):
            reward = 0.0
        feedback = turn.get("next_state", turn.get("feedback"))
        feedback = content_text(feedback, "\n") if feedback is not None else None
        sample_id = turn.get("sample_id", "")
        sample_id = sample_id if isinstance(sample_id, int) and not isinstance(sample_id, bool) else str(sample_id)
        session = turn.get("session_id")
        return cls(sample_id, prompt or "", str(response or ""), reward, feedback or None,
                   str(session) if session else None)  # fmt: skip

    def render(self, max_chars: int) -> str:
        """The turn as text for the LLM, keeping the tail of a long prompt (where the failing ask is)."""
        if isinstance(self.prompt, str):
            prompt = self.prompt
        else:
            prompt = "\n".join(f"[{m.get('role', '?')}] {content_text(m.get('content'), LINE)}" for m in self.prompt)
        half = max_chars // 2
        if len(prompt) > half:
            prompt = "…" + prompt[-half:]
        head = f"### sample {self.sample_id} (reward {self.reward:g})"
        text = f"{head}\n{prompt}\n[assistant reply] {self.response[:half]}"
        if self.feedback:
            text += f"\n[what came next] {self.feedback[: max_chars // 4]}"
        return text


@dataclass
class EvolutionResult:
    """What one `evolve` call did.

    Attributes:
        accepted: history entries of accepted changes (served from now on).
        rejected: history entries of refused proposals (or of a refused reply).
        quarantined: history entries of proposals that wait for approval (not served).
        generation: the agent's generation after the call.
        error: why no proposal could be considered (request failed, invalid JSON), else None.
    """

    accepted: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    generation: int = 0
    error: str | None = None

    @property
    def accepted_names(self) -> list[str]:
        """Names of the skills that were added or edited."""
        return [e["name"] for e in self.accepted]


@dataclass(frozen=True)
class ProposalLimits:
    """What one evolution may send and accept (`SkillEvolver`'s arguments of the same names)."""

    max_proposals: int = 3  # proposals considered per call (extra ones are refused)
    max_turns: int = 8  # failed turns sent per call (the most recent are kept)
    max_turn_chars: int = 3000  # characters per rendered turn
    max_description_chars: int = 300  # limit on a proposal's description
    max_body_chars: int = 4000  # limit on a proposal's body


class SkillEvolver:
    """Proposes skills from failed turns via any OpenAI-compatible chat endpoint, then validates and writes them.

    Args:
        library_root: skills root (see `SkillLibrary`); None means `default_root()`.
        base_url: endpoint base, with or without `/v1` (e.g. `http://127.0.0.1:8000/v1`).
        model: model name sent in the request.
        api_key: bearer token; None reads `$METACLAW_EVOLVER_API_KEY`, and no header is sent if both are empty.
        ranker: similarity used for duplicate detection; defaults to `BM25Ranker()`.
        similarity_threshold: duplicate cut-off; None uses the ranker's `duplicate_threshold`.
        timeout_s: per-request timeout.
        max_retries: retries after the first attempt on transport errors, 429 and 5xx (not after a read timeout).
        max_proposals: proposals considered per call (extra ones are refused).
        max_turns: failed turns sent per call (the most recent are kept).
        max_turn_chars: characters per rendered turn.
        max_description_chars: limit on a proposal's description.
        max_body_chars: limit on a proposal's body.
        temperature: sampling temperature of the request.
        max_tokens: cap on the reply's length (bounds the time the endpoint spends); None sends no cap.
        seed_bank: seed `_shared/` from the starter bank on first use.
        thinking: `model.thinking` (`metaclaw.thinking.Thinking`): its `chat_template_kwargs` go with the request
            (`{enable_thinking: false}`: a thinking model answers without spending `max_tokens` on reasoning first),
            its budget is added to `max_tokens`; a reply with reasoning but no answer is read from it.
        approval: `manual` (every accepted proposal waits in quarantine for a human) or `auto_safe` (one that
            passed the untrusted-content rule is served at once, except for the shared `default` agent).
        max_agents: agent folders the skills root may hold; evolution for a new agent beyond it is refused.
    """

    def __init__(
        self,
        library_root: str | os.PathLike[str] | None = None,
        base_url: str | None = None,
        model: str = "gpt-4o-mini",
        api_key: str | None = None,
        ranker: SkillRanker | None = None,
        similarity_threshold: float | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 2,
        max_proposals: int = 3,
        max_turns: int = 8,
        max_turn_chars: int = 3000,
        max_description_chars: int = 300,
        max_body_chars: int = 4000,
        temperature: float = 0.2,
        max_tokens: int | None = 2048,
        seed_bank: bool = True,
        thinking: Thinking | Mapping[str, Any] | None = None,
        approval: str = "manual",
        max_agents: int = 1024,
    ) -> None:
        if approval not in APPROVALS:
            raise ValueError(f"skills.evolver.approval must be one of {APPROVALS}, got {approval!r}")
        self.approval, self.max_agents = approval, max_agents
        self.root = Path(library_root).expanduser() if library_root is not None else default_root()
        if not base_url:  # `skills.evolver.base_url: null` is our policy server: the loop fills it in
            raise ValueError("SkillEvolver needs a base_url (an OpenAI-compatible .../v1)")
        key = api_key if api_key is not None else os.environ.get("METACLAW_EVOLVER_API_KEY", "")
        self.endpoint, self.model = Endpoint(base_url, key or None), model
        self.ranker: SkillRanker = ranker if ranker is not None else BM25Ranker()
        self.threshold = similarity_threshold if similarity_threshold is not None else self.ranker.duplicate_threshold
        self.timeout_s, self.max_retries, self.temperature = timeout_s, max_retries, temperature
        self.max_tokens = max_tokens
        self.limits = ProposalLimits(max_proposals, max_turns, max_turn_chars, max_description_chars, max_body_chars)
        self.seed_bank = seed_bank
        self.thinking = Thinking.of(thinking)

    # ------------------------------------------------------------------ LLM call
    def build_messages(
        self, library: SkillLibrary, turns: Sequence[FailedTurn], max_turn_chars: int | None = None
    ) -> list[dict[str, str]]:
        """The chat request: instructions, existing skills (name + description) and the failed turns."""
        limits = self.limits
        system = SYSTEM_PROMPT.format(max_proposals=limits.max_proposals, max_body_chars=limits.max_body_chars)
        existing = "\n".join(f"- {s.name}: {s.description}" for s in library.skills()) or "(none)"
        failures = "\n\n".join(t.render(max_turn_chars or self.limits.max_turn_chars) for t in turns)
        user = f"## Existing skills\n{existing}\n\n## Failed turns\n{failures}"
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def complete(self, messages: list[dict[str, str]]) -> str:
        """`POST /v1/chat/completions` through the one outbound client (`metaclaw.wire.client.chat`, the SDK's
        retry policy: transport errors, read timeouts, 429 and 5xx are retried); return the reply text.

        Raises:
            ContextTooLong: the endpoint refused the failed turns as longer than its context.
            RuntimeError: when every attempt failed or the response has no message content.
        """
        payload: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature,
                                   **self.thinking.fields(self.max_tokens)}  # fmt: skip
        try:
            reply = chat(self.endpoint, payload, self.timeout_s, self.max_retries)
        except Refused as exc:
            text = exc.response.text[:200]
            if exc.status_code == 429 or exc.status_code >= 500:
                raise RuntimeError(f"request failed after {self.max_retries + 1} attempts: HTTP {exc.status_code}: "
                                   f"{text}") from exc  # fmt: skip
            error = ContextTooLong if "context_length_exceeded" in text else RuntimeError
            raise error(f"HTTP {exc.status_code}: {text}") from exc
        except (CallError, ValueError) as exc:
            raise RuntimeError(f"request failed after {self.max_retries + 1} attempts: {exc!r}") from exc
        try:
            answer, reasoning = answer_and_reasoning(reply["choices"][0]["message"])
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"unexpected response shape: {exc!r}") from exc
        return answer or reasoning

    # ------------------------------------------------------------------ evolve
    def evolve(
        self, agent_id: str = DEFAULT_AGENT_ID, failed_turns: Sequence[FailedTurn | Mapping[str, Any]] = ()
    ) -> EvolutionResult:
        """Propose, validate and apply skill changes for `agent_id` from its failed turns; never raises on bad output.

        Raises:
            ValueError: only for an invalid `agent_id`.
        """
        library = SkillLibrary(self.root, agent_id, seed_bank=self.seed_bank)
        turns = [t for t in map(FailedTurn.coerce, failed_turns) if t.reward <= 0][-self.limits.max_turns :]
        result = EvolutionResult(generation=library.generation)
        if not turns:
            return result
        if not library.agent_dir.is_dir() and self._agent_count() >= self.max_agents:
            result.error = f"the skills root holds {self.max_agents} agents (skills.evolver.max_agents)"
            logger.warning("skill evolution for agent %r refused: %s", agent_id, result.error)
            return result
        sources = [t.sample_id for t in turns]
        sessions = sorted({t.session_id for t in turns if t.session_id})
        source_text = "\n".join(turn_text(t) for t in turns)
        auto = self.approval == "auto_safe" and agent_id != DEFAULT_AGENT_ID

        def log(action: str, name: str | None, accepted: bool, reason: str, **more: Any) -> dict[str, Any]:
            entry = dict(action=action, name=name, source_sample_ids=sources, accepted=accepted, reason=reason, **more)
            if sessions:
                entry["source_session_ids"] = sessions
            if accepted:
                entry["generation"] = library.generation
            library.append_history(entry)
            (result.quarantined if more.get("quarantined") else result.accepted if accepted else result.rejected
             ).append(entry)  # fmt: skip
            return entry

        try:
            raw = parse_reply(self._complete_within_context(library, turns, agent_id))
        except (RuntimeError, ProposalError) as exc:
            result.error = str(exc)
            logger.warning("skill evolution for agent %r refused the reply: %s", agent_id, exc)
            log("request" if isinstance(exc, RuntimeError) else "parse", None, False, str(exc))
            return result

        seen: set[str] = set()
        for i, item in enumerate(raw):
            action = item.get("action", "?") if isinstance(item, dict) else "?"
            name = item.get("name") if isinstance(item, dict) else None
            if i >= self.limits.max_proposals:
                log(str(action), name, False, f"over the limit of {self.limits.max_proposals} proposals per call")
                continue
            try:
                prop = validate_proposal(item, self.limits.max_description_chars, self.limits.max_body_chars)
                if prop.skill.name in seen:
                    raise ProposalError(f"duplicate name {prop.skill.name!r} within the reply")
                check_untrusted((prop.skill.description, prop.skill.body), source_text)
                self._check_duplicates(library, prop.action, prop.skill)
                skill = self._with_provenance(prop.skill, prop.action, agent_id, sources, sessions, auto)
                if not auto:
                    library.quarantine(skill)
                elif prop.action == "add":
                    library.add(skill)
                else:
                    library.edit(skill)
            except (ProposalError, UntrustedContentError, ValueError, KeyError, OSError) as exc:
                reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
                log(str(action), name, False, reason)
                continue
            seen.add(prop.skill.name)
            if auto:
                log(prop.action, prop.skill.name, True, "ok (approval: auto_safe)")
            else:
                why = "the shared default agent is never auto-approved" if self.approval == "auto_safe" else "manual"
                log(prop.action, prop.skill.name, False, f"quarantined: awaits review ({why}); python -m metaclaw "
                    f"skills approve {prop.skill.name} --agent {agent_id}", quarantined=True)  # fmt: skip
                logger.warning("skill %r for agent %r awaits review: python -m metaclaw skills approve %s --agent %s",
                               prop.skill.name, agent_id, prop.skill.name, agent_id)  # fmt: skip
        result.generation = library.generation
        return result

    def _agent_count(self) -> int:
        try:
            return sum(1 for e in os.scandir(self.root) if e.is_dir() and e.name not in (SHARED_POOL,)
                       and not e.name.startswith("."))  # fmt: skip
        except OSError:
            return 0

    @staticmethod
    def _with_provenance(
        skill: Skill, action: str, agent_id: str, sources: list, sessions: list[str], auto: bool
    ) -> Skill:
        """The skill with where it came from in its front matter (what `forget` looks for) and its review state."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        extra = {
            "status": "approved" if auto else "quarantined",
            **({"approved_by": "auto_safe", "approved_at": now} if auto else {}),
            "provenance": {"evolved_for_agent": agent_id, "action": action, "proposed_at": now,
                           "source_sample_ids": list(sources), "source_session_ids": list(sessions)},
        }  # fmt: skip
        return Skill(skill.name, skill.description, skill.category, skill.body, extra=extra)

    def _complete_within_context(self, library: SkillLibrary, turns: list[FailedTurn], agent_id: str) -> str:
        """`complete`, retried smaller while the endpoint says the request overflows its model's context: first
        the older half of the failed turns is left out, then (one turn left) its text is halved, down to
        `MIN_TURN_CHARS`. A small model (the embedded one has 2,048 tokens) gets what fits, not a 400."""
        max_chars = self.limits.max_turn_chars
        while True:
            try:
                return self.complete(self.build_messages(library, turns, max_chars))
            except ContextTooLong as exc:
                if len(turns) > 1:
                    turns = turns[len(turns) // 2 :]
                elif max_chars // 2 >= MIN_TURN_CHARS:
                    max_chars //= 2
                else:
                    raise
                logger.info(
                    "skill evolution for agent %r: request over the model's context (%s); retrying with %d failed "
                    "turns of at most %d characters",
                    agent_id,
                    exc,
                    len(turns),
                    max_chars,
                )

    def _check_duplicates(self, library: SkillLibrary, action: str, skill: Skill) -> None:
        """Refuse an add of a known name, an edit of an unknown one, or text too similar to another skill."""
        existing = library.get(skill.name)
        if action == "add" and existing is not None:
            raise ProposalError(f"duplicate: a skill named {skill.name!r} already exists")
        if library.get_pending(skill.name) is not None:
            raise ProposalError(f"duplicate: a skill named {skill.name!r} already awaits review")
        if action == "edit" and existing is None:
            raise ProposalError(f"edit of unknown skill {skill.name!r}")
        others = [s for s in library.skills() if s.name != skill.name]
        if not others:
            return
        sims = self.ranker.similarity(skill.search_text, others)
        best = max(range(len(others)), key=lambda j: sims[j])
        if sims[best] >= self.threshold:
            raise ProposalError(
                f"duplicate: too similar to existing skill {others[best].name!r} "
                f"(similarity {sims[best]:.2f} >= {self.threshold:.2f})"
            )
