"""Issue 41 (2): Qwen3 answers every internal caller, with thinking off (the model's setting) and on (a budget).

Qwen3's real chat template (tests/fixtures/qwen3_chat_template.jinja, copied from llama.cpp's models/templates/)
renders the prompts. A random model cannot show what Qwen3 writes, so `qwen3_like` stands in for its weights only:
it renders each request with that template and, as Qwen3 does, answers at once after the template's empty think
block (`enable_thinking: false`), else thinks first and answers after `</think>`, cut at `max_tokens` (one token a
word here). Every caller is the real client code, over HTTP, with its body recorded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from metaclaw import thinking
from metaclaw.config import CONFIG_DIR
from metaclaw.evaluation.evaluator import ComplianceEvaluator
from metaclaw.evaluation.turns import HeldoutTurnsEvaluator
from metaclaw.messages import answer_and_reasoning
from metaclaw.rollout.anthropic import to_openai_request
from metaclaw.rollout.replay import ReplayDriver
from metaclaw.rollout.server import ThreadedServer
from metaclaw.scoring.judges import PRM_SYSTEM, LLMJudge
from metaclaw.scoring.teacher import hinted_prompt_ids
from metaclaw.serving.completions import chat_choice
from metaclaw.serving.protocol import parse_chat_request
from metaclaw.serving.sampling import SequenceOutput
from metaclaw.simulate.user import SimulatedUser
from metaclaw.skills.evolve import SkillEvolver
from metaclaw.store import Sample, SampleText
from metaclaw.thinking import Thinking, read_answer
from metaclaw.wire.parsing import TextDecoder, parse_completion
from metaclaw.wire.render import chat_prompt_ids

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
PREFILL = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
THOUGHT = ["Let", "me", "think", "about", "what", "the", "user", "asks", "and", "how", "to", "say", "it", "well"] * 4
ANSWER = "The answer is 42 ."
MAX_TOKENS = 24  # what the demo's simulated user asks (conf/rollout/simulated_user.yaml)
QUESTION = [{"role": "user", "content": "What is six times seven?"}]


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """`read_answer` warns the first time per caller in a process; an earlier test's evaluator must not use it up."""
    thinking._said.counts.clear()


@pytest.fixture(scope="module")
def qwen3_tokenizer(tiny_spec):
    tok = tiny_spec.load_tokenizer()  # a fresh copy: `<think>`, `</think>`, `<|im_start|>` are its special tokens
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def qwen3_config(*overrides: str) -> Any:
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=["model=qwen3_8b", "judge=llm", "skills.enabled=true", *overrides])


# ---- the template -------------------------------------------------------------------------------------------
def test_qwen3_template_prefills_an_empty_think_block_only_when_thinking_is_off(qwen3_tokenizer):
    def render(**kwargs: Any) -> str:
        return qwen3_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True, **kwargs)

    assert render(enable_thinking=False).endswith(PREFILL)
    assert render().endswith("<|im_start|>assistant\n") and not render().endswith(PREFILL)  # Qwen3 thinks first
    assert render(enable_thinking=True) == render()
    ids = chat_prompt_ids(qwen3_tokenizer, QUESTION, template_kwargs=Thinking.of(qwen3_config().model.thinking)
                          .template_kwargs)  # fmt: skip
    assert qwen3_tokenizer.decode(ids).endswith(PREFILL)  # the one renderer the policy server uses


def test_the_teacher_renders_each_sample_as_it_was_rendered(qwen3_tokenizer):
    off = Sample(
        [1], [2], [-0.1], text=SampleText(messages=QUESTION), meta={"chat_template_kwargs": {"enable_thinking": False}}
    )
    on = Sample([1], [2], [-0.1], text=SampleText(messages=QUESTION))
    assert qwen3_tokenizer.decode(hinted_prompt_ids(qwen3_tokenizer, off, "")).endswith(PREFILL)
    assert not qwen3_tokenizer.decode(hinted_prompt_ids(qwen3_tokenizer, on, "")).endswith(PREFILL)


