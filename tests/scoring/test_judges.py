"""Rule judge, PRM vote parsing/majority, and the LLM judge against a scripted endpoint."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request

from metaclaw.rollout.server import ThreadedServer
from metaclaw.scoring.judges import LLMJudge, RuleJudge, majority, parse_boxed, select_judge
from metaclaw.store import Sample, SampleText


def sample(next_state: str | None, response: str = "It is Munich.") -> Sample:
    msgs = [{"role": "user", "content": "Capital of Germany?"}]
    return Sample([1, 2], [3], [-0.1], text=SampleText(messages=msgs, response_text=response, next_state=next_state))


@pytest.mark.parametrize(
    ("next_state", "reward"),
    [("No, that's wrong. It is Berlin.", -1.0), ("Thanks, perfect!", 1.0), ("And France?", 0.0), (None, 0.0)],
)
def test_rule_judge_reward(next_state, reward):
    assert asyncio.run(RuleJudge().reward(sample(next_state))).reward == reward


def test_rule_judge_hint_is_the_sentence_after_the_correction():
    judge = RuleJudge()
    assert asyncio.run(judge.hint(sample("No, that's wrong. It is Berlin."))) == "It is Berlin."
    assert asyncio.run(judge.hint(sample("Thanks!"))) is None
    assert asyncio.run(judge.hint(sample(None))) is None


def test_parse_boxed_and_majority():
    assert parse_boxed("reasoning... \\boxed{-1}") == -1 and parse_boxed("\\boxed{1} then \\boxed{0}") == 0
    assert parse_boxed("no verdict") is None
    assert majority([1, 1, -1]) == 1.0 and majority([1, -1]) == 0.0 and majority([None, None]) == 0.0
    assert majority([-1, None, 0, -1]) == -1.0


def test_select_judge_follows_the_model():
    rule, llm = RuleJudge(), LLMJudge(None, "m")
    assert select_judge("tiny", ["tiny"], rule, llm) is rule and select_judge("qwen", ["tiny"], rule, llm) is llm


def judge_app(replies: list[str]) -> FastAPI:
    app = FastAPI()
    calls: list[dict] = []
    app.state.calls = calls

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        calls.append(body)
        text = replies[(len(calls) - 1) % len(replies)]
        return {"choices": [{"message": {"role": "assistant", "content": text}}]}

    return app


def test_llm_judge_votes_concurrently_and_takes_the_majority():
    app = judge_app(["\\boxed{1}", "\\boxed{-1}", "\\boxed{-1}"])
    with ThreadedServer(app) as srv:
        judge = LLMJudge(None, "tiny", votes=3, temperature=0.6)
        judge.bind(srv.url)
        verdict = asyncio.run(judge.reward(sample("No, wrong.")))
    assert verdict.reward == -1.0 and sorted(verdict.detail["votes"]) == [-1, -1, 1]
    assert all(c["model"] == "tiny" and c["temperature"] == 0.6 for c in app.state.calls)


def test_llm_judge_hint():
    with ThreadedServer(judge_app(["<hint>Berlin is the capital.</hint>", "<hint>NONE</hint>"])) as srv:
        judge = LLMJudge(srv.url, "tiny")
        assert asyncio.run(judge.hint(sample("wrong, Berlin"))) == "Berlin is the capital."
        assert asyncio.run(judge.hint(sample("ok"))) is None


def test_llm_judge_unreachable_raises_after_retries():
    judge = LLMJudge("http://127.0.0.1:9", "tiny", votes=2, max_retries=1, timeout_s=1)
    with pytest.raises(RuntimeError, match="every judge vote failed"):
        asyncio.run(judge.reward(sample("x")))
