"""`POST /v1/feedback`: a thumbs up/down or a written correction for one captured turn.

The turn is named by the reply id the client got (`response_id`: the OpenAI `id`, or the Anthropic `msg_…` id)
or by `session_id` + `turn_index`. The feedback is stored with the turn (`meta.feedback`); the scoring worker
settles the turn with it (`scoring.feedback`). A turn already trained on keeps its training; the feedback is
still recorded and the reply says so.

Feedback is scoped to the caller's agent (`X-Agent-Id`, else the body's `agent_id`, else the default; a body
`agent_id` that contradicts the header is refused): another agent's turn answers 404, exactly as an unknown one,
so nothing about it (its session, its existence) is disclosed (docs/security.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from metaclaw.store import Sample, SampleStore
from metaclaw.wire import RequestError

TRAINED = ("claimed", "consumed")
Id = Annotated[str, Field(min_length=1, max_length=256)]


class FeedbackRequest(BaseModel):
    """The request body; `response_id`, or `session_id` with `turn_index`, names the turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    score: Annotated[float, Field(ge=-1.0, le=1.0, allow_inf_nan=False, description="-1 (bad) … 1 (good)")]
    response_id: Id | None = None
    session_id: Id | None = None
    turn_index: Annotated[int, Field(ge=0)] | None = None
    agent_id: Id | None = None
    text: Annotated[str, Field(max_length=16384, description="a correction: the turn's OPD hint")] | None = None

    @model_validator(mode="after")
    def _names_a_turn(self) -> FeedbackRequest:
        if self.response_id is None and (self.session_id is None or self.turn_index is None):
            raise ValueError("name the turn: response_id, or session_id and turn_index")
        return self


class FeedbackNotFound(LookupError):
    """No captured turn matches the request (answered with 404)."""


def parse(body: Any) -> FeedbackRequest:
    """The typed request, or a `RequestError` (400) naming the field."""
    try:
        return FeedbackRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise RequestError(f"feedback {where}: {err['msg']}") from None


def _find(store: SampleStore, req: FeedbackRequest, agent_id: str) -> Sample:
    if req.response_id is not None:
        rid = req.response_id.removeprefix("msg_")  # the Anthropic route's id wraps the OpenAI one
        found = [s for s in store.by_response_id(rid) if s.agent_id == agent_id]  # another agent's: as unknown
        if not found:
            raise FeedbackNotFound(f"no captured turn of agent {agent_id!r} has response_id {req.response_id!r}")
        sample = found[0]
        if req.session_id is not None and req.session_id != sample.session_id:
            raise RequestError(f"response_id {req.response_id!r} is not in session {req.session_id!r}")
        if req.turn_index is not None and req.turn_index != sample.turn_index:
            raise RequestError(f"response_id {req.response_id!r} is turn {sample.turn_index}, not {req.turn_index}")
        return sample
    found = store.select(agent_id=agent_id, session_id=req.session_id, turn_index=req.turn_index, limit=1)
    if not found:
        raise FeedbackNotFound(f"no captured turn {req.turn_index} in session {req.session_id!r} of agent {agent_id!r}")
    return found[0]


def record(store: SampleStore, req: FeedbackRequest, agent_id: str) -> dict[str, Any]:
    """Store the feedback with its turn of `agent_id` (the caller's agent); the reply body.

    Raises `FeedbackNotFound` (no such turn of this agent) or `RequestError` (a body `agent_id` other than the
    caller's agent).
    """
    if req.agent_id is not None and req.agent_id != agent_id:
        raise RequestError(f"agent_id {req.agent_id!r} in the body contradicts the caller's agent {agent_id!r} "
                           "(X-Agent-Id): feedback goes to the caller's own turns only")  # fmt: skip
    sample = _find(store, req, agent_id)
    feedback = {"score": float(req.score), "text": req.text, "at": time.time()}
    before, after = store.add_feedback(sample.id, feedback)
    return {
        "status": "recorded",
        "trained": before in TRAINED,
        "sample_status": after,
        "response_id": sample.meta.response_id,
        "session_id": sample.session_id,
        "agent_id": sample.agent_id,
        "turn_index": sample.turn_index,
    }


async def arecord(store: SampleStore, body: Any, agent_id: str) -> dict[str, Any]:
    """`record` for the event loop (the store calls run on a thread)."""
    return await asyncio.to_thread(record, store, parse(body), agent_id)
