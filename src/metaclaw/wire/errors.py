"""The one error body every metaclaw HTTP surface answers with (the policy server, the proxy, the training server,
the control plane and the security middlewares): OpenAI's `{"error": {"message", "type", "param", "code"}}`, or
Anthropic's `{"type": "error", "error": {"type", "message"}}` on Anthropic's routes.

`code` is what the caller gives: the servers of vLLM's shape send the HTTP status, the proxy sends OpenAI's string
codes (or null), so each client's SDK reads what it expects.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               507: "insufficient_storage_error"}  # fmt: skip
"""OpenAI's error `type` of each status (5xx not listed: `server_error`; other 4xx: `invalid_request_error`)."""

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   422: "invalid_request_error", 429: "rate_limit_error", 529: "overloaded_error"}  # fmt: skip
"""Anthropic's error `type` of each status (5xx not listed: `api_error`)."""


def error_type(status: int) -> str:
    """OpenAI's error `type` for `status`."""
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def anthropic_type(status: int) -> str:
    """Anthropic's error `type` for `status`."""
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(
    message: str, status: int = 400, type_: str | None = None, code: Any = None, param: Any = None
) -> dict[str, Any]:
    """OpenAI's error body; `type_` defaults to the status's."""
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": code}}


def anthropic_error_body(message: str, status: int = 400, type_: str | None = None) -> dict[str, Any]:
    """Anthropic's error body; `type_` only when it is one of Anthropic's, else the status's."""
    known = set(ANTHROPIC_TYPES.values()) | {"api_error"}
    return {"type": "error", "error": {"type": type_ if type_ in known else anthropic_type(status),
                                       "message": message}}  # fmt: skip


def error_response(
    message: str, status: int = 400, *, type_: str | None = None, code: Any = None, param: Any = None,
    anthropic: bool = False,
) -> JSONResponse:  # fmt: skip
    """The error body (Anthropic's when `anthropic`) with `status`; a 401 says `WWW-Authenticate: Bearer`."""
    if anthropic:
        body = anthropic_error_body(message, status, type_)
    else:
        body = error_body(message, status, type_, code, param)
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)
