"""Retrieval quality of both rankers on the labelled query set, and boilerplate stripping."""

from __future__ import annotations

import json

import pytest

from metaclaw.skills import BM25Ranker, SkillLibrary, extract_query
from metaclaw.skills.evaluation import evaluate_ranker, load_retrieval_cases

# Floors set a little below what was measured when the labels were first written (BM25 0.36, embedding 0.24;
# the best achievable precision@3 on this set is 0.41 because most queries have one relevant skill).
FLOORS = {"bm25": {"precision_at_3": 0.30, "hit_at_3": 0.80}, "embedding": {"precision_at_3": 0.20, "hit_at_3": 0.55}}

WRAP = (
    'Conversation info (untrusted metadata):\n```json\n{"chat_id": "telegram:42", "message_id": "7", '
    '"sender": "Ada", "is_group": false}\n```\n\nSender (untrusted metadata):\n```json\n{"label": "Ada (@ada)", '
    '"id": "42"}\n```\n<system-reminder>Use the tools in the workspace when needed; answer concisely; '
    "verify tests and errors; keep secrets safe; plan multi-step work.</system-reminder>\n"
    "[Telegram Ada (@ada) id:42 +1m Mon 2026-01-05 10:00 UTC] {q}\n[message_id: 7]"
)


def wrap(question: str) -> str:
    """`question` inside a heavy OpenClaw-style wrapper."""
    return WRAP.replace("{q}", question)


def test_labelled_set_is_big_enough(root):
    cases = load_retrieval_cases()
    names = {s.name for s in SkillLibrary(root).skills()}
    assert len(cases) >= 20
    assert sum(c.wrapped for c in cases) >= 5
    assert all(set(c.relevant) <= names for c in cases), "labels must name starter-bank skills"


@pytest.mark.parametrize("kind", ["bm25", "embedding"])
def test_precision_at_3_above_floor(kind, root, request):
    ranker = BM25Ranker() if kind == "bm25" else request.getfixturevalue("embedding_ranker")
    result = evaluate_ranker(ranker, SkillLibrary(root).skills(), load_retrieval_cases(), k=3)
    result.pop("per_query")
    print(f"\n{kind}: {json.dumps(result)}")
    for metric, floor in FLOORS[kind].items():
        assert result[metric] >= floor, f"{kind} {metric} {result[metric]:.3f} < {floor}"


def test_extract_query_strips_openclaw_boilerplate():
    msg = {"role": "user", "content": wrap("why does pytest say ModuleNotFoundError?")}
    assert extract_query([msg]) == "why does pytest say ModuleNotFoundError?"


def test_extract_query_latest_user_message_and_parts():
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "answer"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "[Mon 2026-01-05 10:00 UTC] second"},
                {"type": "image_url", "image_url": {"url": "data:..."}},
            ],
        },
        {"role": "tool", "content": "tool output", "tool_call_id": "x"},
    ]
    assert extract_query(messages) == "second"
    # a message that is only boilerplate falls back to the previous user message
    messages.append({"role": "user", "content": "<system-reminder>be nice</system-reminder>"})
    assert extract_query(messages) == "second"
    assert extract_query([{"role": "assistant", "content": "x"}]) == ""


def test_strip_patterns_are_configurable():
    msg = [{"role": "user", "content": "ACME-HEADER v2 | rotate the logs"}]
    assert extract_query(msg) == "ACME-HEADER v2 | rotate the logs"
    assert extract_query(msg, patterns=[r"^ACME-HEADER v\d+ \| "]) == "rotate the logs"
    assert (
        extract_query([{"role": "user", "content": "<system-reminder>x</system-reminder> hi"}], patterns=[])
        == "<system-reminder>x</system-reminder> hi"
    )


@pytest.mark.parametrize("kind", ["bm25", "embedding"])
def test_identical_boilerplate_different_questions_retrieve_different_skills(kind, root, request):
    ranker = BM25Ranker() if kind == "bm25" else request.getfixturevalue("embedding_ranker")
    skills = SkillLibrary(root).skills()
    q1 = extract_query([{"role": "user", "content": wrap("Delete the old branches and force push main.")}])
    q2 = extract_query([{"role": "user", "content": wrap("Where is the retry timeout defined? Give file and line.")}])
    top1 = [s.name for s, _ in ranker.rank(q1, skills, 3)]
    top2 = [s.name for s, _ in ranker.rank(q2, skills, 3)]
    assert top1 and top2 and top1[0] != top2[0]
    assert set(top1) != set(top2)
    assert top1[0] == "safe-shell-commands"
    if kind == "bm25":  # MiniLM misses this one (see the precision figures); BM25 matches "file"/"line"
        assert "cite-files-and-lines" in top2
    # without stripping, the shared wrapper dominates and drags in the same skills
    raw = [s.name for s, _ in BM25Ranker().rank(wrap("hi"), skills, 3)]
    assert raw, "the wrapper alone matches skills, which is why it must be stripped"


def test_embedding_cache_keyed_by_content_hash(tmp_path, embedding_ranker):
    from metaclaw.skills import EmbeddingRanker, Skill

    ranker = EmbeddingRanker(model_dir=embedding_ranker.model_dir, cache_dir=tmp_path)
    ranker._model, ranker._tokenizer, ranker._torch = (  # share the loaded model; the cache is what is tested
        embedding_ranker._model,
        embedding_ranker._tokenizer,
        embedding_ranker._torch,
    )
    a = Skill("alpha-skill", "Rotate log files daily.", body="Use logrotate.")
    ranker.skill_vectors([a])
    files = sorted(p.name for p in ranker.cache_dir.glob("*.npy"))
    assert files == [f"{a.content_hash}.npy"]
    edited = Skill("alpha-skill", "Rotate log files weekly.", body="Use logrotate.")
    ranker.skill_vectors([edited])
    assert len(list(ranker.cache_dir.glob("*.npy"))) == 2
    fresh = EmbeddingRanker(model_dir=embedding_ranker.model_dir, cache_dir=tmp_path)
    vec = fresh.skill_vectors([edited])  # served from disk: the model is never loaded
    assert fresh._model is None and vec.shape == (1, 384)
