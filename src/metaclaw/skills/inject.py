"""Inject the skills relevant to the latest user message into the system prompt of a chat request."""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from metaclaw.skills.library import DEFAULT_AGENT_ID, SkillLibrary, default_root
from metaclaw.skills.query import extract_query
from metaclaw.skills.ranking import BM25Ranker, SkillRanker
from metaclaw.skills.skill import Skill, validate_agent_id

HEADER = "## Active skills"
PREAMBLE = "Follow these when they apply to the request:"
_LEADING_TITLE_RE = re.compile(r"\A#{1,6} [^\n]*\n+")  # the body's own title repeats the skill name


def _truncate(text: str, limit: int) -> str:
    """Drop blank lines, then cut at a word boundary to at most `limit` chars (marked with an ellipsis)."""
    text = "\n".join(line.rstrip() for line in text.splitlines() if line.strip())
    if len(text) <= limit:
        return text
    if limit <= 1:
        return ""
    cut = text[: limit - 1]
    boundary = max(cut.rfind(" "), cut.rfind("\n"))
    return (cut[:boundary] if boundary > limit // 2 else cut).rstrip() + "…"


def render_block(skills: Sequence[Skill], max_chars: int) -> tuple[str, list[str]]:
    """The `## Active skills` block for `skills` (best first) within `max_chars`, and the names it holds.

    Each skill gets a `### name: description` line; bodies (without their own title) share what is left of the
    budget. Skills whose heading no longer fits are dropped from the end.
    """
    head = f"{HEADER}\n{PREAMBLE}"
    chosen: list[tuple[Skill, str]] = []
    used = len(head)
    for skill in skills:
        title = f"\n\n### {skill.name}" + (f": {skill.description}" if skill.description else "")
        if used + len(title) > max_chars:
            break
        chosen.append((skill, title))
        used += len(title)
    if not chosen:
        return "", []
    parts = [head]
    remaining = max_chars - used
    for i, (skill, title) in enumerate(chosen):
        share = remaining // (len(chosen) - i)
        body = _truncate(_LEADING_TITLE_RE.sub("", skill.body.strip()), max(0, share - 1))
        text = title + (f"\n{body}" if body else "")
        remaining -= len(text) - len(title)
        parts.append(text)
    return "".join(parts), [s.name for s, _ in chosen]


def add_to_system_prompt(messages: Sequence[Mapping[str, Any]], block: str) -> list[dict[str, Any]]:
    """A new message list with `block` appended to the first system message (or a new one prepended).

    The input list and its dicts are never mutated; list-of-parts content gets an extra text part.
    """
    out = [dict(m) for m in messages]
    for msg in out:
        if msg.get("role") in ("system", "developer"):
            content = msg.get("content")
            if isinstance(content, list):
                msg["content"] = [*content, {"type": "text", "text": block}]
            elif content:
                msg["content"] = f"{content}\n\n{block}"
            else:
                msg["content"] = block
            return out
    return [{"role": "system", "content": block}, *out]


class SkillInjector:
    """What the proxy calls on each request: retrieve the agent's relevant skills and add them to the prompt.

    Args:
        library_root: skills root (`_shared/` + one folder per agent); None means `default_root()`.
        ranker: a `SkillRanker`; defaults to `BM25Ranker()`.
        top_k: at most this many skills per request.
        max_chars: character budget of the injected block.
        strip_patterns: boilerplate regexes for `extract_query`; None means the defaults.
        seed_bank: seed `_shared/` from the packaged starter bank on first use.
        max_cached_agents: libraries kept in memory (least recently used dropped first; a dropped one is read
            from disk again when its agent comes back), so a client sending many `X-Agent-Id`s cannot grow it.
    """

    def __init__(
        self,
        library_root: str | os.PathLike[str] | None = None,
        ranker: SkillRanker | None = None,
        top_k: int = 3,
        max_chars: int = 2000,
        strip_patterns: Iterable[str] | None = None,
        seed_bank: bool = True,
        max_cached_agents: int = 256,
    ) -> None:
        if max_cached_agents < 1:
            raise ValueError(f"max_cached_agents must be >= 1 (got {max_cached_agents})")
        self.max_cached_agents = max_cached_agents
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {top_k})")
        if max_chars < 64:
            raise ValueError(f"max_chars must be >= 64 (got {max_chars})")
        self.root = Path(library_root).expanduser() if library_root is not None else default_root()
        self.ranker: SkillRanker = ranker if ranker is not None else BM25Ranker()
        self.top_k, self.max_chars, self.seed_bank = top_k, max_chars, seed_bank
        self.strip_patterns = None if strip_patterns is None else tuple(strip_patterns)
        self._libraries: OrderedDict[str, SkillLibrary] = OrderedDict()
        self._lock = threading.Lock()

    def library(self, agent_id: str = DEFAULT_AGENT_ID) -> SkillLibrary:
        """The (cached) library of `agent_id`; raises ValueError for an invalid id."""
        agent_id = validate_agent_id(agent_id or DEFAULT_AGENT_ID)
        with self._lock:
            lib = self._libraries.get(agent_id)
            if lib is None:
                lib = self._libraries[agent_id] = SkillLibrary(self.root, agent_id, seed_bank=self.seed_bank)
                while len(self._libraries) > self.max_cached_agents:
                    self._libraries.popitem(last=False)
            else:
                self._libraries.move_to_end(agent_id)
            return lib

    def retrieve(self, messages: Sequence[Mapping[str, Any]], agent_id: str = DEFAULT_AGENT_ID) -> list[Skill]:
        """The agent's skills most relevant to the latest user message, best first."""
        query = extract_query(messages, self.strip_patterns)
        skills = self.library(agent_id).skills()
        if not query or not skills or self.top_k == 0:
            return []
        return [s for s, _ in self.ranker.rank(query, skills, self.top_k)]

    def inject(
        self, messages: Sequence[Mapping[str, Any]], agent_id: str = DEFAULT_AGENT_ID
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Return (new messages with an `## Active skills` block in the system prompt, injected skill names).

        When nothing is relevant the messages come back as an unchanged copy and the name list is empty.
        """
        block, names = render_block(self.retrieve(messages, agent_id), self.max_chars)
        if not names:
            return [dict(m) for m in messages], []
        return add_to_system_prompt(messages, block), names

    def generation(self, agent_id: str = DEFAULT_AGENT_ID) -> int:
        """The agent's skill generation (bumped on every accepted change), for the proxy to record."""
        return self.library(agent_id).generation
