"""Small helpers every Tinker route uses: SDK-typed body parsing, JSON dumps, future handles."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from tinker import types as t

from metaclaw.training_server.errors import bad_request

M = TypeVar("M", bound=BaseModel)


async def parse(request: Request, model: type[M]) -> M:
    """The JSON body validated by an SDK request type; 400 naming the field."""
    try:
        data = json.loads(await request.body() or b"null")
    except ValueError as exc:
        raise bad_request(f"malformed JSON body: {exc}", "body") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        raise bad_request(f"{where}: {err.get('msg', 'invalid value')}", where) from None


def dump(obj: BaseModel) -> dict[str, Any]:
    return obj.model_dump(mode="json", exclude_none=True)


def untyped(request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """The immediate answer of a request that runs later: its future's id."""
    return dump(t.UntypedAPIFuture(request_id=request_id, model_id=model_id, **extra))
