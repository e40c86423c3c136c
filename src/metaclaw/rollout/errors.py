"""The proxy's error bodies, one shape per API family, so each client's SDK raises its own exception class.

- OpenAI (every `/v1/*` route but `/v1/messages*`, unknown routes included):
  `{"error": {"message", "type", "param", "code"}}`, `code` a string or null (never the status).
- Anthropic (`/v1/messages*`): `{"type": "error", "error": {"type", "message"}}`, `type` from Anthropic's list.

An upstream error (the policy server answers vLLM's shape, an integer `code`) is re-shaped into the family's.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from metaclaw.wire.errors import error_body, error_response


def is_anthropic(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes (answered in Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def openai_error(
    message: str, status: int = 400, type_: str | None = None, code: Any = None, param: Any = None
) -> dict[str, Any]:
    """The one error body (`metaclaw.wire.errors`) as OpenAI's SDKs expect it: a non-string `code` (vLLM's integer
    status) becomes null, a non-string `param` too."""
    code = code if isinstance(code, str) and code else None
    param = param if isinstance(param, str) and param else None
    return error_body(message, status, type_, code, param)


def proxy_error(
    status: int, message: str, *, anthropic: bool, type_: str | None = None, code: Any = None, param: Any = None
) -> JSONResponse:
    """The family's error reply with `status` (`metaclaw.wire.errors.error_response`, OpenAI's codes)."""
    if anthropic:
        return error_response(message, status, type_=type_, anthropic=True)
    body = openai_error(message, status, type_, code, param)["error"]
    return error_response(message, status, type_=body["type"], code=body["code"], param=body["param"])


def upstream_fields(status: int, body: bytes) -> tuple[str, str | None, Any, Any]:
    """(message, type, code, param) of an upstream error body, whatever its shape (OpenAI, vLLM, FastAPI, text)."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        message = err.get("message")
        message = message if isinstance(message, str) and message else f"upstream returned {status}"
        type_ = err.get("type") if isinstance(err.get("type"), str) else None
        return message, type_, err.get("code"), err.get("param")
    if isinstance(err, str):
        return err, None, None, None
    if isinstance(data, dict) and isinstance(data.get("detail"), str):
        return data["detail"], None, None, None
    text = body.decode("utf-8", "replace").strip()[:500] if body else ""
    return (f"upstream returned {status}: {text}" if text else f"upstream returned {status}"), None, None, None


def upstream_response(status: int, body: bytes, *, anthropic: bool) -> JSONResponse:
    """An upstream error passed on with its status, in the family's shape."""
    message, type_, code, param = upstream_fields(status, body)
    return proxy_error(status, message, anthropic=anthropic, type_=type_, code=code, param=param)


def stream_error(error: Any) -> tuple[str, str | None, Any]:
    """(message, type, code) of an error object an upstream sent inside its stream (`data: {"error": {...}}`)."""
    if isinstance(error, dict):
        message = error.get("message")
        type_ = error.get("type") if isinstance(error.get("type"), str) else None
        return (message if isinstance(message, str) and message else "the upstream failed mid-stream"), type_, \
            error.get("code")  # fmt: skip
    return (error if isinstance(error, str) and error else "the upstream failed mid-stream"), None, None
