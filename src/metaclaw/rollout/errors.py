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

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 529: "overloaded_error"}  # fmt: skip


def is_anthropic(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes (answered in Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def openai_error(
    message: str, status: int = 400, type_: str | None = None, code: Any = None, param: Any = None
) -> dict[str, Any]:
    """OpenAI's error body; a non-string `code` (vLLM's integer status) becomes null."""
    code = code if isinstance(code, str) and code else None
    param = param if isinstance(param, str) and param else None
    return {"error": {"message": message, "type": type_ or openai_type(status), "param": param, "code": code}}


def anthropic_error(message: str, status: int = 400, type_: str | None = None) -> dict[str, Any]:
    """Anthropic's error body; `type_` only when it is one of Anthropic's, else the status's."""
    known = set(ANTHROPIC_TYPES.values()) | {"api_error"}
    return {"type": "error", "error": {"type": type_ if type_ in known else anthropic_type(status),
                                       "message": message}}  # fmt: skip


def error_response(
    status: int, message: str, *, anthropic: bool, type_: str | None = None, code: Any = None, param: Any = None
) -> JSONResponse:
    """The family's error body with `status`."""
    body = anthropic_error(message, status, type_) if anthropic else openai_error(message, status, type_, code, param)
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


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
    return error_response(status, message, anthropic=anthropic, type_=type_, code=code, param=param)


def stream_error(error: Any) -> tuple[str, str | None, Any]:
    """(message, type, code) of an error object an upstream sent inside its stream (`data: {"error": {...}}`)."""
    if isinstance(error, dict):
        message = error.get("message")
        type_ = error.get("type") if isinstance(error.get("type"), str) else None
        return (message if isinstance(message, str) and message else "the upstream failed mid-stream"), type_, \
            error.get("code")  # fmt: skip
    return (error if isinstance(error, str) and error else "the upstream failed mid-stream"), None, None
