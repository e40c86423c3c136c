"""The proxy's HTTP surface: OpenAI `/v1/chat/completions`, `/v1/responses` (the Responses API: Codex),
`/v1/completions` (passed through, not captured), Anthropic `/v1/messages` (+ `/count_tokens`), `/v1/models`
(+ `/{id}`), `/health`, `/metrics` (Prometheus: `metaclaw.ops.metrics`), `/v1/feedback` and `/v1/sessions/done`;
wrapped in the shared browser-guard (Host, Origin, JSON content type: docs/security.md), auth and body-limit
middlewares, and the request counters.

Error contract (`metaclaw.rollout.errors`): a client's mistake is a 4xx JSON body naming the problem in its API
family's shape (OpenAI's `{"error": {"message", "type", "param", "code"}}` with a string or null `code`, on every
route and unknown path; Anthropic's `{"type": "error", "error": {...}}` on `/v1/messages*`); anything unexpected
is a 500 JSON body and a logged traceback, never a plain-text page; upstream errors are passed on with their
status, re-shaped; an upstream failing mid-stream ends the stream with the family's error event. `/openapi.json`
documents every route's request body."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from metaclaw.agents import AgentProfiles
from metaclaw.ops import metrics
from metaclaw.rollout import feedback
from metaclaw.rollout.anthropic import AnthropicStream, to_anthropic_response, to_openai_messages, to_openai_request
from metaclaw.rollout.errors import is_anthropic, openai_error, proxy_error, stream_error, upstream_response
from metaclaw.rollout.fit import ContextPolicy, ImagePolicy, build_fit, policy_settings
from metaclaw.rollout.proxy import SSE_DONE, RolloutProxy, Turn, UpstreamError, dumps
from metaclaw.rollout.responses import ResponseShell, ResponsesStream, to_chat_request, to_response
from metaclaw.rollout.session_tracker import BODY_EXTRAS, scoped_session_id
from metaclaw.skills.hooks import SkillInjectorLike
from metaclaw.store import SampleStore
from metaclaw.wire import CLIENT_HEADER, RequestError
from metaclaw.wire.bodies import BodyError, load_json
from metaclaw.wire.normalize import normalize_messages, normalize_tools
from metaclaw.wire.openapi import publish_request_bodies
from metaclaw.wire.proxy_schemas import PROXY_BODIES, PROXY_SCHEMAS
from metaclaw.wire.schemas import validated
from metaclaw.wire.security import BearerAuthMiddleware, BodySizeLimitMiddleware, BrowserGuard

log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
ANTHROPIC_PATHS = ("/v1/messages",)  # answered with Anthropic's error shape


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


def warn_open(url: str, host: str) -> None:
    """Say loudly who can use a proxy that was started without an API key."""
    loopback = host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
    who = "every user and process on this machine" if loopback else f"anyone who can reach {host} on the network"
    log.warning(
        "The rollout proxy on %s has no API key: %s can chat through it, send feedback and end sessions. Set "
        "rollout.proxy.api_key or METACLAW_PROXY_API_KEY to require `Authorization: Bearer <key>`.",
        url,
        who,
    )


def _error(
    status: int, message: str, type_: str | None = None, anthropic: bool = False, code: str | None = None
) -> JSONResponse:
    """OpenAI's error shape, or Anthropic's (`{"type": "error", "error": {"type", "message"}}`)."""
    return proxy_error(status, message, anthropic=anthropic, type_=type_, code=code)


def _upstream_error(e: UpstreamError, anthropic: bool = False) -> Response:
    return upstream_response(e.status, e.body, anthropic=anthropic)


async def translated_events(turn: Turn, chunks: AsyncIterator[dict[str, Any]], conv: Any) -> AsyncIterator[bytes]:
    """A chat stream re-told in another API's events (`AnthropicStream`, `ResponsesStream`): the start once the
    first chunk says the prompt's length, the events of each chunk, the end, or the family's error event when the
    upstream fails mid-stream (never a normal end)."""
    started, seen = False, 0
    async for chunk in chunks:
        if not started:  # after the first chunk: the prompt's length as the server rendered it
            yield conv.start(len(turn.capture.prompt_ids) or None)
            started = True
        if "error" in chunk and not chunk.get("choices"):
            for ev in conv.fail(chunk["error"]):
                yield ev
            return
        n, seen = len(turn.capture.response_ids) - seen, len(turn.capture.response_ids)
        for ev in conv.feed(chunk, n):
            yield ev
    if not started:
        yield conv.start()
    for ev in conv.end():
        yield ev


async def _json(request: Request) -> Any:
    try:
        return load_json(await request.body())
    except BodyError as e:
        raise RequestError(str(e)) from e


async def _body(request: Request, path: str) -> dict[str, Any]:
    """The route's JSON body, checked against the schema it publishes (`metaclaw.wire.proxy_schemas`) before it is
    normalised: a 400 naming the field, in the route's error shape (`install_error_handlers`)."""
    body = await _json(request)
    validated(PROXY_SCHEMAS[path], body)
    return body