# ---- one setting, every caller ------------------------------------------------------------------------------
def test_every_internal_caller_reads_the_model_thinking_setting():
    cfg = qwen3_config("model.thinking.budget=7")
    want = {"template_kwargs": {"enable_thinking": False}, "budget": 7}
    nodes = ["judge.thinking", "skills.evolver.thinking", "rollout.simulated_user.thinking"]
    for node in nodes:
        assert OmegaConf.to_container(OmegaConf.select(cfg, node), resolve=True) == want, node
    replay = qwen3_config("rollout=replay", "model.thinking.budget=7")
    assert OmegaConf.to_container(replay.rollout.replay.thinking, resolve=True) == want
    auto = qwen3_config("judge=auto", "model.thinking.budget=7")  # the default judge's LLM branch
    assert OmegaConf.to_container(auto.judge.llm.thinking, resolve=True) == want


# ---- a Qwen3 stand-in over HTTP -----------------------------------------------------------------------------
def qwen3_like(tokenizer: Any) -> FastAPI:
    """Renders with Qwen3's template; answers at once after the empty think block, else thinks first."""
    app = FastAPI()
    app.state.bodies = []

    def generate(body: dict[str, Any]) -> tuple[str | None, str, str, list[int], list[int]]:
        app.state.bodies.append(body)
        kwargs = body.get("chat_template_kwargs") or {}
        prompt = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True, **kwargs)
        words = ANSWER.split() if prompt.endswith(PREFILL) else ["<think>\n", *THOUGHT, "</think>\n\n", *ANSWER.split()]
        n = body["max_tokens"]
        text = " ".join(words[:n])
        parsed = parse_completion(text, parse_tools=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply_ids = tokenizer.encode(text, add_special_tokens=False)
        finish = "length" if len(words) > n else "stop"
        return parsed.reasoning_content, parsed.content or "", finish, prompt_ids, reply_ids

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        reasoning, content, finish, prompt_ids, reply_ids = generate(body)
        message = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
        choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": reply_ids}
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "prompt_token_ids": prompt_ids, "choices": [choice]}  # fmt: skip

    @app.post("/v1/messages")  # the proxy's own translation of an Anthropic request, as the proxy forwards it
    async def messages(request: Request) -> dict[str, Any]:
        reasoning, content, finish, _, _ = generate(to_openai_request(await request.json()))
        blocks = [{"type": "thinking", "thinking": reasoning}] if reasoning else []
        blocks.append({"type": "text", "text": content})
        return {"id": "m", "type": "message", "role": "assistant", "content": blocks,
                "stop_reason": "max_tokens" if finish == "length" else "end_turn"}  # fmt: skip

    return app


def callers(url: str, thinking: Thinking, tmp_path: Path, tokenizer: Any) -> dict[str, Callable[[], str]]:
    """Each internal caller, asking the question as it does: its answer (what its verifier / reward reads)."""
    user = SimulatedUser(f"{url}/v1", [{"kind": "gives_number"}], thinking=thinking, timeout_s=30)
    replay = ReplayDriver(f"{url}/v1", file=str(CONFIG_DIR.parent / "data" / "replay_conversations.jsonl"),
                          max_tokens=MAX_TOKENS, thinking=thinking, timeout_s=30)  # fmt: skip
    evaluator = ComplianceEvaluator(url, [{"kind": "gives_number"}], max_tokens=MAX_TOKENS, thinking=thinking)
    judge = LLMJudge(url, "qwen3", votes=1, max_tokens=MAX_TOKENS, thinking=thinking)
    evolver = SkillEvolver(tmp_path / "skills", base_url=f"{url}/v1", model="qwen3", max_tokens=MAX_TOKENS,
                           thinking=thinking)  # fmt: skip
    gate = HeldoutTurnsEvaluator(None, url, "qwen3")  # type: ignore[arg-type]  # _answer never reads the store
    # The gate answers a held-out turn's prompt rendered as the user's was, within the got reply's length.
    turn = Sample(
        [1],
        [2] * (MAX_TOKENS + thinking.budget),
        [-0.1] * (MAX_TOKENS + thinking.budget),
        text=SampleText(messages=QUESTION),
        meta={"chat_template_kwargs": thinking.template_kwargs or None},
    )

    def gate_answer() -> str:
        got = gate._answer("qwen3", turn, MAX_TOKENS + thinking.budget)
        assert got is not None
        return answer_and_reasoning({"content": tokenizer.decode(got[1])})[0]

    return {
        "simulated user (OpenAI)": lambda: user.ask(list(QUESTION), {}, False, MAX_TOKENS),
        "simulated user (Anthropic)": lambda: user.ask(list(QUESTION), {}, True, MAX_TOKENS),
        "replay": lambda: replay._ask(list(QUESTION), None, {}, False)["content"],
        "evaluator": lambda: evaluator._ask("qwen3", QUESTION[0]["content"])[0],  # type: ignore[index]
        "gate": gate_answer,
        "judge": lambda: asyncio.run(judge._ask(PRM_SYSTEM, QUESTION[0]["content"], 0.6))[0],
        "evolver": lambda: evolver.complete(list(QUESTION)),
    }


