"""`RolloutProxy`: forwards chat turns to the policy server and captures every main turn in the `SampleStore`.

Per request: normalise messages, resolve session/turn (headers, body fields, `user`, or derived from the
conversation: `rollout.sessions`), inject skills, ask upstream for `logprobs` and `return_token_ids`, pass the
stream through as it arrives, and write the sample before the final `[DONE]` / JSON goes out. The previous main
turn of the session gets its `next_state`. Every main turn's reply carries a fresh unique `id` (also in the
`x-metaclaw-response-id` header and on the sample as `meta.response_id`) that `/v1/feedback` refers to.

The hot path is kept lean: one shared keep-alive HTTP client; each SSE event parsed once; a main turn's events
re-serialised with the turn's id and without the proxy's own extras, a side turn's only when the client's model
id must be restored; writes go to a `GroupCommitWriter`, so concurrent turns share one fsync instead of queueing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import httpx

from metaclaw.agents import AgentProfile, AgentProfiles, check_agent_id
from metaclaw.distribution import Dist
from metaclaw.ops import metrics
from metaclaw.rollout.capture import TurnCapture, split_sse, sse_data, strip_extras
from metaclaw.rollout.conversation import Query, Tail
from metaclaw.rollout.errors import openai_error, stream_error
from metaclaw.rollout.fit import ClientFit, ContextPolicy, ImagePolicy
from metaclaw.rollout.session_tracker import (
    AWAITING_MAX,
    BODY_EXTRAS,
    SessionState,
    SessionTracker,
    reaction_messages,
    scoped_session_id,
    session_keys,
)
from metaclaw.rollout.upstream import UpstreamPools
from metaclaw.skills.hooks import SkillInjectorLike
from metaclaw.store import GroupCommitWriter, Sample, SampleMeta, SampleStore, open_session_log
from metaclaw.store.meta import FitMeta
from metaclaw.wire import (
    ADAPTER_NAME_HEADER,
    ADAPTER_VERSION_HEADER,
    CLIENT_HEADER,
    RESPONSE_ID_HEADER,
    SESSION_HEADER,
    TURN_HEADER,
    RequestError,
    version_headers,
)
from metaclaw.wire.normalize import next_state_text, normalize_messages, normalize_tools

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
# httpcore scans every pooled connection (quadratically) on each request and response close; at 32 concurrent
# streams that cost ~2 ms CPU per request in one pool, so requests are spread round-robin over small pools.
dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class UpstreamError(Exception):
    """The upstream answered with an error status (or could not be reached: 502)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream returned {status}")
        self.status, self.body = status, body


@dataclass
class SessionLink:
    """Where a main turn sits in its session: the session's state, the turn's index, the writes it awaits."""

    state: SessionState | None = None
    turn_index: int = -1
    next_state_write: Future | None = None  # the previous turn's next state, committed before this turn replies
    query: Query | None = None  # derived sessions: the conversation, to leave its tail for the next request
    claimed_tail: Tail | None = None  # the tail this turn took from its session (restored if the turn fails)
    sample_id: int | None = None  # the stored sample, once written


@dataclass
class ClientAsk:
    """What the client asked to see: the extras it asked for itself, and the model id its replies carry."""

    logprobs: bool = False
    token_ids: bool = False
    model: Any = None  # the model id the client asked for: replies carry it, not the upstream's