def _headers(request: Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-")}


def client_of(request: Request) -> str:
    """Who is calling, as far as the request says: a digest of the key it presents ("" when none).

    Sessions derived from the conversation are partitioned by it, so one client's message never continues
    another client's session (docs/security.md). Only a digest: the key itself is never kept.
    """
    scope = request.headers.get(CLIENT_HEADER)  # an agent key's digest (the key itself was swapped for the owner's)
    key = request.headers.get("authorization") or request.headers.get("x-api-key")
    return scope or (hashlib.blake2b(key.encode(), digest_size=8).hexdigest() if key else "")


def install_error_handlers(app: FastAPI) -> None:
    """Every error in the family's shape (`metaclaw.wire.errors`; Anthropic's on its routes), never FastAPI's."""

    def anthropic(request: Request) -> bool:
        return is_anthropic(request.url.path)

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, exc: RequestError) -> JSONResponse:
        return proxy_error(exc.status, str(exc), anthropic=anthropic(request), code=exc.code, param=exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes (404) and methods (405), in the family's shape (never FastAPI's `{"detail": ...}`)."""
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} on this proxy (see /openapi.json)"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return proxy_error(exc.status_code, message, anthropic=anthropic(request),
                              code="unknown_url" if exc.status_code == 404 else None)  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return proxy_error(422, f"invalid request: {exc.errors()}", anthropic=anthropic(request))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("proxy: %s %s failed", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__} (see the proxy log)", "api_error",
                      anthropic(request))  # fmt: skip


def service_router(proxy: RolloutProxy) -> APIRouter:
    """`/health` (open: no internal URLs) and `/metrics` (Prometheus)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "capture": proxy.capture, **proxy.stats}  # no internal URLs: this route is open

    @router.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()  # the whole process: proxy, scorer, trainer (docs/operate.md)
        return Response(body, media_type=content_type)

    return router


def models_router(proxy: RolloutProxy, served_model: str) -> APIRouter:
    """`/v1/models`: the one model the agent sees, with the context it may budget for."""
    router = APIRouter()

    created = int(time.time())

    def model_card() -> dict[str, Any]:
        """The served model's card; `max_model_len` (vLLM's field) is the context the agent may budget for."""
        card = {"id": served_model, "object": "model", "created": created, "owned_by": "metaclaw"}
        limit = proxy.context_limit()
        if limit:
            card["max_model_len"] = limit
        return card

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != served_model:
            return proxy_error(404, f"The model {model_id!r} does not exist (this proxy serves {served_model!r})",
                                  anthropic=False, code="model_not_found", param="model")  # fmt: skip
        return JSONResponse(model_card())

    return router


