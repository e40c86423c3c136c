"""`RolloutProxy`: forwards chat turns to the policy server and captures every main turn in the `SampleStore`.

Per request: normalise messages, resolve session/turn (headers or derived), inject skills, ask upstream for
`logprobs` and `return_token_ids`, pass the stream through chunk by chunk, and write the sample (in a thread)
before the final chunk / JSON goes out. The previous main turn of the session gets its `next_state`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from metaclaw.datamodules.store import SampleStore
from metaclaw.rollout.capture import TurnCapture, strip_extras
from metaclaw.rollout.normalize import RequestError, next_state_text, normalize_messages, normalize_tools
from metaclaw.rollout.sessions import (
    SessionLog,
    SessionState,
    SessionTracker,
    derive_session_id,
    new_messages_since_last_assistant,
)
from metaclaw.rollout.skills_hook import SkillInjectorLike

log = logging.getLogger(__name__)

ADAPTER_HEADER = "x-metaclaw-adapter-version"
TRUE = ("1", "true", "yes", "on")


class UpstreamError(Exception):
    """The upstream answered with an error status (or could not be reached: 502)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream returned {status}")
        self.status, self.body = status, body


@dataclass
class Turn:
    """One prepared request: what goes upstream and what the capture needs."""

    upstream_body: dict[str, Any]
    stream: bool
    keep_logprobs: bool
    keep_token_ids: bool
    main: bool
    agent_id: str
    session_id: str
    done: bool
    messages: list[dict[str, Any]]
    temperature: float
    meta: dict[str, Any] = field(default_factory=dict)
    state: SessionState | None = None
    turn_index: int = -1
    next_state_task: asyncio.Task | None = None
    capture: TurnCapture = field(default_factory=TurnCapture)
    sample_id: int | None = None


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
    ) -> None:
        self.store, self.upstream_url = store, upstream_url.rstrip("/")
        self.upstream_api_key, self.policy_model, self.base_model = upstream_api_key, policy_model, base_model
        self.capture, self.default_temperature, self.default_agent_id = capture, default_temperature, default_agent_id
        self.request_timeout_s, self.model_refresh_s, self.skills = request_timeout_s, model_refresh_s, skills
        self.sessions = SessionTracker(store, SessionLog(store.path))
        self.client: httpx.AsyncClient | None = None
        self.upstream_models: set[str] = set()
        self.stats = {"turns": 0, "captured": 0, "capture_errors": 0, "upstream_errors": 0}
        self._refresher: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.upstream_api_key}"} if self.upstream_api_key else {}
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        self.client = httpx.AsyncClient(
            base_url=self.upstream_url, headers=headers, timeout=self.request_timeout_s, limits=limits
        )
        if self.policy_model and self.model_refresh_s > 0:
            await self.refresh_models()
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
        if self.client:
            await self.client.aclose()

    async def refresh_models(self) -> None:
        try:
            r = await self.client.get("/v1/models", timeout=5.0)
            self.upstream_models = {m["id"] for m in r.json().get("data", [])}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.model_refresh_s)
            await self.refresh_models()

    def upstream_model(self, requested: Any) -> Any:
        if self.policy_model and self.policy_model in self.upstream_models:
            return self.policy_model
        return self.base_model or requested

    # ---- request preparation -----------------------------------------------------------------------------
    async def prepare(self, body: Any, headers: dict[str, str]) -> Turn:
        """Validate and normalise an OpenAI chat request; allocate its turn. Raises `RequestError`."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        messages, has_image = normalize_messages(body.get("messages"))
        tools = normalize_tools(body.get("tools"))
        agent_id = headers.get("x-agent-id") or self.default_agent_id
        turn_type = (headers.get("x-turn-type") or "main").lower()
        if turn_type not in ("main", "side"):
            raise RequestError(f"X-Turn-Type must be main or side, got {turn_type!r}")
        session_id = headers.get("x-session-id") or derive_session_id(messages, agent_id)
        temperature = body.get("temperature")
        if temperature is None:
            temperature = self.default_temperature
        if not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature < 0:
            raise RequestError("temperature must be a non-negative number")
        main = turn_type == "main" and self.capture
        meta: dict[str, Any] = {"finish_reason": None}
        if has_image:
            meta["has_image"] = True
        if main and self.skills is not None:
            messages, names = await asyncio.to_thread(self.skills.inject, messages, agent_id)
            meta["skills"] = names
            meta["skill_generation"] = self.skills.generation(agent_id)
        keep_lp, keep_ids = bool(body.get("logprobs")), bool(body.get("return_token_ids"))
        upstream = {k: v for k, v in body.items() if k not in ("messages", "tools")}
        upstream.update(messages=messages, temperature=temperature, model=self.upstream_model(body.get("model")))
        if tools:
            upstream["tools"] = tools
            meta["tools"] = tools
        if main:
            upstream.update(logprobs=True, return_token_ids=True)
        turn = Turn(
            upstream_body=upstream,
            stream=bool(body.get("stream")),
            keep_logprobs=keep_lp,
            keep_token_ids=keep_ids,
            main=main,
            agent_id=agent_id,
            session_id=session_id,
            done=(headers.get("x-session-done") or "").lower() in TRUE,
            messages=messages,
            temperature=float(temperature) if temperature > 0 else 1.0,
            meta=meta,
        )
        if main:
            turn.state = self.sessions.state(agent_id, session_id)
            turn.turn_index, prev_id = self.sessions.begin_turn(turn.state)
            new = new_messages_since_last_assistant(messages)
            if prev_id is not None and new:
                turn.next_state_task = asyncio.create_task(
                    asyncio.to_thread(self.store.set_next_state, prev_id, next_state_text(new))
                )
        return turn

    # ---- forwarding ---------------------------------------------------------------------------------------
    async def _send(self, turn: Turn) -> httpx.Response:
        self.stats["turns"] += 1
        req = self.client.build_request("POST", "/v1/chat/completions", json=turn.upstream_body)
        try:
            resp = await self.client.send(req, stream=turn.stream)
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
        version = resp.headers.get(ADAPTER_HEADER)
        if version is not None and version.lstrip("-").isdigit():
            turn.capture.adapter_version = int(version)
        return resp

    async def complete(self, turn: Turn) -> tuple[dict[str, Any], dict[str, str]]:
        """Non-streaming: the client's JSON body (captured and stored first) and headers to pass on."""
        resp = await self._send(turn)
        body = resp.json()
        turn.capture.feed_response(body)
        await self.finish(turn)
        return strip_extras(body, turn.keep_logprobs, turn.keep_token_ids), self._headers(turn)

    async def open_stream(self, turn: Turn) -> tuple[AsyncIterator[dict[str, Any]], dict[str, str]]:
        """Streaming: chunks as they arrive (stripped for the client); stored before the iterator ends."""
        resp = await self._send(turn)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            completed = False
            try:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    turn.capture.feed_chunk(chunk)
                    yield strip_extras(chunk, turn.keep_logprobs, turn.keep_token_ids)
                completed = True
            finally:
                await resp.aclose()
                await self.finish(turn, ok=completed)

        return chunks(), self._headers(turn)

    def _headers(self, turn: Turn) -> dict[str, str]:
        v = turn.capture.adapter_version
        return {} if v is None else {ADAPTER_HEADER: str(v)}

    # ---- capture ------------------------------------------------------------------------------------------
    async def finish(self, turn: Turn, ok: bool = True) -> None:
        """Make the turn durable (sample insert, previous turn's next state, session done) before replying."""
        if turn.next_state_task is not None:
            await turn.next_state_task
            turn.next_state_task = None
        if not turn.main or turn.state is None:
            return
        if turn.sample_id is None and ok:
            await asyncio.to_thread(self._write, turn)
        else:
            self.sessions.end_turn(turn.state, turn.turn_index, None)
        turn.state = None

    def _write(self, turn: Turn) -> None:
        cap = turn.capture
        problem = cap.problems()
        sample_id = None
        if problem is None:
            meta = {**turn.meta, "finish_reason": cap.finish_reason, "captured_at": time.time()}
            status = "pending"
            if turn.meta.get("has_image"):
                status, meta["dropped"] = "dropped", "image"
            sample = cap.to_sample(
                agent_id=turn.agent_id,
                session_id=turn.session_id,
                turn_index=turn.turn_index,
                temperature=turn.temperature,
                messages=turn.messages,
                status=status,
                meta=meta,
            )
            try:
                sample_id = self.store.insert(sample)
                self.stats["captured"] += 1
                log.info(
                    "Captured %s turn %d (agent %s): %d prompt + %d response tokens, adapter v%d",
                    turn.session_id,
                    turn.turn_index,
                    turn.agent_id,
                    len(cap.prompt_ids),
                    len(cap.response_ids),
                    sample.adapter_version,
                )
            except ValueError as e:
                problem = str(e)
        if problem is not None:
            self.stats["capture_errors"] += 1
            log.warning("Turn %s/%d not captured: %s", turn.session_id, turn.turn_index, problem)
        self.sessions.end_turn(turn.state, turn.turn_index, sample_id)
        if turn.done:
            self.sessions.log.touch(turn.agent_id, turn.session_id, done=True)

    async def mark_done(self, agent_id: str, session_id: str) -> bool:
        """Mark a session finished (its last turn is then scored); False when the session is unknown."""
        if not await asyncio.to_thread(self.sessions.known, agent_id, session_id):
            return False
        await asyncio.to_thread(self.sessions.log.touch, agent_id, session_id, True)
        return True