@pytest.fixture
def server(qwen3_tokenizer):
    with ThreadedServer(qwen3_like(qwen3_tokenizer)) as srv:
        yield srv, srv.server.config.app.state.bodies


def test_thinking_off_every_caller_gets_the_answer(server, tmp_path, qwen3_tokenizer):
    srv, bodies = server
    thinking = Thinking.of(qwen3_config().model.thinking)  # conf/model/qwen3_8b.yaml
    for name, ask in callers(srv.url, thinking, tmp_path, qwen3_tokenizer).items():
        assert ask().strip() == ANSWER, name
        assert bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}, name
        assert bodies[-1]["max_tokens"] == MAX_TOKENS, name


def test_thinking_on_with_a_budget_every_caller_gets_the_answer_not_the_reasoning(server, tmp_path, qwen3_tokenizer):
    srv, bodies = server
    thinking = Thinking(template_kwargs={}, budget=len(THOUGHT) + 2)  # a model that thinks anyway: its budget counted
    for name, ask in callers(srv.url, thinking, tmp_path, qwen3_tokenizer).items():
        answer = ask()
        assert answer.strip() == ANSWER and "Let me think" not in answer, name
        assert "chat_template_kwargs" not in bodies[-1] and bodies[-1]["max_tokens"] == MAX_TOKENS + thinking.budget


def test_thinking_on_without_a_budget_leaves_no_answer_and_says_so(server, tmp_path, qwen3_tokenizer, caplog):
    """The issue's symptom: Qwen3 asked for 24 tokens with nothing sent ends inside `<think>`; now it is said."""
    srv, _ = server
    asked = callers(srv.url, Thinking(), tmp_path, qwen3_tokenizer)
    with caplog.at_level(logging.WARNING):
        for name in ("simulated user (OpenAI)", "simulated user (Anthropic)", "evaluator", "judge"):
            assert asked[name]() == "", name
    for who in ("simulated user:", "simulated user (Anthropic route):", "evaluator:"):
        assert who in caplog.text
    assert "model.thinking.template_kwargs={enable_thinking: false}" in caplog.text
    assert "judge.max_tokens=24 + model.thinking.budget=0" in caplog.text


# ---- the policy server's side -------------------------------------------------------------------------------
def test_a_reply_cut_inside_think_is_reasoning_without_content_and_is_logged(qwen3_tokenizer, caplog):
    text = "<think>\nThe user wants a number, so"
    ids = qwen3_tokenizer.encode(text, add_special_tokens=False)
    req = parse_chat_request({"model": "qwen3", "messages": QUESTION, "max_tokens": len(ids)}, 16)
    out = SequenceOutput(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="length")
    with caplog.at_level(logging.WARNING):
        choice = chat_choice(0, out, req, TextDecoder(qwen3_tokenizer, []))
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"].startswith("The user wants")
    assert "policy server: the reply has no answer" in caplog.text


def test_read_answer_keeps_a_plain_reply_as_sent_and_strips_inline_reasoning():
    assert read_answer({"content": " 42 \n"}, "stop", "t", 8) == " 42 \n"  # the next turn repeats it verbatim
    assert read_answer({"content": "<think>hmm</think>\n\n42"}, "stop", "t", 8) == "42"
    assert read_answer({"content": "", "reasoning_content": "hmm"}, "length", "t", 8) == ""


def test_thinking_settings_are_checked():
    with pytest.raises(ValueError, match="model.thinking.budget"):
        Thinking(budget=-1)
    with pytest.raises(ValueError, match="model.thinking.template_kwargs"):
        Thinking(template_kwargs={"enable_thinking": [1]})
    assert Thinking(template_kwargs={"enable_thinking": False}, budget=5).fields(None) == {
        "chat_template_kwargs": {"enable_thinking": False}
    }
