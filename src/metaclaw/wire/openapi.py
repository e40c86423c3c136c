"""Request body schemas the policy server and the proxy publish in their OpenAPI documents (`/openapi.json`).

The routes read raw JSON and validate it themselves (so a bad field is a 400 naming it, not FastAPI's 422). The
policy server's bodies are generated from the pydantic schemas it validates with (`metaclaw.wire.schemas`); the
proxy's, which it normalises leniently rather than validates (image parts, OpenClaw's and Anthropic's shapes), are
written here. Inline JSON Schema (no `$ref`); unknown fields are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metaclaw.wire.schemas import POLICY_SERVER_SCHEMAS, CompletionBody, openapi_schema

_STR = {"type": "string"}
_OBJ = {"type": "object"}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["text", "input_text", "output_text"]}, "text": _STR}}  # fmt: skip
_IMAGE_PART = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["image_url", "image", "input_image"]}, "image_url": {"anyOf": [_STR, _OBJ]},
    "data": {"type": "string", "description": "base64 (OpenClaw)"}, "mimeType": _STR}}  # fmt: skip


def _content(parts: list[dict]) -> dict:
    return {"anyOf": [_STR, {"type": "array", "items": {"anyOf": parts}}, {"type": "null"}]}


_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": _STR,
        "type": {"enum": ["function"]},
        "function": {"type": "object", "properties": {"name": _STR, "arguments": _STR}},
    },
}


def _message(content: dict) -> dict:
    return {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": content,
            "name": _STR,
            "tool_calls": {"type": "array", "items": _TOOL_CALL},
            "tool_call_id": _STR,
            "reasoning_content": _STR,
        },
    }


OPENAI_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _STR, "description": _STR, "parameters": _OBJ},
        },
    },
}
_SAMPLING = {
    "model": _STR,
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "seed": {"type": "integer"},
    "stop": {"anyOf": [_STR, {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 8}]},
}


def _chat(message: dict) -> dict:
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "minItems": 1, "items": message},
            "tools": {"type": "array", "items": OPENAI_TOOL},
            "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, _OBJ]},
            "stream": {"type": "boolean"},
            "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "return_token_ids": {"type": "boolean", "description": "vLLM extension: prompt and sampled token ids"},
            "response_format": _OBJ,
            "chat_template_kwargs": _OBJ,
        },
    }


# The proxy also takes image parts (see the image policy) and OpenClaw's part and role shapes.
PROXY_CHAT_COMPLETIONS = _chat(_message(_content([_TEXT_PART, _IMAGE_PART])))
COMPLETIONS = openapi_schema(CompletionBody)  # passed through to the policy server, which validates with it

_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "image", "tool_use", "tool_result", "thinking"]},
        "text": _STR,
        "id": _STR,
        "name": _STR,
        "input": _OBJ,
        "tool_use_id": _STR,
        "content": {"anyOf": [_STR, {"type": "array", "items": _OBJ}]},
        "source": _OBJ,
    },
}
ANTHROPIC_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"enum": ["user", "assistant"]},
                   "content": {"anyOf": [_STR, {"type": "array", "items": _BLOCK}]}},
}  # fmt: skip
ANTHROPIC_TOOL = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "description": _STR, "input_schema": _OBJ},
}
_ANTHROPIC_COMMON = {
    "model": _STR,
    "system": {"anyOf": [_STR, {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                             "properties": {"type": {"enum": ["text"]},
                                                                            "text": _STR}}}]},
    "messages": {"type": "array", "minItems": 1, "items": ANTHROPIC_MESSAGE},
    "tools": {"type": "array", "items": ANTHROPIC_TOOL},
}  # fmt: skip
ANTHROPIC_MESSAGES = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        **_ANTHROPIC_COMMON,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 8},
        "tool_choice": {"type": "object", "properties": {"type": {"enum": ["auto", "any", "tool", "none"]},
                                                         "name": _STR}},
        "metadata": _OBJ,
    },
}  # fmt: skip
ANTHROPIC_COUNT_TOKENS = {"type": "object", "required": ["model", "messages"], "properties": _ANTHROPIC_COMMON}
SESSIONS_DONE = {"type": "object", "properties": {"session_id": {"type": "string", "minLength": 1},
                                                  "agent_id": _STR}}  # fmt: skip

POLICY_SERVER_BODIES = {path: openapi_schema(schema) for path, schema in POLICY_SERVER_SCHEMAS.items()}
"""Generated from the schemas the policy server validates with (`metaclaw.wire.schemas`): no second copy."""
RESPONSES = {"type": "object", "required": ["input"], "properties": {
    "model": _STR, "instructions": _STR, "input": {"anyOf": [_STR, {"type": "array", "items": _OBJ}]},
    "tools": {"type": "array", "items": _OBJ}, "tool_choice": {"anyOf": [_STR, _OBJ]}, "stream": {"type": "boolean"},
    "max_output_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "previous_response_id": {"type": "null", "description": "refused: send the whole conversation in input"}}}
PROXY_BODIES = {
    "/v1/chat/completions": PROXY_CHAT_COMPLETIONS,
    "/v1/responses": RESPONSES,
    "/v1/completions": COMPLETIONS,
    "/v1/messages": ANTHROPIC_MESSAGES,
    "/v1/messages/count_tokens": ANTHROPIC_COUNT_TOKENS,
    "/v1/sessions/done": SESSIONS_DONE,
}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
    "message": _STR, "type": _STR, "param": {"anyOf": [_STR, {"type": "null"}]},
    "code": {"anyOf": [_STR, {"type": "integer"}, {"type": "null"}]}}}}}  # fmt: skip
_ERRORS = {
    str(code): {"description": text, "content": {"application/json": {"schema": ERROR}}}
    for code, text in ((400, "invalid request (the message names the field)"), (401, "missing or invalid API key"),
                       (404, "unknown model / session"), (413, "body over the size limit"))
}  # fmt: skip


def publish_request_bodies(app: Any, bodies: dict[str, dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """Make `app.openapi()` (FastAPI) document each POST route's JSON request body and its error responses.

    The routes take a raw `Request` (they validate themselves), so FastAPI cannot infer the bodies; this adds
    them to the generated document, once, and caches it like FastAPI does.
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = generate()
        for path, schema in bodies.items():
            op = doc.get("paths", {}).get(path, {}).get("post")
            if op is None:
                continue
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
            op.setdefault("responses", {}).pop("422", None)  # FastAPI's default; these routes answer 400
            for code, resp in _ERRORS.items():
                op["responses"].setdefault(code, resp)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
    return openapi