@dataclass
class Turn:
    """One prepared request: what goes upstream and what the capture needs."""

    upstream_body: dict[str, Any]
    stream: bool
    asked: ClientAsk
    main: bool
    agent_id: str
    session_id: str
    done: bool
    messages: list[dict[str, Any]]
    temperature: float
    meta: SampleMeta = field(default_factory=SampleMeta)
    link: SessionLink = field(default_factory=SessionLink)
    capture: TurnCapture = field(default_factory=TurnCapture)
    adapter: str | None = None  # the adapter asked upstream (None: the base model or the client's model)
    response_id: str | None = None  # main turns: the reply's `id`, unique, stored with the sample

    @property
    def strips(self) -> bool:
        """Whether the client must not see some of what upstream returns (extras the proxy asked for itself)."""
        return self.main and not (self.asked.logprobs and self.asked.token_ids)

    def for_client(self, body: dict[str, Any]) -> dict[str, Any]:
        """An upstream body or chunk as the client sees it (in place): its model id, no extras of ours."""
        if self.asked.model is not None and "model" in body:
            body["model"] = self.asked.model
        body.pop("adapter_version", None)  # in the x-metaclaw-adapter-version header instead
        if self.response_id:
            body["id"] = self.response_id  # unique per turn, stored with the sample (`/v1/feedback` takes it)
        return strip_extras(body, self.asked.logprobs, self.asked.token_ids) if self.strips else body


