"""Issue 10.8 / 11.6: judges, hints and the skill evolver against a scripted *thinking* upstream.

The upstream behaves like Qwen3 behind vLLM: unless the request says `chat_template_kwargs.enable_thinking:
false`, it spends the budget thinking, so `content` is empty and the reasoning is in `reasoning_content` (or
inline `<think>` blocks); told not to think, it answers directly.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from omegaconf import OmegaConf

from metaclaw.config import CONFIG_DIR
from metaclaw.rollout.server import ThreadedServer
from metaclaw.scoring.judges import HINT_SYSTEM, LLMJudge
from metaclaw.skills.evolve import SkillEvolver
from metaclaw.store import Sample, SampleText

REPO = Path(__file__).resolve().parents[2]


def thinking_upstream(style: str) -> FastAPI:
    """`style`: `field` (reasoning_content, empty content, cut at max_tokens) or `inline` (<think> in content)."""
    app = FastAPI()
    app.state.bodies = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        app.state.bodies.append(body)
        hint = body["messages"][0]["content"] == HINT_SYSTEM
        final = "<hint>Berlin is the capital.</hint>" if hint else "\\boxed{-1}"
        thinking = "A hint: <hint>Berlin</hint>" if hint else "The user corrected it, so \\boxed{1} is tempting... no."
        if (body.get("chat_template_kwargs") or {}).get("enable_thinking") is False:
            message, finish = {"role": "assistant", "content": final}, "stop"
        elif style == "field":
            message, finish = {"role": "assistant", "content": "", "reasoning_content": thinking}, "length"
        else:
            message, finish = {"role": "assistant", "content": f"<think>{thinking}</think>\n\n{final}"}, "stop"
        return {"id": "x", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}  # fmt: skip

    return app


def turn() -> Sample:
    msgs = [{"role": "user", "content": "Capital of Germany?"}]
    return Sample(
        [1, 2], [3], [-0.1], text=SampleText(messages=msgs, response_text="It is Munich.", next_state="No, wrong.")
    )


def qwen3_conf(node: str) -> dict[str, Any]:
    """A node of the composed config for `model=qwen3_8b` (its `thinking` interpolated from the model's)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=["model=qwen3_8b", "judge=llm", "skills.enabled=true"])
    return OmegaConf.to_container(OmegaConf.select(cfg, node), resolve=True)


def judge_conf() -> dict[str, Any]:
    conf = qwen3_conf("judge")
    return {k: v for k, v in conf.items() if k in ("votes", "temperature", "max_tokens", "thinking")}


def test_the_configured_judge_asks_for_no_thinking_and_gets_its_verdict_and_hint():
    with ThreadedServer(thinking_upstream("field")) as srv:
        judge = LLMJudge(srv.url, "qwen3", **judge_conf())
        assert asyncio.run(judge.reward(turn())).reward == -1.0
        assert asyncio.run(judge.hint(turn())) == "Berlin is the capital."
        bodies = srv.server.config.app.state.bodies
    assert bodies and all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in bodies)


def test_a_judge_that_thinks_anyway_is_read_from_its_reasoning(caplog):
    with ThreadedServer(thinking_upstream("field")) as srv, caplog.at_level(logging.WARNING):
        judge = LLMJudge(srv.url, "qwen3", votes=3, thinking=None)
        verdict = asyncio.run(judge.reward(turn()))
        hint = asyncio.run(judge.hint(turn()))
    assert verdict.reward == 1.0 and verdict.detail["votes"] == [1, 1, 1]  # the reasoning's last \boxed{}
    assert hint == "Berlin"
    assert all(w in caplog.text for w in ("judge.max_tokens", "model.thinking", "enable_thinking"))  # said, not silent


def test_reasoning_never_passes_for_the_answer():
    with ThreadedServer(thinking_upstream("inline")) as srv:
        judge = LLMJudge(srv.url, "qwen3", votes=1, thinking=None)
        assert asyncio.run(judge.reward(turn())).reward == -1.0  # the answer's \boxed{-1}, not the think block's
        assert asyncio.run(judge.hint(turn())) == "Berlin is the capital."


@pytest.mark.parametrize("style", ["field", "inline"])
def test_the_evolver_asks_for_no_thinking_and_never_reads_reasoning_as_its_reply(tmp_path, style):
    conf = qwen3_conf("skills.evolver")
    with ThreadedServer(thinking_upstream(style)) as srv:
        asked = SkillEvolver(tmp_path, base_url=f"{srv.url}/v1", model="qwen3",
                             thinking=conf["thinking"])  # fmt: skip
        assert asked.complete([{"role": "user", "content": "go"}]) == "\\boxed{-1}"
        assert srv.server.config.app.state.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}
        thinking = SkillEvolver(tmp_path, base_url=f"{srv.url}/v1", model="qwen3")
        reply = thinking.complete([{"role": "user", "content": "go"}])
    if style == "inline":
        assert reply == "\\boxed{-1}"  # the think block is stripped
    else:
        assert reply.startswith("The user corrected it")  # only reasoning came back: read from it