def chat_router(proxy: RolloutProxy) -> APIRouter:
    """OpenAI's chat completions (captured) and legacy completions (passed through, not captured)."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        turn = await proxy.prepare(await _body(request, "/v1/chat/completions"), _headers(request), client_of(request))
        try:
            if not turn.stream:
                body, headers = await proxy.complete_bytes(turn)
                return Response(body, media_type="application/json", headers=headers)
            sse, headers = await proxy.open_sse(turn)  # ends with [DONE], sent only once the turn is stored
        except UpstreamError as e:
            return _upstream_error(e)
        return SSEResponse(sse, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """Legacy completions, passed through to the policy server and not captured (docs/clients.md)."""
        body = await _body(request, "/v1/completions")
        agent_id = proxy.agent_of(body, _headers(request))
        try:
            resp = await proxy.legacy_completions(body, agent_id, client_of(request))
        except UpstreamError as e:
            return _upstream_error(e)
        client_model = body.get("model")
        if not body.get("stream"):
            try:
                out = json.loads(await resp.aread())
            finally:
                await resp.aclose()
            if isinstance(out, dict) and "model" in out:
                out["model"] = client_model
            return JSONResponse(out)

        async def sse() -> AsyncIterator[bytes]:
            try:
                async for events, _ in proxy._events(resp):
                    for _, data in events:
                        chunk = json.loads(data)
                        if "error" in chunk and not chunk.get("choices"):
                            message, type_, code = stream_error(chunk["error"])
                            chunk = openai_error(message, 500, type_, code)
                        elif "model" in chunk:
                            chunk["model"] = client_model
                        yield b"data: " + dumps(chunk).encode() + b"\n\n"
            except httpx.HTTPError as e:
                yield b"data: " + dumps(openai_error(f"the upstream failed mid-stream: {e}", 502)).encode() + b"\n\n"
            finally:
                await resp.aclose()
            yield SSE_DONE

        return SSEResponse(sse(), media_type="text/event-stream", headers=SSE_HEADERS)

    return router


def anthropic_router(proxy: RolloutProxy) -> APIRouter:
    """Anthropic's `/v1/messages` (translated to a chat turn, captured) and its token counting."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await _body(request, "/v1/messages")
        openai_body = to_openai_request(body)
        openai_body.update({k: body[k] for k in BODY_EXTRAS if k in body})  # session keys, as on the OpenAI route
        user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
        if user is not None:
            openai_body["user"] = user  # Anthropic's end-user field: a session key like OpenAI's `user`
        turn = await proxy.prepare(openai_body, _headers(request), client_of(request))
        model = body.get("model")
        try:
            if not turn.stream:
                out, headers = await proxy.complete(turn)
                return JSONResponse(to_anthropic_response(out, model), headers=headers)
            chunks, headers = await proxy.open_stream(turn)
        except UpstreamError as e:
            return _upstream_error(e, anthropic=True)
        conv = AnthropicStream(model, f"msg_{turn.response_id}" if turn.response_id else None)
        events = translated_events(turn, chunks, conv)
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        """Anthropic's token counting: the prompt as the served model's chat template renders it."""
        body = await _body(request, "/v1/messages/count_tokens")
        messages, has_image = normalize_messages(to_openai_messages(body))
        tools = normalize_tools(body.get("tools"))
        context = proxy.fit.context
        if context.tokenizer is None:
            msg = "count_tokens needs the served model's tokenizer, and this proxy runs without one"
            return _error(501, msg, "api_error", anthropic=True)
        if has_image:
            messages, _ = proxy.fit.images.apply(messages, None)
        try:
            n = await asyncio.to_thread(context.count, messages, tools)
        except Exception as e:  # noqa: BLE001 - a conversation the chat template refuses is the request's fault
            raise RequestError(f"cannot render the conversation with the chat template: {e}") from e
        return JSONResponse({"input_tokens": n})

    return router


def responses_router(proxy: RolloutProxy) -> APIRouter:
    """OpenAI's Responses API (Codex)."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API (Codex): translated to a chat turn, captured like one (`rollout.responses`)."""
        body = await _body(request, "/v1/responses")
        chat_body = to_chat_request(body)
        chat_body.update({k: body[k] for k in BODY_EXTRAS if k in body})
        turn = await proxy.prepare(chat_body, _headers(request), client_of(request))
        rid = f"resp_{uuid.uuid4().hex}"
        if turn.response_id:  # the id `/v1/feedback` takes: the response's own
            turn.response_id = turn.meta["response_id"] = rid
        shell = ResponseShell(body, rid, body.get("model"))
        try:
            if not turn.stream:
                out, headers = await proxy.complete(turn)
                return JSONResponse(to_response(out, shell), headers=headers)
            chunks, headers = await proxy.open_stream(turn)
        except UpstreamError as e:
            return _upstream_error(e)
        events = translated_events(turn, chunks, ResponsesStream(shell))
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    return router


