"""The copies of forgotten turns outside their own rows (issue 43): the skills evolved from them (approved and
quarantined) and the evolution history that quotes them, other turns whose prompts carried such a skill, and the
run's text files (logs, evaluation records) that quote their words.

Text files are scrubbed line by line: a line is dropped when it shares a run of `QUOTE_WORDS` words, or one
identifier-like token of 12+ characters (a marker, an id, a key), with a forgotten turn. Files are rewritten
atomically (a temp file renamed over the original: no old block of the file stays reachable through it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

QUOTE_WORDS = 6
TEXT_FILES = ("*.log", "*.jsonl", "*.txt", "*.out")  # what a run dir holds as text (train.log, eval.jsonl, ...)
MAX_SCRUB_BYTES = 512 << 20  # a larger text file is named in the report, not rewritten
_WORD = re.compile(r"\w+")
_TOKEN = re.compile(r"[A-Za-z0-9_\-]{12,}")


def sample_texts(messages: str | None, response: str | None, next_state: str | None) -> list[str]:
    """The text of one stored sample row (messages JSON, reply, next state)."""
    out = [t for t in (response, next_state) if t]
    try:
        value: Any = json.loads(messages) if messages else []
    except ValueError:
        value = messages
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


class Quotes:
    """What marks a line as quoting forgotten text: word runs and identifier-like tokens of those texts."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.runs: set[tuple[str, ...]] = set()
        self.tokens: set[str] = set()
        for text in texts:
            words = _WORD.findall(text.lower())
            self.runs.update(tuple(words[i : i + QUOTE_WORDS]) for i in range(len(words) - QUOTE_WORDS + 1))
            self.tokens.update(t for t in _TOKEN.findall(text) if any(c.isdigit() for c in t)
                               and any(c.isalpha() for c in t))  # fmt: skip

    def __bool__(self) -> bool:
        return bool(self.runs or self.tokens)

    def quoted(self, line: str) -> bool:
        if self.tokens and any(t in self.tokens for t in _TOKEN.findall(line)):
            return True
        words = _WORD.findall(line.lower())
        return any(tuple(words[i : i + QUOTE_WORDS]) in self.runs for i in range(len(words) - QUOTE_WORDS + 1))


def scrub_text_files(root: Path, quotes: Quotes, skip: Iterable[Path] = ()) -> tuple[list[str], list[str]]:
    """Drop the lines of `root`'s text files (recursively, links not followed) that quote forgotten text.
    Returns the files changed and the ones too large to rewrite (named for the user)."""
    changed: list[str] = []
    too_large: list[str] = []
    skipped = {p.resolve() for p in skip}
    if not quotes or not root.is_dir():
        return changed, too_large
    for pattern in TEXT_FILES:
        for path in sorted(root.rglob(pattern)):
            if path.is_symlink() or not path.is_file() or path.resolve() in skipped:
                continue
            if path.stat().st_size > MAX_SCRUB_BYTES:
                too_large.append(str(path))
                continue
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
            lines = text.splitlines(keepends=True)
            kept = [line for line in lines if not quotes.quoted(line)]
            if len(kept) != len(lines):
                _rewrite(path, "".join(kept))
                changed.append(str(path))
    return changed, too_large


def _rewrite(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def skills_from(skills_root: Path, by_agent: Mapping[str, set[int]]) -> dict[str, set[str]]:
    """Per agent, the skill names an evolution made from a forgotten sample: served, quarantined or proposed
    (`history.jsonl`'s `source_sample_ids`, and the provenance in each skill file's front matter)."""
    from metaclaw.skills.library import SkillLibrary

    found: dict[str, set[str]] = {}
    for agent, ids in by_agent.items():
        if not (skills_root / agent).is_dir():
            continue
        library = SkillLibrary(skills_root, agent, seed_bank=False)
        names = {e["name"] for e in library.history() if isinstance(e.get("name"), str) and _from(e, ids)}
        for folder in (skills_root / agent, library.quarantine_dir):
            if folder.is_dir():
                names |= {d.name for d in folder.iterdir() if front_matter_sources(d / "SKILL.md") & ids}
        if names:
            found[agent] = names
    return found


def _from(entry: Mapping[str, Any], ids: set[int]) -> bool:
    return bool(ids.intersection(s for s in entry.get("source_sample_ids") or [] if isinstance(s, int)))


def remove_skills(skills_root: Path, names: Mapping[str, set[str]], by_agent: Mapping[str, set[int]]) -> list[str]:
    """Remove the skills `skills_from` named (served and quarantined copies) and the history entries that came
    from forgotten samples or name those skills (their reasons quote proposals). Returns `agent/name` removed."""
    from metaclaw.skills.library import SkillLibrary

    removed = []
    for agent, agent_names in names.items():
        library = SkillLibrary(skills_root, agent, seed_bank=False)
        for name in sorted(agent_names):
            gone = False
            for folder, drop in ((skills_root / agent / name, library.remove), (library.quarantine_dir / name,
                                                                                 library.reject)):  # fmt: skip
                if folder.is_dir():
                    try:
                        drop(name)  # the served copy: the generation is bumped, so injectors reload
                    except KeyError:
                        shutil.rmtree(folder, ignore_errors=True)
                    gone = True
            if gone:
                removed.append(f"{agent}/{name}")
        history = library.history_path
        if history.is_file():
            ids = by_agent.get(agent, set())
            kept = [e for e in library.history() if not _from(e, ids) and e.get("name") not in agent_names]
            _rewrite(history, "".join(json.dumps(e) + "\n" for e in kept))
    return removed


def front_matter_sources(path: Path) -> set[int]:
    """`source_sample_ids` from a SKILL.md front matter (the evolver's `provenance`, or at the top level)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
        meta = yaml.safe_load(text.split("---", 2)[1]) if text.startswith("---") else None
    except (OSError, IndexError, yaml.YAMLError):
        return set()
    if not isinstance(meta, dict):
        return set()
    for holder in (meta, meta.get("provenance")):
        if isinstance(holder, dict):
            ids = holder.get("source_sample_ids", holder.get("sample_ids"))
            if isinstance(ids, list):
                return {i for i in ids if isinstance(i, int) and not isinstance(i, bool)}
    return set()


def injected_copies(rows: Iterable[tuple[int, str, str | None]], names: Mapping[str, set[str]]) -> set[int]:
    """Ids of the samples (rows of `id, agent_id, meta JSON`) whose prompt carried a skill in `names`."""
    out = set()
    for sample_id, agent, meta in rows:
        wanted = names.get(agent)
        if not wanted or not meta:
            continue
        try:
            skills = json.loads(meta).get("skills") or []
        except (ValueError, AttributeError):
            continue
        if wanted.intersection(s for s in skills if isinstance(s, str)):
            out.add(sample_id)
    return out
