"""Per-agent skill libraries on disk.

Layout under a skills root::

    <root>/_shared/<skill>/SKILL.md        pool every agent sees (seeded from the starter bank on first use)
    <root>/<agent_id>/<skill>/SKILL.md     the agent's own skills; a name here overrides the shared one
    <root>/<agent_id>/.metaclaw/           generation counter, evolution history, hidden shared skills
    <root>/<agent_id>/.metaclaw/quarantine/<skill>/SKILL.md   evolved skills awaiting approval (never injected)

An agent never sees another agent's folder. Writes go to a temp path and are renamed into place. The tree holds
conversation-derived text: folders are created 0700 and files 0600.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from metaclaw.atomic import write_file_atomically
from metaclaw.skills.skill import SKILL_FILE, Skill, SkillFormatError, validate_agent_id, validate_skill_name

logger = logging.getLogger(__name__)

SHARED_POOL = "_shared"
META_DIR = ".metaclaw"
QUARANTINE_DIR = "quarantine"
DEFAULT_AGENT_ID = "default"


def default_root() -> Path:
    """`$METACLAW_SKILLS_ROOT`, else `~/.metaclaw/skills`."""
    return Path(os.environ.get("METACLAW_SKILLS_ROOT", Path.home() / ".metaclaw" / "skills")).expanduser()


def bank_dir() -> Path:
    """The starter bank shipped inside the package."""
    return Path(str(resources.files("metaclaw.skills") / "bank"))


def private_mkdir(path: Path) -> None:
    """`mkdir -p` with mode 0700 for every folder it creates (skills hold conversation-derived text)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another thread made it first
            folder.mkdir(mode=0o700)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temp file (0600) next to `path`, fsync it and rename it over `path`."""
    private_mkdir(path.parent)
    write_file_atomically(path, text)


def load_pool(directory: Path, source: str) -> dict[str, Skill]:
    """Load every `<directory>/<x>/SKILL.md`; malformed files are skipped with a warning naming the file."""
    skills: dict[str, Skill] = {}
    if not directory.is_dir():
        return skills
    for child in sorted(directory.iterdir()):
        skill_file = child / SKILL_FILE
        if child.name.startswith(".") or not skill_file.is_file():
            continue
        try:
            skill = Skill.from_file(skill_file, source=source)
        except SkillFormatError as exc:
            logger.warning("skipping malformed skill file %s: %s", skill_file, exc)
            continue
        if skill.name in skills:
            logger.warning("skipping %s: duplicate skill name %r", skill_file, skill.name)
            continue
        skills[skill.name] = skill
    return skills


def seed_shared_pool(root: Path, bank: Path | None = None) -> Path:
    """Copy the starter bank into `<root>/_shared` if that folder does not exist yet; return the folder."""
    shared = Path(root) / SHARED_POOL
    if shared.exists():
        return shared
    src = bank or bank_dir()
    private_mkdir(shared.parent)
    tmp = shared.parent / f".{SHARED_POOL}.{uuid.uuid4().hex}.tmp"
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("__pycache__", "*.py", "*.pyc"))
    try:
        os.rename(tmp, shared)
        logger.info("seeded shared skill pool %s from %s", shared, src)
    except OSError:  # another process seeded it first
        shutil.rmtree(tmp, ignore_errors=True)
    return shared


class SkillLibrary:
    """The skills one agent sees: its own folder over the shared pool.

    Reads are cached and reloaded when a `SKILL.md` file's mtime/size changes; writes are atomic and bump a
    persisted per-agent generation counter that the proxy records with later samples.

    Args:
        root: skills root holding `_shared/` and one folder per agent.
        agent_id: the agent whose view this is (validated slug; `default` when omitted).
        seed_bank: copy the packaged starter bank into `_shared/` if it is absent.
    """

    def __init__(self, root: str | os.PathLike[str], agent_id: str = DEFAULT_AGENT_ID, seed_bank: bool = True) -> None:
        self.agent_id = validate_agent_id(agent_id)
        self.root = Path(root).expanduser()
        self.agent_dir = self.root / self.agent_id
        self.shared_dir = seed_shared_pool(self.root) if seed_bank else self.root / SHARED_POOL
        self.meta_dir = self.agent_dir / META_DIR
        self.quarantine_dir = self.meta_dir / QUARANTINE_DIR
        self._lock = threading.RLock()
        self._signature: tuple[Any, ...] | None = None
        self._skills: dict[str, Skill] = {}

    # ---------------------------------------------------------------- reading
    def _stat_signature(self) -> tuple[Any, ...]:
        parts: list[Any] = []
        for pool in (self.shared_dir, self.agent_dir):
            try:
                children = sorted(os.scandir(pool), key=lambda e: e.name)
            except OSError:
                parts.append(None)
                continue
            for entry in children:
                if entry.name.startswith("."):
                    continue
                try:
                    st = os.stat(os.path.join(entry.path, SKILL_FILE))
                except OSError:
                    continue
                parts.append((pool.name, entry.name, st.st_ino, st.st_mtime_ns, st.st_size))
        try:
            parts.append(os.stat(self.meta_dir / "hidden.json").st_mtime_ns)
        except OSError:
            parts.append(None)
        return tuple(parts)

    def reload(self, force: bool = False) -> bool:
        """Reload from disk if any skill file changed (or always with `force`); return whether it reloaded."""
        with self._lock:
            signature = self._stat_signature()
            if not force and signature == self._signature:
                return False
            hidden = self.hidden()
            merged = {n: s for n, s in load_pool(self.shared_dir, "shared").items() if n not in hidden}
            merged.update(load_pool(self.agent_dir, "agent"))
            self._skills, self._signature = merged, signature
            return True

    def skills(self) -> list[Skill]:
        """All skills this agent sees, sorted by name (reloaded first if files changed)."""
        self.reload()
        return sorted(self._skills.values(), key=lambda s: s.name)

    def get(self, name: str) -> Skill | None:
        """The skill called `name`, or None."""
        self.reload()
        return self._skills.get(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __len__(self) -> int:
        return len(self.skills())

    def hidden(self) -> set[str]:
        """Shared skills this agent removed from its own view."""
        try:
            return set(json.loads((self.meta_dir / "hidden.json").read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return set()

    # ---------------------------------------------------------------- writing
    def add(self, skill: Skill) -> Skill:
        """Create a new agent skill; raises ValueError if the agent already sees one with that name."""
        validate_skill_name(skill.name)
        with self._lock:
            if self.get(skill.name) is not None:
                raise ValueError(f"skill {skill.name!r} already exists for agent {self.agent_id!r}")
            return self._write(skill)

    def edit(self, skill: Skill) -> Skill:
        """Replace an existing skill; editing a shared skill writes an agent-level override (copy on write)."""
        validate_skill_name(skill.name)
        with self._lock:
            if self.get(skill.name) is None:
                raise KeyError(f"no skill {skill.name!r} for agent {self.agent_id!r}")
            return self._write(skill)

    def remove(self, name: str) -> None:
        """Remove a skill from this agent's view (deletes its own copy; hides a shared one)."""
        validate_skill_name(name)
        with self._lock:
            if self.get(name) is None:
                raise KeyError(f"no skill {name!r} for agent {self.agent_id!r}")
            own = self.agent_dir / name
            if own.is_dir():
                trash = self.agent_dir / f".trash-{name}-{uuid.uuid4().hex}"
                os.rename(own, trash)
                shutil.rmtree(trash, ignore_errors=True)
            if (self.shared_dir / name / SKILL_FILE).is_file():
                self._set_hidden(self.hidden() | {name})
            self._bump_generation()
            self.reload(force=True)

    def _write(self, skill: Skill) -> Skill:
        target = self.agent_dir / skill.name
        text = skill.to_markdown()
        if target.is_dir():
            atomic_write_text(target / SKILL_FILE, text)
        else:
            private_mkdir(self.agent_dir)
            tmp = self.agent_dir / f".tmp-{skill.name}-{uuid.uuid4().hex}"
            tmp.mkdir(mode=0o700)
            try:
                atomic_write_text(tmp / SKILL_FILE, text)
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if skill.name in self.hidden():
            self._set_hidden(self.hidden() - {skill.name})
        self._bump_generation()
        self.reload(force=True)
        return self._skills[skill.name]

    # ---------------------------------------------------------------- review (quarantine)
    def quarantine(self, skill: Skill) -> Path:
        """Park an evolved skill for review: it is written under `.metaclaw/quarantine/` (never injected, not
        counted as a change: the generation stays) until `approve` moves it into the agent's view."""
        validate_skill_name(skill.name)
        with self._lock:
            path = self.quarantine_dir / skill.name / SKILL_FILE
            atomic_write_text(path, skill.to_markdown())
            return path

    def pending(self) -> list[Skill]:
        """The skills awaiting review, sorted by name."""
        return sorted(load_pool(self.quarantine_dir, "quarantined").values(), key=lambda s: s.name)

    def get_pending(self, name: str) -> Skill | None:
        validate_skill_name(name)
        path = self.quarantine_dir / name / SKILL_FILE
        return Skill.from_file(path, source="quarantined") if path.is_file() else None

    def approve(self, name: str, by: str = "human") -> Skill:
        """Serve a quarantined skill: it replaces (or adds) the agent's own copy; the generation is bumped.

        Raises:
            KeyError: no such skill awaits review.
        """
        with self._lock:
            pending = self.get_pending(name)
            if pending is None:
                raise KeyError(f"no quarantined skill {name!r} for agent {self.agent_id!r}")
            extra = {**pending.extra, "status": "approved", "approved_by": by,
                     "approved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            skill = Skill(pending.name, pending.description, pending.category, pending.body, extra=extra)
            written = self._write(skill)
            self._discard_pending(name)
            return written

    def reject(self, name: str) -> None:
        """Drop a quarantined skill.

        Raises:
            KeyError: no such skill awaits review.
        """
        with self._lock:
            if self.get_pending(name) is None:
                raise KeyError(f"no quarantined skill {name!r} for agent {self.agent_id!r}")
            self._discard_pending(name)

    def _discard_pending(self, name: str) -> None:
        folder = self.quarantine_dir / name
        trash = self.quarantine_dir / f".trash-{name}-{uuid.uuid4().hex}"
        os.rename(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _set_hidden(self, names: Iterable[str]) -> None:
        atomic_write_text(self.meta_dir / "hidden.json", json.dumps(sorted(names)))

    # ---------------------------------------------------------------- generation + history
    @property
    def generation(self) -> int:
        """Persisted count of accepted changes to this agent's skills (0 before the first)."""
        try:
            return int(json.loads((self.meta_dir / "generation.json").read_text(encoding="utf-8"))["generation"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def _bump_generation(self) -> int:
        value = self.generation + 1
        atomic_write_text(self.meta_dir / "generation.json", json.dumps({"generation": value, "ts": time.time()}))
        return value

    @property
    def history_path(self) -> Path:
        """JSONL evolution history of this agent."""
        return self.meta_dir / "history.jsonl"

    def append_history(self, entry: dict[str, Any]) -> None:
        """Append one JSON line (timestamped) to the agent's evolution history."""
        record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry}
        private_mkdir(self.meta_dir)
        fd = os.open(self.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with self._lock, open(fd, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def history(self) -> list[dict[str, Any]]:
        """All history entries, oldest first; unreadable lines are skipped."""
        try:
            lines = self.history_path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                logger.warning("skipping unreadable history line in %s", self.history_path)
        return out
