"""SSE framing of upstream bytes: events split across reads, CRLF line ends, multi-line data, comments."""

from __future__ import annotations

from metaclaw.rollout.capture import split_sse, sse_data


def test_events_split_across_reads_are_joined():
    rest, seen = b"", []
    for raw in (b'data: {"a"', b": 1}\n\ndata: [DO", b"NE]\n", b"\n"):
        events, rest = split_sse(rest + raw)
        seen += events
    assert seen == [b'data: {"a": 1}', b"data: [DONE]"] and rest == b""
    assert [sse_data(e) for e in seen] == [b' {"a": 1}', b" [DONE]"]


def test_crlf_split_between_reads_and_multiline_data():
    events, rest = split_sse(b"data: x\r\n\r")
    assert events == [] and rest == b"data: x\n\r"
    events, rest = split_sse(rest + b"\n: keep-alive comment\n\nevent: e\ndata: a\ndata: b\n\n")
    assert events == [b"data: x", b": keep-alive comment", b"event: e\ndata: a\ndata: b"] and rest == b""
    assert [sse_data(e) for e in events] == [b" x", None, b" a\n b"]


def test_the_policys_reasoning_never_reaches_what_the_judge_scores():
    """Issue 11.6: a thinking policy's reasoning (a `reasoning_content` field, or `<think>` left inline by an
    upstream without a reasoning parser) is not part of the reply the judge reads."""
    from metaclaw.rollout.capture import TurnCapture

    whole = TurnCapture()
    message = {"content": "<think>the user wants \\boxed{1}</think>\n\nParis.", "reasoning_content": "more thought"}
    whole.feed_response({"prompt_token_ids": [1], "choices": [{"token_ids": [2], "message": message}]})
    streamed = TurnCapture()
    for delta in ({"reasoning_content": "hidden plan"}, {"content": "<think>inline "}, {"content": "plan</think>"},
                  {"content": "Paris."}):  # fmt: skip
        streamed.feed_chunk({"choices": [{"delta": delta, "token_ids": [3]}]})
    for capture in (whole, streamed):
        assert capture.response_text == "Paris."
        assert "think" not in capture.to_sample(agent_id="a").text.response_text
