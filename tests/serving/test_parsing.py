"""The `<think>` / `<tool_call>` parsers on known strings, whole and streamed in awkward pieces."""

from __future__ import annotations

import json

import pytest

from metaclaw.serving.parsing import StreamParser, parse_completion

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


def _stream(text: str, size: int) -> tuple[str, str, list[dict]]:
    parser = StreamParser()
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
