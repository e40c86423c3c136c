"""Request bodies as every HTTP surface reads them: JSON, bounded in nesting depth, or a clear 400 reason.

Deeply nested JSON is legal but useless to a chat API and dangerous downstream (recursive normalisers, pickling
across LitServe's queue, `json.dumps`): it is refused at the door with a message, not a RecursionError.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64


class BodyError(ValueError):
    """The body is not acceptable JSON; the message says why (answered with 400)."""


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether `value` nests objects/arrays deeper than `max_depth` (iterative: no recursion limit)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _no_constant(name: str) -> None:
    raise BodyError(f"the request body is not valid JSON: {name} is not a JSON number")


def load_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body. Raises `BodyError` for invalid JSON (NaN and Infinity included: Python's `json` reads
    them, nothing downstream can send them on) or nesting deeper than `max_depth`."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise BodyError(f"the request body nests deeper than {max_depth} levels") from e
    if json_depth_exceeds(value, max_depth):
        raise BodyError(f"the request body nests deeper than {max_depth} levels")
    return value
