"""Tools for models whose chat template ignores them (SmolLM2, the embedded default): the one renderer writes the
tool definitions, the assistant's calls and the tool results into the text in the Hermes format the server's
parser reads, so an agent's tools reach the model; templates that render tools are left alone."""

from __future__ import annotations

import copy
import json

from metaclaw.wire.parsing import PARSERS
from metaclaw.wire.render import chat_prompt_ids, template_tool_support
from tests.serving import chat_templates

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
CALL = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'}}
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is in notes.txt?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "pineapple"},
]


def smollm2(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = chat_templates.SMOLLM2
    return tok


def test_a_template_without_tools_gets_them_in_the_text(tiny_tokenizer):
    tok = smollm2(tiny_tokenizer)
    assert template_tool_support(tok) == (False, False)
    # the template alone drops the tools, and fails on the call's None content
    bare = tok.apply_chat_template(CONVO[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "read_file" not in bare
    text = tok.decode(chat_prompt_ids(tok, CONVO, TOOLS))
    assert text.index("Be brief.") < text.index("<tools>\n") < text.index('"read_file"') < text.index("\n</tools>")
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>' in text
    assert "<tool_response>\npineapple\n</tool_response>" in text
    # what the model is shown a call looks like is what the server's parser reads back from a reply
    start = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    reply = text[start : text.index("<|im_end|>", start)]
    content, calls = PARSERS["hermes"].split(reply)
    assert content == "" and calls[0]["function"]["name"] == "read_file"
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "notes.txt"}


def test_without_a_system_prompt_the_tools_open_the_prompt(tiny_tokenizer):
    tok = smollm2(tiny_tokenizer)
    text = tok.decode(chat_prompt_ids(tok, CONVO[1:2], TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools") and "named SmolLM" not in text


def test_a_template_that_renders_tools_is_left_alone(tiny_tokenizer):
    assert template_tool_support(tiny_tokenizer) == (True, True)
    direct = tiny_tokenizer.apply_chat_template(CONVO, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    direct = direct["input_ids"] if hasattr(direct, "keys") else direct
    assert chat_prompt_ids(tiny_tokenizer, CONVO, TOOLS) == list(direct)


def test_smollm2s_list_of_calls_in_one_block_is_parsed():
    reply = '<tool_call>[{"name": "read_file", "arguments": {"path": "a"}}, {"name": "ls", "arguments": {}}]'
    reply += "</tool_call>"
    content, calls = PARSERS["hermes"].split(reply)
    assert content == "" and [c["function"]["name"] for c in calls] == ["read_file", "ls"]
    assert PARSERS["hermes"].split("<tool_call>[1, 2]</tool_call>")[1] == []  # not calls: stays content
