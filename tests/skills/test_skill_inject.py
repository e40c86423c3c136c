"""Injection of the `## Active skills` block into OpenAI-format messages."""

from __future__ import annotations

import copy

import pytest

from metaclaw.skills import BM25Ranker, SkillInjector
from metaclaw.skills.inject import HEADER, render_block


def test_block_appended_to_existing_system_prompt_without_mutating_input(root):
    injector = SkillInjector(root, BM25Ranker(), top_k=2, max_chars=1500)
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Run rm -rf on the build directory and force push."},
    ]
    before = copy.deepcopy(messages)
    out, names = injector.inject(messages, "default")
    assert messages == before
    assert names and names[0] == "safe-shell-commands" and len(names) <= 2
    system = out[0]["content"]
    assert system.startswith("You are a coding agent.\n\n" + HEADER)
    assert all(f"### {n}:" in system for n in names)
    assert len(system) - len("You are a coding agent.\n\n") <= 1500
    assert out[1] == messages[1] and out[1] is not messages[1]


def test_system_message_prepended_when_absent(root):
    injector = SkillInjector(root)
    messages = [{"role": "user", "content": "please add unit tests for the parser"}]
    out, names = injector.inject(messages)
    assert out[0]["role"] == "system" and out[0]["content"].startswith(HEADER)
    assert out[1:] == messages and len(messages) == 1
    assert "write-tests-for-changes" in names


def test_list_of_parts_content(root):
    injector = SkillInjector(root, top_k=1)
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "[Mon 2026-01-05 10:00 UTC] the api key leaked in git"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
    ]
    before = copy.deepcopy(messages)
    out, names = injector.inject(messages)
    assert messages == before
    assert names == ["protect-secrets-and-credentials"]
    parts = out[0]["content"]
    assert parts[0] == {"type": "text", "text": "Be brief."}
    assert parts[-1]["type"] == "text" and parts[-1]["text"].startswith(HEADER)


def test_nothing_relevant_means_nothing_injected(root):
    injector = SkillInjector(root)
    messages = [{"role": "user", "content": "thanks!"}]
    out, names = injector.inject(messages)
    assert names == [] and out == messages


def test_block_respects_char_budget(root):
    injector = SkillInjector(root, top_k=5, max_chars=400)
    skills = injector.library().skills()[:5]
    block, names = render_block(skills, 400)
    assert len(block) <= 400 and names
    assert block.startswith(HEADER)
    small, small_names = render_block(skills, 40)
    assert small == "" and small_names == []


def test_generation_exposed_and_agent_id_validated(root):
    injector = SkillInjector(root)
    assert injector.generation("default") == 0
    with pytest.raises(ValueError, match="agent_id"):
        injector.inject([{"role": "user", "content": "x"}], "../other")
