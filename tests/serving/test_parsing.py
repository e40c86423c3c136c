"""The `<think>` and tool-call parsers (Qwen/Hermes, Llama 3, Mistral) on known strings, whole and streamed in
awkward pieces; the format chosen from real chat templates (`tests/serving/chat_templates.py`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from metaclaw.modules.loading import CHATML_TEMPLATE
from metaclaw.wire.parsing import StreamParser, detect_tool_format, parse_completion, tool_format_for
from tests.serving import chat_templates

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>'


def test_plain_text_is_content():
    parsed = parse_completion("Hello there")
    assert (parsed.content, parsed.reasoning_content, parsed.tool_calls) == ("Hello there", None, [])


def test_think_block_becomes_reasoning():
    parsed = parse_completion("<think>\nLet me think.\n</think>\n\nParis.")
    assert parsed.reasoning_content == "Let me think."
    assert parsed.content == "Paris."


def test_lone_close_tag_means_reasoning_opened_in_prompt():
    parsed = parse_completion("step one</think>The answer")
    assert (parsed.reasoning_content, parsed.content) == ("step one", "The answer")


def test_tool_call_parsed_into_openai_shape():
    parsed = parse_completion(f"<think>need weather</think>\n{CALL}")
    assert parsed.reasoning_content == "need weather"
    assert parsed.content is None
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Berlin"}


def test_two_tool_calls_and_text():
    parsed = parse_completion(f"Checking. {CALL}{CALL.replace('Berlin', 'Paris')}")
    assert parsed.content == "Checking."
    assert [json.loads(c["function"]["arguments"])["city"] for c in parsed.tool_calls] == ["Berlin", "Paris"]


def test_malformed_tool_call_stays_in_content():
    text = "<tool_call>{not json}</tool_call>"
    parsed = parse_completion(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_tools_not_parsed_when_disabled():
    assert parse_completion(CALL, parse_tools=False).content == CALL


def _stream(text: str, size: int, fmt: str = "hermes") -> tuple[str, str, list[dict]]:
    parser = StreamParser(fmt=fmt)
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i : i + size])
    events += parser.finish()
    content = "".join(v for k, v in events if k == "content")
    reasoning = "".join(v for k, v in events if k == "reasoning")
    return content, reasoning, [v for k, v in events if k == "tool_call"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_stream_parser_matches_whole_parse(size):
    text = f"<think>plan it</think>Sure. {CALL} done"
    content, reasoning, calls = _stream(text, size)
    assert reasoning == "plan it"
    assert content == "Sure.  done"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_stream_parser_keeps_lookalike_text():
    content, reasoning, calls = _stream("a < b and <thin ice>", 1)
    assert (content, reasoning, calls) == ("a < b and <thin ice>", "", [])


def test_stream_parser_unterminated_call_returned_as_text():
    content, _, calls = _stream('<tool_call>{"name": "x"', 4)
    assert calls == [] and content == '<tool_call>{"name": "x"'


# ---- tool-call formats per model family, chosen from the chat template --------------------------------------


@pytest.mark.parametrize(
    "template,fmt",
    [(chat_templates.QWEN3, "hermes"), (chat_templates.LLAMA_3_1, "llama3"), (chat_templates.LLAMA_3_2, "llama3"),
     (chat_templates.MISTRAL_V03, "mistral"), (chat_templates.SMOLLM2, "hermes"), (CHATML_TEMPLATE, "hermes"),
     (None, "hermes"), ({"default": chat_templates.SMOLLM2, "tool_use": chat_templates.LLAMA_3_1}, "llama3")],
)  # fmt: skip
def test_format_detected_from_the_chat_template(template, fmt):
    assert detect_tool_format(template) == fmt


def test_config_override_wins_and_a_bad_one_is_refused(tiny_tokenizer):
    assert tool_format_for(tiny_tokenizer) == "hermes"  # the tiny model's own template
    assert tool_format_for(tiny_tokenizer, "mistral") == "mistral"
    assert tool_format_for(SimpleNamespace(chat_template=chat_templates.LLAMA_3_1), "auto") == "llama3"
    with pytest.raises(ValueError, match="tool_call_format"):
        tool_format_for(tiny_tokenizer, "gpt")


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Berlin"}}'
FAMILY_REPLIES = {
    "llama3": [LLAMA_CALL, f"<|python_tag|>{LLAMA_CALL}", f'  {LLAMA_CALL}; {LLAMA_CALL.replace("Berlin", "Paris")}'],
    "mistral": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Berlin"}, "id": "abcDEF123"}]',
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Berlin"}',
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Berlin"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'],
}  # fmt: skip


@pytest.mark.parametrize("fmt,reply", [(f, r) for f, replies in FAMILY_REPLIES.items() for r in replies])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_family_calls_parse_whole_and_streamed(fmt, reply, size):
    whole = parse_completion(reply, fmt=fmt)
    cities = [json.loads(c["function"]["arguments"])["city"] for c in whole.tool_calls]
    assert cities[0] == "Berlin" and len(cities) == reply.count("Berlin") + reply.count("Paris")
    assert whole.content is None and {c["function"]["name"] for c in whole.tool_calls} == {"get_weather"}
    if fmt == "mistral":  # Mistral's templates refuse any other call id
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in whole.tool_calls)
    if "abcDEF123" in reply:
        assert whole.tool_calls[0]["id"] == "abcDEF123"
    content, _, calls = _stream(reply, size, fmt)
    assert content.strip() == "" and [c["function"]["arguments"] for c in calls] == [
        c["function"]["arguments"] for c in whole.tool_calls]  # fmt: skip


@pytest.mark.parametrize(
    "fmt,reply",
    [("llama3", "Sure, here is JSON: {\"a\": 1}"), ("llama3", '{"answer": 42}'), ("llama3", "{not json"),
     ("llama3", "<|python_tag|>brave_search.call(query=\"weather\")"), ("mistral", "[TOOL_CALLS] not json"),
     ("mistral", "No calls here [TOOL_CALLS"), ("hermes", LLAMA_CALL)],
)  # fmt: skip
def test_what_is_not_a_call_stays_content(fmt, reply):
    assert parse_completion(reply, fmt=fmt).tool_calls == []
    assert parse_completion(reply, fmt=fmt).content == reply
    content, _, calls = _stream(reply, 3, fmt)
    assert calls == [] and content == reply


def test_llama_text_streams_before_the_end_and_reasoning_is_split():
    parser = StreamParser(fmt="llama3")
    assert parser.feed("  Hello") == [("content", "  Hello")]  # not held: it is not a call
    content, reasoning, calls = _stream(f"<think>use the tool</think>\n{LLAMA_CALL}", 2, "llama3")
    assert reasoning == "use the tool" and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_text_then_mistral_calls_keeps_the_text():
    parsed = parse_completion('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Berlin"}', fmt="mistral")
    assert parsed.content == "Let me check." and len(parsed.tool_calls) == 1
    assert parse_completion("[TOOL_CALLS]get_weather[ARGS]{}", fmt="mistral", parse_tools=False).tool_calls == []
