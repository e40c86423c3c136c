"""Request body schemas the policy server and the proxy publish in their OpenAPI documents (`/openapi.json`).

The routes read raw JSON and validate it themselves (so a bad field is a 400 naming it, not FastAPI's 422). Both
documents are generated from the pydantic schemas the routes validate with: the policy server's
(`metaclaw.wire.schemas`) and the proxy's (`metaclaw.wire.proxy_schemas.PROXY_BODIES`). Inline JSON Schema (no
`$ref`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metaclaw.wire.schemas import POLICY_SERVER_SCHEMAS, openapi_schema

_STR = {"type": "string"}

POLICY_SERVER_BODIES = {path: openapi_schema(schema) for path, schema in POLICY_SERVER_SCHEMAS.items()}
"""Generated from the schemas the policy server validates with (`metaclaw.wire.schemas`): no second copy."""
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