def sampling_fields(body: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
    """`top_p`, `top_k` and `chat_template_kwargs` of a chat request (defaults 1, -1, {}); bad values → 400."""
    top_p, top_k = body.get("top_p", 1.0), body.get("top_k", -1)
    top_p = 1.0 if top_p is None else top_p
    top_k = -1 if top_k is None else top_k
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise RequestError(f"top_k must be -1, 0 (off) or a positive integer, got {top_k!r}")
    kwargs = body.get("chat_template_kwargs") or {}
    ok = isinstance(kwargs, dict) and len(kwargs) <= 16 and all(isinstance(k, str) for k in kwargs)
    if not ok or not all(v is None or isinstance(v, str | int | float | bool) for v in kwargs.values()):
        raise RequestError("chat_template_kwargs must be an object of at most 16 string/number/boolean values")
    return float(top_p), top_k, dict(kwargs)


class RolloutProxy:
    """The forwarding and capture core, independent of the HTTP framework.

    Args:
        store: where main turns are written.
        upstream_url: base URL of the policy server (or any OpenAI-compatible server in `skills_only`).
        upstream_api_key: bearer key for the upstream.
        policy_model: the served adapter's name (the OpenAI `model` upstream) once the server lists it.
        base_model: the model to ask for while no adapter is loaded; None forwards the client's `model`.
        capture: False in `skills_only` mode (forward only, nothing stored).
        default_temperature: used when the client sets none, so behaviour logprobs are well defined.
        default_agent_id: agent id when the client sends no `X-Agent-Id`.
        request_timeout_s: upstream timeout per request.
        model_refresh_s: how often the upstream's model list is re-read (to notice the first adapter).
        skills: optional skill injector (called on main turns).
        fit: image and context policies (`metaclaw.rollout.fit`); default: images per the upstream's model card,
            no context policy (no tokenizer).
        max_sessions: the most sessions remembered at once (least recently used evicted first).
        session_idle_s: a session not seen for this long is forgotten by the proxy.
        agents: the agents' profiles (`metaclaw.agents`): an agent's mode (a `skills_only` agent's turns are
            answered by the base model and not captured) and the adapter that answers it; default: one profile.
    """

    def __init__(
        self,
        store: SampleStore,
        upstream_url: str,
        upstream_api_key: str | None = None,
        policy_model: str | None = "policy",
        base_model: str | None = None,
        capture: bool = True,
        default_temperature: float = 1.0,
        default_agent_id: str = "default",
        request_timeout_s: float = 300.0,
        model_refresh_s: float = 2.0,
        skills: SkillInjectorLike | None = None,
        fit: ClientFit | None = None,
        max_sessions: int = 10000,
        session_idle_s: float = 3600.0,
        agents: AgentProfiles | None = None,
    ) -> None:
        self.store, self.policy_model, self.base_model, self.skills = store, policy_model, base_model, skills
        self.capture, self.default_temperature, self.default_agent_id = capture, default_temperature, default_agent_id
        self.upstream = UpstreamPools(upstream_url, upstream_api_key, request_timeout_s, model_refresh_s)
        self.sessions = SessionTracker(store, open_session_log(store), max_sessions, session_idle_s)
        self.writer: GroupCommitWriter | None = None
        self.fit = fit or ClientFit(ImagePolicy(), ContextPolicy(tokenizer=None))
        self.agents = agents or AgentProfiles(lora_name=policy_model or "policy")
        # skills_only: main turns of `skills_only` agents, answered and never captured for training
        self.stats = {"turns": 0, "captured": 0, "capture_errors": 0, "upstream_errors": 0, "skills_only": 0}

    @property
    def upstream_url(self) -> str:
        return self.upstream.url

    @property
    def upstream_models(self) -> set[str]:
        """The models the upstream listed last (`/v1/models`)."""
        return self.upstream.models

    @upstream_models.setter
    def upstream_models(self, models: set[str]) -> None:
        self.upstream.models = models

    @property
    def upstream_cards(self) -> dict[str, dict[str, Any]]:
        """The upstream's `/v1/models` entries by id (modalities, max_model_len)."""
        return self.upstream.cards

    @upstream_cards.setter
    def upstream_cards(self, cards: dict[str, dict[str, Any]]) -> None:
        self.upstream.cards = cards

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the shared upstream clients (keep-alive pools) and the store's group-commit writer."""
        if self.capture:
            self.writer = GroupCommitWriter(self.store)
        await self.upstream.start(refresh=bool(self.policy_model))

    async def stop(self) -> None:
        """Close the upstream clients and flush the writer (every accepted turn is committed)."""
        await self.upstream.stop()
        if self.writer:
            await asyncio.to_thread(self.writer.close)
            self.writer = None

    async def refresh_models(self) -> None:
        await self.upstream.refresh()

    def upstream_model(self, requested: Any, profile: AgentProfile | None = None) -> Any:
        """The agent's own adapter once the server lists it; the base model (or the client's model) before."""
        profile = profile or self.agents.default
        name = self.policy_model if profile is self.agents.default else profile.lora_name
        if profile.trains and name and self.policy_model and name in self.upstream_models:
            return name
        return self.base_model or requested

    def context_limit(self) -> int | None:
        """The context a client may budget for: the context policy's limit on the served base model's card."""
        return self.fit.context.limit(self.upstream_cards.get(self.base_model) if self.base_model else None)

    def agent_of(self, body: dict[str, Any], headers: dict[str, str]) -> str:
        """The agent: `X-Agent-Id`, else the body field `agent_id`, else the default; a bad id is a 400."""
        for value, field_name in ((headers.get("x-agent-id"), "X-Agent-Id"), (body.get("agent_id"), "agent_id")):
            if value is not None:
                try:
                    return check_agent_id(value, field_name)
                except ValueError as e:
                    raise RequestError(str(e)) from e
        return self.default_agent_id

    # ---- request preparation -----------------------------------------------------------------------------
    async def prepare(self, body: Any, headers: dict[str, str], client: str = "") -> Turn:
        """Validate and normalise an OpenAI chat request; allocate its turn. Raises `RequestError`.

        `client` names the caller (a digest of the key it presented): derived sessions never cross clients.
        """
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        messages, has_image = normalize_messages(body.get("messages"))
        sent = messages  # as the client sent them: skills and the context policy change `messages` below
        tools = normalize_tools(body.get("tools"))
        agent_id = self.agent_of(body, headers)
        profile = self.agents.resolve(agent_id)
        keys = session_keys(body, headers)
        turn_type = keys.turn_type
        session_id = scoped_session_id(keys.session_id, headers.get(CLIENT_HEADER)) if keys.session_id else ""
        temperature = self._temperature(body)
        top_p, top_k, template_kwargs = sampling_fields(body)
        main = turn_type == "main" and self.capture and profile.trains
        if turn_type == "main" and self.capture and not profile.trains:
            self.stats["skills_only"] += 1  # answered with skills, never captured for training
        # The distribution the behaviour logprobs are over, and how the prompt was rendered: the trainer and the
        # teacher reuse both (docs/training.md, "One distribution").
        dist = Dist.of(float(temperature), top_p, top_k)
        temp = dist.temperature  # the sample's `temperature` column: stored once (meta.sampling holds top_p/top_k)
        meta = SampleMeta(sampling={"top_p": dist.top_p, "top_k": dist.top_k},
                          chat_template_kwargs=template_kwargs or None,
                          fit=FitMeta(has_image=True if has_image else None))  # fmt: skip
        derive = self.capture and profile.trains and not keys.session_id
        if derive:  # taken before skills change the messages; never across clients, end users or system prompts
            partition = f"{client}\x1f{keys.end_user or ''}"
            query = Query.of(messages, agent_id, partition, lax=keys.end_user is not None)
        else:
            query = None
        if turn_type == "main" and self.skills is not None:  # also in skills_only (capture off)
            messages, names = await asyncio.to_thread(self.skills.inject, messages, agent_id)
            meta.skills, meta.skill_generation = names, self.skills.generation(agent_id)
        keep_lp, keep_ids = bool(body.get("logprobs")), bool(body.get("return_token_ids"))
        model = self.upstream_model(body.get("model"), profile)
        reply_budget = None
        if has_image or self.fit.context.active:
            messages, tools, reply_budget = await self._fit(body, messages, tools, has_image, model, meta)
        upstream = {k: v for k, v in body.items() if k not in ("messages", "tools", *BODY_EXTRAS)}
        upstream.update(messages=messages, temperature=temperature, model=model)
        if reply_budget is not None:
            upstream.pop("max_completion_tokens", None)
            upstream["max_tokens"] = reply_budget
        self._salt(upstream, agent_id, client)
        if tools:
            upstream["tools"] = tools
            meta.tools = tools
        if main:  # explicit top_p/top_k: an upstream's own defaults (generation_config) would go unrecorded
            upstream.update(logprobs=True, return_token_ids=True, top_p=top_p, top_k=top_k)
        turn = Turn(
            upstream_body=upstream,
            stream=bool(body.get("stream")),
            asked=ClientAsk(keep_lp, keep_ids, body.get("model") if isinstance(body.get("model"), str) else None),
            main=main,
            agent_id=agent_id,
            session_id=session_id,
            done=keys.done,
            messages=messages,
            temperature=temp,
            meta=meta,
            adapter=model if isinstance(model, str) and model in self.upstream_models - {self.base_model} else None,
        )
        if main:
            await self._link(turn, query, sent, keys.source)
        elif query is not None:
            turn.session_id = self.sessions.peek(query) or "auto"
        return turn

    def _temperature(self, body: dict[str, Any]) -> float:
        """The request's temperature (the default when it sets none); a bad value → 400."""
        temperature = body.get("temperature")
        if temperature is None:
            temperature = self.default_temperature
        if not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature < 0:
            raise RequestError("temperature must be a non-negative number")
        return temperature

    async def _fit(
        self, body: dict[str, Any], messages: list[dict[str, Any]], tools: Any, has_image: bool, model: Any,
        meta: SampleMeta,
    ) -> tuple[list[dict[str, Any]], Any, int | None]:  # fmt: skip
        """The image and context policies applied to the prompt; the reply's token budget when they set one."""
        reply_budget = None
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
        if limit is None and self.fit.context.active:  # Codex sends none: the rest of an 8k context is minutes
            limit = reply_budget = self.fit.context.reserve_tokens  # of CPU, past the agent's own timeout
        card = self.upstream_cards.get(model) if isinstance(model, str) else None
        messages, tools = await asyncio.to_thread(self.fit.apply, messages, tools, has_image, card, limit, meta)
        fitted = meta.fit.context if isinstance(meta.fit.context, dict) else {}
        room = fitted.get("limit", 0) - fitted.get("budget", 0)
        if fitted.get("action") == "truncated" and (limit or 0) > room > 0:  # a fitted prompt gets the room kept
            reply_budget = room  # for it (a CPU writes a 32,000-token reply for many minutes; finish: length)
        return messages, tools, reply_budget

    async def _link(self, turn: Turn, query: Query | None, sent: list[dict[str, Any]], source: str) -> None:
        """A main turn's place in its session (derived from the conversation, or named by headers); the previous
        turn's next state (the messages `sent` since its reply) is queued for the store's next group commit."""
        meta, agent_id, session_id = turn.meta, turn.agent_id, turn.session_id
        if query is not None:
            turn.link.state, turn.link.claimed_tail = self.sessions.claim(query, create=False)
            if turn.link.state is None and query.last_assistant >= 0:  # forgotten here (restart)? ask the store
                turn.link.state = await asyncio.to_thread(self.sessions.recover, query)
            if turn.link.state is None:
                turn.link.state, _ = self.sessions.claim(query)
            turn.link.query, turn.session_id = query, turn.link.state.session_id
        else:
            turn.link.state = self.sessions.state(agent_id, session_id)
        meta.origin.session_source = source
        turn.response_id = meta.response_id = f"chatcmpl-{uuid.uuid4().hex}"
        turn.link.turn_index, prev_id = self.sessions.begin_turn(turn.link.state)
        new = reaction_messages(sent, turn.link.state)  # `sent`: the fitted prompt may have dropped the last reply
        if prev_id is not None and new:  # committed with the next group; awaited before this turn replies
            text, state = next_state_text(new), turn.link.state
            if not text:  # the agent continued on its own (Claude Code after max_tokens): no reaction yet;
                state.awaiting = [*state.awaiting, prev_id][-AWAITING_MAX:]  # the person's next words answer it
            else:
                try:  # one group commit, in order: the last write's future stands for all of them
                    for sample_id in (*state.awaiting, prev_id):
                        turn.link.next_state_write = self.writer.submit_next_state(sample_id, text)
                    state.awaiting = []
                except Exception as e:  # noqa: BLE001 - a broken store never fails the request (`finish`)
                    self._capture_failed(turn, "the previous turn's next state", e)

    # ---- forwarding ---------------------------------------------------------------------------------------
    async def _send(self, turn: Turn) -> httpx.Response:
        self.stats["turns"] += 1
        client = self.upstream.next()
        req = client.build_request("POST", self.upstream.chat_url, json=turn.upstream_body)
        try:
            resp = await client.send(req, stream=turn.stream)
        except httpx.HTTPError as e:
            self.stats["upstream_errors"] += 1
            await self.finish(turn, ok=False)
            raise UpstreamError(502, json.dumps({"error": {"message": f"upstream unreachable: {e}"}}).encode()) from e
        if resp.status_code >= 400:
            body = await resp.aread()
            await resp.aclose()
            self.stats["upstream_errors"] += 1
            await self.finish(turn, ok=False)
            raise UpstreamError(resp.status_code, body)
        version = resp.headers.get(ADAPTER_VERSION_HEADER)
        if version is not None and version.lstrip("-").isdigit():
            turn.capture.adapter_version = int(version)
        return resp

    async def complete(self, turn: Turn) -> tuple[dict[str, Any], dict[str, str]]:
        """Non-streaming: the client's JSON body (captured and stored first) and headers to pass on."""
        resp = await self._send(turn)
        body = json.loads(resp.content)
        turn.capture.feed_response(body)
        await self.finish(turn)
        return turn.for_client(body), self._headers(turn)

    async def complete_bytes(self, turn: Turn) -> tuple[bytes, dict[str, str]]:
        """`complete` as the JSON bytes the client gets; upstream's own bytes when nothing is captured."""
        if not turn.main:
            resp = await self._send(turn)
            await self.finish(turn)
            return dumps(turn.for_client(json.loads(resp.content))).encode(), self._headers(turn)
        body, headers = await self.complete(turn)
        return dumps(body).encode(), headers

    async def open_sse(self, turn: Turn) -> tuple[AsyncIterator[bytes], dict[str, str]]:
        """Streaming, as the client's SSE bytes: events as they arrive, `[DONE]` only once the turn is stored.

        Events that arrive together are forwarded in one write; an event is re-serialised only when the proxy
        must strip its own extras, set the turn's id or restore the client's model id (side turns are parsed,
        not captured).
        """
        resp = await self._send(turn)

        async def sse() -> AsyncIterator[bytes]:
            completed, tail = False, b""
            try:
                async with aclosing(self._events(resp)) as stream:
                    async for events, done in stream:
                        out = b"".join([self._client_event(turn, event, data) for event, data in events])
                        if done:  # what came with [DONE] goes out with it, after the commit
                            tail = out
                        elif out:
                            yield out
                completed = turn.capture.error is None  # an upstream's error chunk: passed on, not captured
            except httpx.HTTPError as e:  # the upstream went away mid-stream: an error chunk, as OpenAI sends
                self._broken_stream(turn, e)
                tail = b"data: " + dumps(openai_error(f"the upstream failed mid-stream: {e}", 502)).encode() + b"\n\n"
            finally:
                await resp.aclose()
                await self.finish(turn, ok=completed)
            yield tail + SSE_DONE

        return sse(), self._headers(turn)

    async def open_stream(self, turn: Turn) -> tuple[AsyncIterator[dict[str, Any]], dict[str, str]]:
        """Streaming, as chunk dicts (stripped for the client); the turn is stored before the iterator ends.

        An upstream failure mid-stream ends the iterator with an `{"error": {...}}` chunk (the turn not captured).
        """
        resp = await self._send(turn)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            completed = False
            try:
                async with aclosing(self._events(resp)) as stream:
                    async for events, _ in stream:
                        for _, data in events:
                            chunk = json.loads(data)
                            turn.capture.feed_chunk(chunk)
                            yield turn.for_client(chunk)
                completed = turn.capture.error is None
            except httpx.HTTPError as e:  # said to the client as an `{"error": ...}` chunk, the stream's last
                self._broken_stream(turn, e)
                yield {"error": {"message": f"the upstream failed mid-stream: {e}", "type": "api_error"}}
            finally:
                await resp.aclose()
                await self.finish(turn, ok=completed)

        return chunks(), self._headers(turn)

    def _salt(self, upstream: dict[str, Any], agent_id: str, client: str) -> None:
        """Our policy server reuses cached prompt prefixes only within one agent and client key (`cache_salt`,
        vLLM's field): how fast a prompt is answered never says what another tenant asked. A client's own
        `cache_salt` is replaced; an upstream of someone else's (`skills_only`) is sent none."""
        upstream.pop("cache_salt", None)
        if self.capture:
            upstream["cache_salt"] = hashlib.blake2b(f"{agent_id}\x1f{client}".encode(), digest_size=12).hexdigest()

    async def legacy_completions(self, body: Any, agent_id: str | None = None, client: str = "") -> httpx.Response:
        """`/v1/completions` forwarded as is (the model id mapped as for chat; streamed or not), never captured:
        a raw prompt has no conversation to score, no session and no chat template (docs/clients.md).

        The caller's agent (`agent_of`: a per-agent key pins it) is answered by its own adapter, as in chat: a
        prompt's logprobs under the shared adapter would score text against other agents' data.

        Returns the open upstream response (the caller streams or reads it, then closes it). Raises
        `RequestError` for a body that is not an object, `UpstreamError` when the upstream fails."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if not isinstance(body.get("prompt"), str | list):
            raise RequestError("prompt must be a string or a list (of strings or token ids)", param="prompt")
        upstream = {k: v for k, v in body.items() if k not in BODY_EXTRAS}
        profile = self.agents.resolve(agent_id or self.default_agent_id)
        upstream["model"] = self.upstream_model(body.get("model"), profile)
        self._salt(upstream, agent_id or self.default_agent_id, client)
        self.stats["turns"] += 1
        pool = self.upstream.next()
        req = pool.build_request("POST", f"{self.upstream.url}/v1/completions", json=upstream)
        try:
            resp = await pool.send(req, stream=bool(body.get("stream")))
        except httpx.HTTPError as e:
            self.stats["upstream_errors"] += 1
            raise UpstreamError(502, json.dumps({"error": {"message": f"upstream unreachable: {e}"}}).encode()) from e
        if resp.status_code >= 400:
            content = await resp.aread()
            await resp.aclose()
            self.stats["upstream_errors"] += 1
            raise UpstreamError(resp.status_code, content)
        return resp

    @staticmethod
    async def _events(resp: httpx.Response) -> AsyncIterator[tuple[list[tuple[bytes, bytes]], bool]]:
        """Upstream SSE data events `(event, data)`, one list per network read, and whether `[DONE]` ended it."""
        rest = b""
        body = resp.aiter_bytes()
        async for raw in body:
            events, rest = split_sse(rest + raw)
            batch = []
            for event in events:
                data = sse_data(event)
                if data is None:
                    continue
                if len(data) < 16 and data.strip() == b"[DONE]":
                    yield batch, True
                    async for _ in body:  # read to the end, so the connection goes back to the keep-alive pool
                        pass
                    return
                batch.append((event, data))
            if batch:
                yield batch, False
        data = sse_data(rest.strip())  # a last event without its blank line
        if data is not None and data.strip() != b"[DONE]":
            yield [(rest.strip(), data)], False

    @staticmethod
    def _client_event(turn: Turn, event: bytes, data: bytes) -> bytes:
        """Capture one upstream event; what the client gets of it (with the turn's own id, extras stripped)."""
        chunk = json.loads(data)
        if "error" in chunk and not chunk.get("choices"):  # the upstream failed mid-stream: OpenAI's error chunk
            turn.capture.error = chunk["error"]
            message, type_, code = stream_error(chunk["error"])
            return b"data: " + dumps(openai_error(message, 500, type_, code)).encode() + b"\n\n"
        if turn.main:
            turn.capture.feed_chunk(chunk)
        model_ok = turn.asked.model is None or chunk.get("model", turn.asked.model) == turn.asked.model
        if not turn.response_id and not turn.strips and model_ok and "adapter_version" not in chunk:
            return event + b"\n\n"
        return b"data: " + dumps(turn.for_client(chunk)).encode() + b"\n\n"

    def _headers(self, turn: Turn) -> dict[str, str]:
        out = version_headers(turn.capture.adapter_version)
        if turn.adapter:
            out[ADAPTER_NAME_HEADER] = turn.adapter
        if turn.response_id:
            out[RESPONSE_ID_HEADER] = turn.response_id
            out[SESSION_HEADER], out[TURN_HEADER] = turn.session_id, str(turn.link.turn_index)
        return out

    # ---- capture ------------------------------------------------------------------------------------------
    async def finish(self, turn: Turn, ok: bool = True) -> None:
        """Make the turn durable (sample insert, previous turn's next state, session done) before replying.

        A store that cannot write (a full disk, a read-only or broken SQLite file) never fails the user's request:
        the reply goes out as the upstream gave it, and the loss is logged and counted (`capture_errors`, the
        `rollout/capture_failures` metric).
        """
        if ok:  # metaclaw_tokens (docs/operate.md): the upstream's usage, else the token ids it returned
            cap, usage = turn.capture, turn.capture.usage or {}
            metrics.count_tokens("proxy", self.agents.resolve(turn.agent_id).name,
                                 int(usage.get("prompt_tokens") or len(cap.prompt_ids)),
                                 int(usage.get("completion_tokens") or len(cap.response_ids)))  # fmt: skip
        if turn.link.next_state_write is not None:
            write, turn.link.next_state_write = turn.link.next_state_write, None
            try:
                await asyncio.shield(asyncio.wrap_future(write))
            except Exception as e:  # noqa: BLE001 - see the docstring
                self._capture_failed(turn, "the previous turn's next state", e)
        if not turn.main or turn.link.state is None:
            return
        state, turn.link.state = turn.link.state, None
        if turn.link.query is not None:  # derived session: the next request of this conversation extends this reply
            tail = turn.link.query.tail(turn.capture.assistant_message()) if ok else turn.link.claimed_tail
            self.sessions.set_tail(state, tail)
            if tail is not None:
                turn.meta.origin.conv_tail = tail.full  # lets a restarted proxy find the session again
        sample = self._sample(turn) if ok else None
        write = None
        if sample is not None:
            try:
                write = self.writer.submit(sample)
            except ValueError as e:  # the sample or the backlog bound: said by `_not_captured`
                self._not_captured(turn, str(e))
            except Exception as e:  # noqa: BLE001 - the store itself failed
                self._capture_failed(turn, "the turn", e)
        if write is None:
            self.sessions.end_turn(state, turn.link.turn_index, None)
        else:
            # Session bookkeeping runs on commit even if this request is cancelled meanwhile.
            write.add_done_callback(lambda w: self._stored(state, turn.link.turn_index, w))
            try:
                turn.link.sample_id = await asyncio.shield(asyncio.wrap_future(write))
            except Exception as e:  # noqa: BLE001 - see the docstring
                self._capture_failed(turn, "the turn", e)
            else:
                log.debug(
                    "Captured %s turn %d (agent %s): %d prompt + %d response tokens, adapter v%d",
                    turn.session_id,
                    turn.link.turn_index,
                    turn.agent_id,
                    len(sample.prompt_ids),
                    len(sample.response_ids),
                    sample.adapter_version,
                )
        if ok and turn.done:
            try:
                await asyncio.to_thread(self.sessions.log.touch, turn.agent_id, turn.session_id, True)
            except Exception as e:  # noqa: BLE001 - see the docstring
                self._capture_failed(turn, "the session's end", e)

    def _broken_stream(self, turn: Turn, error: BaseException) -> None:
        self.stats["upstream_errors"] += 1
        turn.capture.error = f"the upstream failed mid-stream: {error}"
        log.warning("Upstream stream of session %s turn %d broke: %s", turn.session_id, turn.link.turn_index, error)

    def _capture_failed(self, turn: Turn, what: str, error: BaseException) -> None:
        """The store could not record `what`: counted and logged loudly; the user's reply goes out regardless."""
        self.stats["capture_errors"] += 1
        log.error(
            "CAPTURE LOST: %s of session %s turn %d (agent %s) could not be stored (%s: %s); the client still got "
            "its reply. Check the store's disk (full? read-only?): turns are not being recorded for training.",
            what, turn.session_id, turn.link.turn_index, turn.agent_id, type(error).__name__, error,
        )  # fmt: skip

    def _sample(self, turn: Turn) -> Sample | None:
        """The turn as a sample, or None (logged and counted) when the server's reply cannot be trained on."""
        cap = turn.capture
        problem = cap.problems()
        if problem is not None:
            self._not_captured(turn, problem)
            return None
        meta = SampleMeta.of(turn.meta)
        meta.origin.finish_reason, meta.origin.captured_at = cap.finish_reason, time.time()
        status = "dropped" if meta.dropped else "pending"  # e.g. images: the trainer is text-only
        return cap.to_sample(
            agent_id=turn.agent_id,
            session_id=turn.session_id,
            turn_index=turn.link.turn_index,
            temperature=turn.temperature,
            messages=turn.messages,
            status=status,
            meta=meta,
        )

    def _not_captured(self, turn: Turn, problem: str) -> None:
        self.stats["capture_errors"] += 1
        log.warning("Turn %s/%d not captured: %s", turn.session_id, turn.link.turn_index, problem)

    def _stored(self, state: SessionState, turn_index: int, write: Future) -> None:
        """On the writer thread, once the sample's commit returned (or failed)."""
        sample_id = None if write.cancelled() or write.exception() is not None else write.result()
        if sample_id is not None:
            self.stats["captured"] += 1
        self.sessions.end_turn(state, turn_index, sample_id)

    async def mark_done(self, agent_id: str, session_id: str) -> bool:
        """Mark a session finished (its last turn is then scored); False when the session is unknown."""
        if not await asyncio.to_thread(self.sessions.known, agent_id, session_id):
            return False
        await asyncio.to_thread(self.sessions.log.touch, agent_id, session_id, True)
        return True
