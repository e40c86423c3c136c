"""One error shape for every failure: `{"error": {"message", "type", "code", "param"}}` with a 4xx/5xx status.

Validation errors (bad JSON, wrong types, missing fields) become 400 naming the field, not FastAPI's 422.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from metaclaw.wire import RequestError
from metaclaw.wire.errors import error_response

log = logging.getLogger(__name__)

_TYPES = {429: "session_limit_error"}  # this server's own word for 429; every other type is the one table's


class ApiError(Exception):
    """An error the client can act on; `param` names the offending field (e.g. `datums.0.target_tokens`)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _reply(status: int, message: str, param: str | None = None) -> JSONResponse:
    """The one error body (`metaclaw.wire.errors.error_response`), `code` the status (vLLM's shape)."""
    return error_response(message, status, type_=_TYPES.get(status), code=status, param=param)


def _loc(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if part != "body") or "body"


def install_error_handlers(app: FastAPI) -> None:
    """Map ApiError, validation errors, HTTP errors and anything unexpected onto the JSON error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _reply(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:  # the shared vocabulary's 4xx
        return _reply(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            detail = (errors[0].get("ctx") or {}).get("error", "")
            return _reply(400, f"malformed JSON body: {detail}".rstrip(": "), "body")
        parts = []
        for err in errors[:5]:
            where = _loc(tuple(err.get("loc", ())))
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}")
        param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        return _reply(400, "; ".join(parts) + more, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _reply(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        # the exception text may hold server paths or data: it goes to the log, not to the client
        return _reply(500, f"internal error ({type(exc).__name__}); see the server log")


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int
    param: str | None = None


class ErrorBody(BaseModel):
    """Every error reply: `{"error": {...}}`."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, a wrong type or value (`param` names the field)",
    401: "Missing or wrong API key",
    403: "The named checkpoint belongs to another live session",
    404: "Unknown session_id",
    409: "Another base model or LoRA rank than the live sessions'",
    413: "Request body over app.max_body_bytes",
    429: "Session limit reached (app.limits.max_sessions)",
    507: "Disk quota for saved adapters/checkpoints exceeded, or the disk is full",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: the error statuses it really answers, with the error body schema."""
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS[s]} for s in statuses}


def drop_422(app: FastAPI) -> None:
    """Remove FastAPI's default 422 from the OpenAPI document: validation errors are answered with 400."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