def sessions_router(proxy: RolloutProxy) -> APIRouter:
    """Explicit feedback on a turn and the end of a session."""
    router = APIRouter()

    @router.post("/v1/feedback")
    async def post_feedback(request: Request) -> JSONResponse:
        """A score in [-1, 1] (and optional correction text) for one of the caller's agent's turns; see
        `rollout.feedback` (the agent: `X-Agent-Id`, else the body's `agent_id`; a bad id is a 400)."""
        body = await _json(request)
        agent_id = proxy.agent_of(body if isinstance(body, dict) else {}, _headers(request))
        try:
            return JSONResponse(await feedback.arecord(proxy.store, body, agent_id))
        except feedback.FeedbackNotFound as e:
            return _error(404, str(e), "not_found_error", code="not_found")

    @router.post("/v1/sessions/done")
    async def session_done(request: Request) -> JSONResponse:
        body = await _body(request, "/v1/sessions/done")
        hdr = _headers(request)
        session_id = body.get("session_id") or hdr.get("x-session-id")
        agent_id = proxy.agent_of(body, hdr)
        if not isinstance(session_id, str) or not session_id:
            raise RequestError("session_id is required (body field or X-Session-Id header)")
        session_id = scoped_session_id(session_id, hdr.get(CLIENT_HEADER))  # another key's session: unknown here
        if not await proxy.mark_done(str(agent_id), session_id):
            return _error(404, f"unknown session {session_id!r} for agent {agent_id!r}", "not_found_error",
                          code="not_found")  # fmt: skip
        return JSONResponse({"session_id": session_id, "agent_id": agent_id, "done": True})

    return router


def guarded(app: FastAPI, proxy: RolloutProxy, api_key: str | None, max_body_bytes: int, guard: BrowserGuard | None,
            metrics_open: bool, paths: list[str]) -> Any:  # fmt: skip
    """`app` behind the browser guard, the body limit, the metrics and the key check (in that order, outside in);
    `paths`: its routes' paths (the metrics' `route` label; any other path counts as `other`)."""
    guard = (guard or BrowserGuard()).with_anthropic_paths(*ANTHROPIC_PATHS)
    open_paths = ("/health", "/metrics") if metrics_open else ("/health",)
    routes = [p.replace("{model_id:path}", "*") for p in paths if p.startswith(("/v1/", "/health"))]

    def agent_of(headers: dict[str, str]) -> str:  # a configured profile's name: a bounded label
        return metrics.AGENTS(proxy.agents.resolve(headers.get("x-agent-id", "")).name)

    return guard.around_auth(
        BodySizeLimitMiddleware(app, max_body_bytes, anthropic_paths=ANTHROPIC_PATHS),
        lambda inner: metrics.MetricsMiddleware(  # counts refused keys (401) too
            BearerAuthMiddleware(inner, api_key, open_paths=open_paths, anthropic_paths=ANTHROPIC_PATHS),
            "proxy",
            [*routes, "/metrics"],
            agent_of,
        ),
    )


