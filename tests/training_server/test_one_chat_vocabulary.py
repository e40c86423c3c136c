"""One chat vocabulary: the training server's `/v1/chat/completions` renders a conversation to exactly the token ids
the policy server renders it to, and reads a reply (reasoning, tool calls) exactly as the policy server reads it."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from metaclaw.serving.completions import chat_choice, render_prompt
from metaclaw.serving.protocol import parse_chat_request
from metaclaw.training_server import chat
from metaclaw.training_server.schemas import ChatCompletionRequest
from metaclaw.wire.parsing import TextDecoder
from metaclaw.wire.sampling import SequenceOutput
from tests.serving import chat_templates

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
CALL = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'}}
BODIES = {
    "plain": {"messages": [{"role": "user", "content": "hi"}]},
    "developer and parts": {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
        ]
    },  # fmt: skip
    "tools and a call": {
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is in notes.txt?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "pineapple"},
        ],
    },  # fmt: skip
    "template kwargs": {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },  # fmt: skip
}


def _smollm2(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = chat_templates.SMOLLM2  # a template that renders no tools: the renderer writes them
    return tok


@pytest.mark.parametrize("template", ["tiny", "smollm2"])
@pytest.mark.parametrize("name", sorted(BODIES))
def test_the_training_server_renders_as_the_policy_server(tiny_tokenizer, template, name):
    tok = tiny_tokenizer if template == "tiny" else _smollm2(tiny_tokenizer)
    body = {"model": "m", **BODIES[name]}
    policy = render_prompt(SimpleNamespace(tokenizer=tok, max_seq_len=10**6), parse_chat_request(body, 16))
    training = chat.prompt_ids(tok, ChatCompletionRequest.model_validate(body))
    assert training == policy and len(policy) > 3


@pytest.mark.parametrize(
    "reply",
    [
        "<think>\nadd them\n</think>\n\nIt is 4.",
        "It is 4.",
        'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>',
        "<think>\nstill thinking",  # cut while thinking
    ],
    ids=["reasoning", "plain", "tool call", "cut"],
)
def test_the_training_server_reads_a_reply_as_the_policy_server(tiny_tokenizer, reply):
    ids = tiny_tokenizer.encode(reply, add_special_tokens=False)
    out = SequenceOutput(ids, [-0.1] * len(ids), "stop")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    policy = chat_choice(0, out, parse_chat_request(body, 16), TextDecoder(tiny_tokenizer, []))
    training = chat.completion(tiny_tokenizer, "m", 1, [out], False, tools=True)["choices"][0]
    assert _no_ids(training["message"]) == _no_ids(policy["message"])
    assert training["finish_reason"] == policy["finish_reason"]
    if "tool_calls" in policy["message"]:
        assert training["finish_reason"] == "tool_calls"


def _no_ids(message: dict) -> dict:
    """The message without its tool calls' random ids."""
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls") or []]
    return {**message, **({"tool_calls": calls} if calls else {})}
