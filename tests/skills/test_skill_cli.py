"""`python -m metaclaw.skills` subcommands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metaclaw.skills import Skill, SkillLibrary
from metaclaw.skills.cli import main


def test_list_show_remove_history(root, capsys):
    SkillLibrary(root, "alice").add(Skill("rotate-logs", "Rotate logs daily.", "ops", "Use logrotate."))
    assert main(["--root", str(root), "--agent", "alice", "list"]) == 0
    out = capsys.readouterr().out
    assert "rotate-logs" in out and "safe-shell-commands" in out and "generation 1" in out

    assert main(["show", "rotate-logs", "--root", str(root), "--agent", "alice"]) == 0
    assert "name: rotate-logs" in capsys.readouterr().out
    assert main(["--root", str(root), "show", "rotate-logs"]) == 1  # other agent: not visible

    assert main(["--root", str(root), "--agent", "alice", "remove", "rotate-logs"]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["--root", str(root), "--agent", "alice", "history"]) == 0
    out = capsys.readouterr().out
    assert "remove" in out and "rotate-logs" in out and "accepted" in out
    assert main(["--root", str(root), "--agent", "alice", "remove", "rotate-logs"]) == 1


def test_bad_agent_is_a_usage_error(root, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--root", str(root), "--agent", "../x", "list"])
    assert exc.value.code == 2 and "agent_id" in capsys.readouterr().err


def test_module_entry_point(root):
    proc = subprocess.run(
        [sys.executable, "-m", "metaclaw.skills", "--root", str(root), "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "skills for agent 'default'" in proc.stdout
