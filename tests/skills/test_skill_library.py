"""SkillLibrary: seeding, per-agent isolation, atomic edits, reload, malformed files, agent id validation."""

from __future__ import annotations

import logging
import os

import pytest

from metaclaw.skills import Skill, SkillInjector, SkillLibrary, bank_dir
from metaclaw.skills.library import SHARED_POOL


def test_starter_bank_seeds_shared_pool(root):
    lib = SkillLibrary(root)
    bank = {p.name for p in bank_dir().iterdir() if (p / "SKILL.md").is_file()}
    assert len(bank) >= 10
    assert {s.name for s in lib.skills()} == bank
    assert (root / SHARED_POOL / "safe-shell-commands" / "SKILL.md").is_file()
    assert all(s.description and s.body and s.category for s in lib.skills())


def test_existing_metaclaw_bank_format_loads(root):
    # MetaClaw's own banks have only name + description (quoted) in the front matter
    d = root / SHARED_POOL / "debug-systematically"
    d.mkdir(parents=True)
    (d / "SKILL.md").write_text(
        '---\nname: debug-systematically\ndescription: "Use this when a test fails."\n---\n\n'
        "# Debug Systematically\n\n1. Reproduce\n"
    )
    lib = SkillLibrary(root)  # _shared exists, so it is not re-seeded
    (skill,) = lib.skills()
    assert skill.name == "debug-systematically" and skill.category == "general" and skill.body.startswith("# Debug")


def test_agents_are_isolated(root):
    a, b = SkillLibrary(root, "alice"), SkillLibrary(root, "bob")
    a.add(Skill("alice-only-rule", "Alice's private preference for commit messages.", "style", "Use imperative mood."))
    assert "alice-only-rule" in a and "alice-only-rule" not in b
    assert a.generation == 1 and b.generation == 0
    injector = SkillInjector(root)
    _, names = injector.inject([{"role": "user", "content": "private preference commit messages imperative"}], "bob")
    assert "alice-only-rule" not in names
    _, names = injector.inject([{"role": "user", "content": "private preference commit messages imperative"}], "alice")
    assert "alice-only-rule" in names


def test_edit_shared_skill_is_copy_on_write_and_remove_hides(root):
    a, b = SkillLibrary(root, "alice"), SkillLibrary(root, "bob")
    old = a.get("safe-shell-commands")
    a.edit(Skill(old.name, old.description, old.category, old.body + "\n- Alice: never touch /srv."))
    assert a.get("safe-shell-commands").source == "agent"
    assert "/srv" not in b.get("safe-shell-commands").body
    a.remove("safe-shell-commands")
    assert "safe-shell-commands" not in a and "safe-shell-commands" in b
    assert a.generation == 2
    with pytest.raises(KeyError):
        a.remove("safe-shell-commands")
    with pytest.raises(ValueError, match="already exists"):
        a.add(b.get("plan-multi-step-tasks"))


def test_reload_when_file_changes_and_no_temp_leftovers(root):
    lib = SkillLibrary(root, "alice")
    lib.add(Skill("rotate-logs", "Rotate logs.", "ops", "Use logrotate."))
    path = root / "alice" / "rotate-logs" / "SKILL.md"
    path.write_text(path.read_text().replace("Use logrotate.", "Use logrotate daily."))
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse-clock filesystems
    assert lib.get("rotate-logs").body == "Use logrotate daily."
    assert not [p for p in (root / "alice").iterdir() if p.name.startswith(".tmp")]


def test_malformed_skill_skipped_with_warning(root, caplog):
    SkillLibrary(root)
    bad = {
        "no-front-matter": "# just markdown\n",
        "bad-yaml": "---\nname: [unclosed\n---\nbody\n",
        "no-name": "---\ndescription: nameless\n---\nbody\n",
        "bad-name": "---\nname: ../../etc\n---\nbody\n",
        "not-mapping": "---\n- a\n- b\n---\nbody\n",
    }
    for folder, text in bad.items():
        (root / SHARED_POOL / folder).mkdir()
        (root / SHARED_POOL / folder / "SKILL.md").write_text(text)
    with caplog.at_level(logging.WARNING, logger="metaclaw.skills.library"):
        lib = SkillLibrary(root)
        names = {s.name for s in lib.skills()}
    assert len(names) >= 10 and not names & set(bad)
    for folder in bad:
        assert any(f"{folder}/SKILL.md" in r.getMessage() for r in caplog.records), folder


@pytest.mark.parametrize("agent_id", ["../x", "a/b", "..", ".", "", "_shared", "x" * 65, "a b", "/etc", "a\\b"])
def test_path_trick_agent_ids_rejected(root, agent_id):
    with pytest.raises(ValueError, match="agent_id"):
        SkillLibrary(root, agent_id)
    assert not (root / "x").exists()


def test_skill_names_validated(root):
    lib = SkillLibrary(root, "alice")
    with pytest.raises(ValueError, match="name"):
        lib.add(Skill("../escape", "desc", "x", "body"))
    assert not (root / "escape").exists()
