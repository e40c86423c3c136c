"""One schema: the policy server validates each request body with a pydantic model and publishes that same model's
JSON Schema in `/openapi.json`, so the document cannot drift from what the server accepts."""

from __future__ import annotations

import pytest

from metaclaw.serving.protocol import parse_chat_request, parse_completion_request, parse_load_request
from metaclaw.wire import RequestError
from metaclaw.wire.openapi import POLICY_SERVER_BODIES, publish_request_bodies
from metaclaw.wire.schemas import POLICY_SERVER_SCHEMAS, ChatCompletionBody, openapi_schema

MSG = [{"role": "user", "content": "hi"}]


def test_the_published_bodies_are_the_validating_schemas():
    assert set(POLICY_SERVER_BODIES) == set(POLICY_SERVER_SCHEMAS)
    for path, schema in POLICY_SERVER_SCHEMAS.items():
        assert POLICY_SERVER_BODIES[path] == openapi_schema(schema), path
        assert "$ref" not in str(POLICY_SERVER_BODIES[path]) and "$defs" not in str(POLICY_SERVER_BODIES[path])


def test_the_policy_servers_openapi_document_carries_them():
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> None: ...

    publish_request_bodies(app, POLICY_SERVER_BODIES)
    op = app.openapi()["paths"]["/v1/chat/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == openapi_schema(ChatCompletionBody)
    assert "422" not in op["responses"] and "400" in op["responses"]


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [("temperature", 2.5, "maximum"), ("top_p", 0, "minimum"), ("n", 17, "maximum"), ("top_logprobs", 21, "maximum")],
)
def test_what_the_document_says_is_what_the_parser_refuses(field, value, bound):
    """Each published bound is the parser's: just outside it is a 400 naming the field."""
    prop = POLICY_SERVER_BODIES["/v1/chat/completions"]["properties"][field]
    assert (value > prop[bound]) if bound == "maximum" else (value < prop[bound])
    with pytest.raises(RequestError) as err:
        parse_chat_request({"model": "m", "messages": MSG, field: value}, 16)
    assert err.value.status == 400 and err.value.param == field


def test_strict_types_and_named_fields():
    for body, param in [({"model": "m", "messages": MSG, "max_tokens": "5"}, "max_tokens"),
                        ({"model": "m", "messages": MSG, "stream": 1}, "stream"),
                        ({"model": "m", "messages": [{"role": "robot"}]}, "messages"),
                        ({"messages": MSG}, "model")]:  # fmt: skip
        with pytest.raises(RequestError) as err:
            parse_chat_request(body, 16)
        assert err.value.param == param and param in err.value.message
    with pytest.raises(RequestError) as err:
        parse_load_request({"lora_name": "a", "lora_path": ""})
    assert err.value.param == "lora_path"
    assert parse_completion_request({"model": "m", "prompt": [[1, 2]], "unknown": 1}).prompt == [1, 2]
