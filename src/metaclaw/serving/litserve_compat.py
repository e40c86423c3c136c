"""The two places metaclaw reaches below LitServe's documented API, kept here so a LitServe upgrade breaks one file
(and `tests/serving/test_litserve_internals.py` says so loudly) instead of the policy server at run time.

1. `submit`: a custom `LitSpec` route hands a request to the inference worker the way LitServe's own `OpenAISpec`
   does: a `ResponseBufferItem` under a fresh uid, then `(response_queue_id, uid, t, payload)` on the spec's
   `request_queue`. LitServe has no public call for it (a spec's routes are expected to do exactly this).
2. `disable_broken_mcp`: LitServe turns its MCP bridge on whenever the `mcp` package is installed, and that bridge
   fails to start without `fastmcp`; there is no switch for it, only the module flag `litserve.server._MCP_AVAILABLE`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid
from collections import deque
from typing import Any

import litserve.server
from litserve.specs.base import LitSpec
from litserve.utils import ResponseBufferItem


def submit(spec: LitSpec, payload: Any) -> tuple[str, deque, asyncio.Event]:
    """Queue `payload` for the worker; returns `(uid, queue, event)` for `spec.data_streamer(queue, event, ...)`.

    The caller removes `spec.response_buffer[uid]` when it is done with the stream."""
    uid = str(uuid.uuid4())
    queue: deque = deque()
    event = asyncio.Event()
    spec.response_buffer[uid] = ResponseBufferItem(response_queue=queue, event=event)
    spec.request_queue.put((spec.response_queue_id, uid, time.monotonic(), payload))
    return uid, queue, event


def disable_broken_mcp() -> bool:
    """Turn LitServe's MCP bridge off when it cannot start (`mcp` without `fastmcp`); True when it was turned off."""
    if importlib.util.find_spec("fastmcp") is not None:
        return False
    litserve.server._MCP_AVAILABLE = False
    return True
