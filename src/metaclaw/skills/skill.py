"""The `Skill` record and the `SKILL.md` file format (YAML front matter + Markdown body).

The format is the one MetaClaw skill banks use, so an existing bank loads unchanged::

    ---
    name: verify-before-claiming-done
    description: Run the check that proves a change works before saying it is done.
    category: verification
    ---
    # Verify before claiming done
    ...
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from metaclaw.agents import check_agent_id

SKILL_FILE = "SKILL.md"
DEFAULT_CATEGORY = "general"

_SKILL_NAME_RE = re.compile(r"^[a-z0-9]+(?:[-_][a-z0-9]+)*$")
_FRONT_MATTER_RE = re.compile(r"\A\ufeff?---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)(.*)\Z", re.DOTALL)


class SkillFormatError(ValueError):
    """A `SKILL.md` file that cannot be parsed (bad front matter, missing name, ...)."""


def validate_skill_name(name: object, field_name: str = "name") -> str:
    """Return `name` if it is a valid skill slug (lowercase words joined by `-`/`_`, at most 64 chars).

    Raises:
        ValueError: naming `field_name` when the value is not a slug (this also rejects path tricks).
    """
    if not isinstance(name, str) or not _SKILL_NAME_RE.match(name) or len(name) > 64:
        raise ValueError(f"{field_name} must be a lowercase slug like 'read-error-messages' (got {name!r})")
    return name


def validate_agent_id(agent_id: object, field_name: str = "agent_id") -> str:
    """Return `agent_id` if it is a safe directory name (letters, digits, `-`, `_`; at most 64 chars).

    Raises:
        ValueError: naming `field_name` for anything else, e.g. `../x`, `a/b`, `_shared` or an empty string.
    """
    return check_agent_id(agent_id, field_name)  # one rule for the proxy's X-Agent-Id and the folders


@dataclass(frozen=True)
class Skill:
    """One skill: a short, named instruction that can be injected into a system prompt.

    Attributes:
        name: slug, also the folder name in a skill bank.
        description: one line saying when the skill applies (used for retrieval and in the injected block).
        category: free-form grouping such as `debugging` or `safety`.
        body: the Markdown instructions.
        path: the `SKILL.md` file it was loaded from, if any.
        source: which pool it came from (`agent`, `shared` or empty).
        extra: other front-matter keys, preserved when the skill is written back.
    """

    name: str
    description: str
    category: str = DEFAULT_CATEGORY
    body: str = ""
    path: Path | None = field(default=None, compare=False)
    source: str = field(default="", compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @cached_property
    def content_hash(self) -> str:
        """SHA-256 over the fields that retrieval and injection read; changes whenever the skill does."""
        text = "\x1f".join((self.name, self.description, self.category, self.body))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    @property
    def search_text(self) -> str:
        """The text rankers index: name words, description, category and body."""
        return f"{self.name.replace('-', ' ').replace('_', ' ')}. {self.description}\n{self.category}\n{self.body}"

    def to_markdown(self) -> str:
        """Render as a `SKILL.md` document."""
        meta: dict[str, Any] = {"name": self.name, "description": self.description, "category": self.category}
        meta.update({k: v for k, v in self.extra.items() if k not in meta})
        front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=10_000).strip()
        return f"---\n{front}\n---\n\n{self.body.strip()}\n"

    @classmethod
    def from_markdown(cls, text: str, path: Path | None = None, source: str = "") -> Skill:
        """Parse a `SKILL.md` document.

        Raises:
            SkillFormatError: when the front matter is missing or not a mapping, or `name` is missing/invalid.
        """
        where = str(path) if path else "<string>"
        match = _FRONT_MATTER_RE.match(text)
        if not match:
            raise SkillFormatError(f"{where}: missing YAML front matter delimited by '---' lines")
        try:
            meta = yaml.safe_load(match.group(1))
        except yaml.YAMLError as exc:
            raise SkillFormatError(f"{where}: invalid YAML front matter: {exc}") from exc
        if not isinstance(meta, dict):
            raise SkillFormatError(f"{where}: front matter must be a mapping")
        name = meta.pop("name", None)
        if not name:
            raise SkillFormatError(f"{where}: front matter has no 'name'")
        try:
            validate_skill_name(str(name))
        except ValueError as exc:
            raise SkillFormatError(f"{where}: {exc}") from exc
        description = meta.pop("description", "") or ""
        category = meta.pop("category", None)
        nested = meta.get("metadata")
        if category is None and isinstance(nested, dict):
            category = nested.get("category")
        return cls(
            name=str(name),
            description=" ".join(str(description).split()),
            category=str(category or DEFAULT_CATEGORY),
            body=match.group(2).strip(),
            path=path,
            source=source,
            extra=meta,
        )

    @classmethod
    def from_file(cls, path: Path, source: str = "") -> Skill:
        """Read and parse a `SKILL.md` file (see `from_markdown`)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SkillFormatError(f"{path}: cannot read: {exc}") from exc
        return cls.from_markdown(text, path=Path(path), source=source)
