"""Request validation: every client mistake is a RequestError naming the field."""

from __future__ import annotations

import pytest

from metaclaw.serving.protocol import parse_chat_request, parse_completion_request
from metaclaw.wire import RequestError
from metaclaw.wire.normalize import chat_template_messages

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_chat_request({"model": "tiny", "messages": MSG, **kw}, default_max_tokens=64)


def test_defaults_and_aliases():
    req = chat(max_completion_tokens=5, stop="x", top_k=0, seed=3)
    assert (req.params.max_tokens, req.params.stop, req.params.top_k, req.params.seed) == (5, ["x"], -1, 3)
    assert chat().params.max_tokens == 64


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", -1), ("max_tokens", 0), ("max_tokens", "5"), ("temperature", "hot"), ("temperature", 3),
     ("top_p", 0), ("n", 0), ("stop", 5), ("logprobs", "yes"), ("tools", "x"), ("stream", 1)],
)  # fmt: skip
def test_bad_fields_are_400(field, value):
    with pytest.raises(RequestError) as err:
        chat(**{field: value})
    assert err.value.status == 400 and err.value.param == field


def test_bad_messages():
    for messages in (None, [], [{"role": "robot", "content": "x"}], ["hi"],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]):  # fmt: skip
        with pytest.raises(RequestError):
            parse_chat_request({"model": "tiny", "messages": messages}, 8)
    with pytest.raises(RequestError):
        parse_chat_request([1, 2], 8)
    with pytest.raises(RequestError):
        parse_chat_request({"messages": MSG}, 8)


def test_message_normalisation():
    out = chat_template_messages(
        [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    )  # fmt: skip
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["name"] == "f"
    assert out[2] == {"role": "tool", "content": "ok", "tool_call_id": "c"}


def test_stream_with_n_refused():
    with pytest.raises(RequestError):
        chat(stream=True, n=2)


def test_completion_request_forms():
    req = parse_completion_request({"model": "m", "prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "logprobs": 0})
    assert req.prompt == [1, 2, 3] and req.params.max_tokens == 0
    assert parse_completion_request({"model": "m", "prompt": [[4, 5]]}).prompt == [4, 5]
    bad_bodies = [{"prompt": []}, {"prompt": [1, -2]}, {"prompt": [1.5]}, {"prompt": "x", "max_tokens": 0},
                  {"prompt": "x", "stream": True}]  # fmt: skip
    for bad in bad_bodies:
        with pytest.raises(RequestError):
            parse_completion_request({"model": "m", **bad})
