"""One error shape for every failure: `{"error": {"message", "type", "code", "param"}}` with a 4xx/5xx status.

Validation errors (bad JSON, wrong types, missing fields) become 400 naming the field, not FastAPI's 422.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}


class ApiError(Exception):
    """An error the client can act on; `param` names the offending field (e.g. `datums.0.target_tokens`)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "code": status, "param": param}}
    return JSONResponse(body, status_code=status)


def _loc(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if part != "body") or "body"


def install_error_handlers(app: FastAPI) -> None:
    """Map ApiError, validation errors, HTTP errors and anything unexpected onto the JSON error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            detail = (errors[0].get("ctx") or {}).get("error", "")
            return error_response(400, f"malformed JSON body: {detail}".rstrip(": "), "body")
        parts = []
        for err in errors[:5]:
            where = _loc(tuple(err.get("loc", ())))
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}")
        param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        return error_response(400, "; ".join(parts) + more, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