def create_app(
    proxy: RolloutProxy,
    api_key: str | None = None,
    max_body_bytes: int = 8 * 1024 * 1024,
    served_model: str = "metaclaw",
    guard: BrowserGuard | None = None,
    api_docs: bool = False,
    metrics_open: bool = False,
):
    """The ASGI app for `proxy`; `api_key` (if set) is required on every route but `/health` (and `/metrics` when
    `metrics_open`).

    `api_docs`: serve FastAPI's `/docs` and `/redoc` (off by default: they load scripts from a CDN, on the origin
    the dashboard shares); `/openapi.json` is always served.

    `guard` (default: a server bound to loopback) refuses what a web page could send: a foreign `Host` or
    `Origin`, a state-changing request that is not `application/json` (`metaclaw.wire.security`).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        # What exists at startup (torch, transformers: ~400k objects) lives for good; frozen, a full collection
        # no longer rescans it, which otherwise stalls every in-flight request ~200 ms (the proxy's p99).
        gc.freeze()
        yield
        await proxy.stop()

    docs = {} if api_docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="metaclaw rollout proxy", lifespan=lifespan, **docs)
    publish_request_bodies(app, {**PROXY_BODIES, "/v1/feedback": feedback.FeedbackRequest.model_json_schema()})
    install_error_handlers(app)
    routers = (service_router(proxy), models_router(proxy, served_model), chat_router(proxy),
               anthropic_router(proxy), responses_router(proxy), sessions_router(proxy))  # fmt: skip
    for router in routers:
        app.include_router(router)
    # the routers' own paths: FastAPI 0.136 keeps an included router as one entry of `app.routes`, without a path
    paths = [str(getattr(r, "path", "")) for router in routers for r in router.routes]
    return guarded(app, proxy, api_key, max_body_bytes, guard, metrics_open, paths)


class ProxyService:
    """The rollout proxy as the live loop runs it: the `RolloutProxy`, its ASGI app and where it listens.

    Built by `hydra.utils.instantiate(cfg.rollout.proxy, store=..., upstream_url=..., ...)`: the node's fields are
    the keyword arguments after `skills`; the live loop passes what only it knows (store, upstream, tokenizer).

    Args:
        store / upstream_url / upstream_api_key / capture / skills: as `RolloutProxy`'s.
        tokenizer: the served model's tokenizer (the context policy counts prompt tokens with it), or None.
        host / port: where the proxy listens (port 0: a free one).
        metrics_open: `/metrics` answers without the key (a scraper on a trusted network; default: behind it).
        allowed_hosts / allowed_origins: names (beyond the bound address and loopback) the proxy may be reached
            as, and web origins (beyond its own) that may call it (`metaclaw.wire.security.BrowserGuard`).
        api_key: the key clients must send (None: open, said loudly at start).
        max_body_bytes / served_model / api_docs: as `create_app`'s.
        images / context: the proxy's image and context policies (`metaclaw.rollout.fit`).
        sessions: the session table's bounds (`max_open`, `idle_s`).
        policy_model / base_model / default_temperature / default_agent_id / request_timeout_s / agents: as
            `RolloutProxy`'s (`agents`: the agents' modes and adapters, built from the `agents` node by the loop).
    """

    def __init__(
        self,
        store: SampleStore,
        upstream_url: str,
        upstream_api_key: str | None,
        tokenizer: Any,
        capture: bool,
        skills: SkillInjectorLike | None,
        *,
        sessions: Mapping[str, Any],
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        served_model: str = "metaclaw",
        policy_model: str | None = "policy",
        base_model: str | None = None,
        default_temperature: float = 1.0,
        default_agent_id: str = "default",
        request_timeout_s: float = 300.0,
        images: Mapping[str, Any] | None = policy_settings(ImagePolicy),
        context: Mapping[str, Any] | None = policy_settings(ContextPolicy),
        agents: AgentProfiles | None = None,
        allowed_hosts: Sequence[str] = (),
        allowed_origins: Sequence[str] = (),
        api_docs: bool = False,
        metrics_open: bool = False,
    ) -> None:
        self.host, self.port, self.api_key = host, port, api_key
        self.proxy = RolloutProxy(
            store,
            upstream_url,
            upstream_api_key=upstream_api_key,
            policy_model=policy_model,
            base_model=base_model,
            default_temperature=default_temperature,
            default_agent_id=default_agent_id,
            request_timeout_s=request_timeout_s,
            capture=capture,
            skills=skills,
            fit=build_fit({"images": images, "context": context}, tokenizer),
            max_sessions=sessions["max_open"],
            session_idle_s=sessions["idle_s"],
            agents=agents,
        )
        guard = BrowserGuard(host, tuple(allowed_hosts or ()), tuple(allowed_origins or ()))
        self.app = create_app(self.proxy, api_key, max_body_bytes, served_model, guard, api_docs, metrics_open)
