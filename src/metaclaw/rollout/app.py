"""The proxy's HTTP surface: OpenAI `/v1/chat/completions`, Anthropic `/v1/messages`, `/v1/models`, `/health`,
and `/v1/sessions/done`; wrapped in the shared auth and body-limit middlewares."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from metaclaw.rollout.anthropic import AnthropicStream, to_anthropic_response, to_openai_request
from metaclaw.rollout.normalize import RequestError
from metaclaw.rollout.proxy import SSE_DONE, RolloutProxy, UpstreamError
from metaclaw.serving.security import BearerAuthMiddleware, BodySizeLimitMiddleware, error_body

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class SSEResponse(StreamingResponse):
    """Server-sent events whose `[DONE]` chunk also ends the HTTP body: one socket write less per stream."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            if ended:  # nothing follows [DONE]; iterate on only so the iterator's cleanup runs now
                continue
            ended = chunk.endswith(SSE_DONE)
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _error(status: int, message: str, type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status_code=status)


def _upstream_error(e: UpstreamError) -> Response:
    body = e.body if e.body else error_body(f"upstream returned {e.status}", "upstream_error", e.status)
    return Response(body, status_code=e.status, media_type="application/json")


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e


def _headers(request: Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-")}


def create_app(
    proxy: RolloutProxy,
    api_key: str | None = None,
    max_body_bytes: int = 8 * 1024 * 1024,
    served_model: str = "metaclaw",
):
    """The ASGI app for `proxy`; `api_key` (if set) is required on every route but `/health`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        # What exists at startup (torch, transformers: ~400k objects) lives for good; frozen, a full collection
        # no longer rescans it, which otherwise stalls every in-flight request ~200 ms (the proxy's p99).
        gc.freeze()
        yield
        await proxy.stop()

    app = FastAPI(title="metaclaw rollout proxy", lifespan=lifespan)

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, exc: RequestError) -> JSONResponse:
        return _error(400, str(exc))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "upstream": proxy.upstream_url, "capture": proxy.capture, **proxy.stats}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model, "object": "model", "owned_by": "metaclaw"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        turn = await proxy.prepare(await _json(request), _headers(request))
        try:
            if not turn.stream:
                body, headers = await proxy.complete_bytes(turn)
                return Response(body, media_type="application/json", headers=headers)
            sse, headers = await proxy.open_sse(turn)  # ends with [DONE], sent only once the turn is stored
        except UpstreamError as e:
            return _upstream_error(e)
        return SSEResponse(sse, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await _json(request)
        openai_body = to_openai_request(body)
        turn = await proxy.prepare(openai_body, _headers(request))
        model = body.get("model")
        try:
            if not turn.stream:
                out, headers = await proxy.complete(turn)
                return JSONResponse(to_anthropic_response(out, model), headers=headers)
            chunks, headers = await proxy.open_stream(turn)
        except UpstreamError as e:
            return _upstream_error(e)

        async def events() -> AsyncIterator[bytes]:
            conv = AnthropicStream(model)
            yield conv.start()
            async for chunk in chunks:
                for ev in conv.feed(chunk):
                    yield ev
            for ev in conv.end():
                yield ev

        return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    @app.post("/v1/sessions/done")
    async def session_done(request: Request) -> JSONResponse:
        body = await _json(request)
        hdr = _headers(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        session_id = body.get("session_id") or hdr.get("x-session-id")
        agent_id = body.get("agent_id") or hdr.get("x-agent-id") or proxy.default_agent_id
        if not isinstance(session_id, str) or not session_id:
            raise RequestError("session_id is required (body field or X-Session-Id header)")
        if not await proxy.mark_done(str(agent_id), session_id):
            return _error(404, f"unknown session {session_id!r} for agent {agent_id!r}", "not_found_error")
        return JSONResponse({"session_id": session_id, "agent_id": agent_id, "done": True})

    guarded = BodySizeLimitMiddleware(app, max_body_bytes)
    return BearerAuthMiddleware(guarded, api_key, open_paths=("/health",))
