"""Parse and validate the skill proposals an LLM returns during evolution."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from metaclaw.skills.skill import DEFAULT_CATEGORY, Skill, validate_skill_name

_FENCE_RE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
_CATEGORY_RE = re.compile(r"^[a-z0-9]+(?:[-_][a-z0-9]+)*$")
ACTIONS = ("add", "edit")


class ProposalError(ValueError):
    """An LLM reply or one proposal in it that does not meet the schema."""


@dataclass(frozen=True)
class Proposal:
    """One proposed change: `add` a new skill or `edit` an existing one."""

    action: str
    skill: Skill


def parse_reply(text: str) -> list[dict[str, Any]]:
    """The `skills` list of an LLM reply `{"skills": [...]}`, tolerating ```json fences and <think> blocks.

    Raises:
        ProposalError: when no JSON object can be decoded or it has no `skills` list.
    """
    text = _THINK_RE.sub("", text or "").strip()
    candidates = [m.group(1).strip() for m in _FENCE_RE.finditer(text)]
    candidates.append(text)
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{") : text.rindex("}") + 1])
    errors = []
    for candidate in candidates:
        try:
            data = json.loads(candidate)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("skills"), list):
            raise ProposalError('reply JSON must be an object with a "skills" list')
        return data["skills"]
    head = " ".join(text.split())[:120]
    raise ProposalError(f"reply is not valid JSON ({errors[-1] if errors else 'empty reply'}); it began: {head!r}")


def validate_proposal(
    raw: Any, max_description_chars: int = 300, max_body_chars: int = 4000, min_body_chars: int = 20
) -> Proposal:
    """Check one raw proposal against the schema and limits and turn it into a `Proposal`.

    Raises:
        ProposalError: naming the offending field.
    """
    if not isinstance(raw, dict):
        raise ProposalError("proposal must be a JSON object")
    action = raw.get("action")
    if action not in ACTIONS:
        raise ProposalError(f"action must be one of {ACTIONS} (got {action!r})")
    try:
        name = validate_skill_name(raw.get("name"))
    except ValueError as exc:
        raise ProposalError(str(exc)) from exc
    if len(name) < 3:
        raise ProposalError(f"name must be at least 3 characters (got {name!r})")
    description = raw.get("description")
    if not isinstance(description, str) or not description.strip():
        raise ProposalError("description must be a non-empty string")
    description = " ".join(description.split())
    if len(description) > max_description_chars:
        raise ProposalError(f"description is {len(description)} chars; the limit is {max_description_chars}")
    category = raw.get("category") or DEFAULT_CATEGORY
    if not isinstance(category, str) or not _CATEGORY_RE.match(category.strip().lower()) or len(category) > 40:
        raise ProposalError(f"category must be a short lowercase slug (got {category!r})")
    body = raw.get("body")
    if not isinstance(body, str) or len(body.strip()) < min_body_chars:
        raise ProposalError(f"body must be a string of at least {min_body_chars} characters")
    if len(body) > max_body_chars:
        raise ProposalError(f"body is {len(body)} chars; the limit is {max_body_chars}")
    if body.lstrip().startswith("---"):
        raise ProposalError("body must not contain front matter")
    skill = Skill(name=name, description=description, category=category.strip().lower(), body=body.strip())
    return Proposal(action=action, skill=skill)
