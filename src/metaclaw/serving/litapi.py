"""LitServe glue: `PolicySpec` (the HTTP routes, in the API-server process) and `PolicyAPI` (the engine, in the
inference-worker process).

LitServe runs the model in a separate worker process. Every route of the policy server therefore goes through
LitServe's request queue to that one worker, tagged with an operation (`chat`, `completions`, `models`,
`load_adapter`, `unload_adapter`), so a hot-loaded adapter is immediately visible to the next chat request. The
worker runs LitServe's async streaming loop: requests are concurrent tasks, each engine call runs in a thread,
and every result (a JSON response or an SSE chunk) streams back as a dict. We use our own spec because
litserve 0.2.19's `OpenAISpec` drops logprobs and always reports `finish_reason: "stop"`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import litserve as ls
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus

from metaclaw.ops import metrics
from metaclaw.serving.litserve_compat import submit
from metaclaw.wire import RequestError
from metaclaw.wire.bodies import BodyError, load_json
from metaclaw.wire.errors import error_response

log = logging.getLogger(__name__)

_END = object()


def error_reply(err: RequestError) -> JSONResponse:
    """`err` as the one error body (`metaclaw.wire.errors.error_response`)."""
    return error_response(err.message, err.status, type_=err.type, code=err.code or err.status, param=err.param)


class PolicySpec(LitSpec):
    """The OpenAI/vLLM-compatible routes; each forwards `{op, body}` to the worker and relays its events.

    Args:
        request_timeout_s: a request that produces nothing for this long gets 504 (or an SSE error event).
    """

    ROUTES = (
        ("/v1/chat/completions", "chat", "POST"),
        ("/v1/completions", "completions", "POST"),
        ("/v1/models", "models", "GET"),
        ("/v1/load_lora_adapter", "load_adapter", "POST"),
        ("/v1/unload_lora_adapter", "unload_adapter", "POST"),
    )

    def __init__(self, request_timeout_s: float = 300.0) -> None:
        super().__init__()
        self.api_path = "/v1/chat/completions"
        self.request_timeout_s = request_timeout_s

    @property
    def stream(self) -> bool:
        return True

    def __getstate__(self) -> dict:
        """The worker process needs no routes (closures do not pickle)."""
        state = super().__getstate__()
        state["_endpoints"] = []
        return state

    def pre_setup(self, lit_api: ls.LitAPI) -> None:
        for path, op, method in self.ROUTES:
            self.add_endpoint(path, self._route(op, method == "POST"), [method])

    def decode_request(self, request: Any, context_kwargs: dict | None = None) -> Any:
        return request

    def encode_response(self, output: Any, context_kwargs: dict | None = None) -> Any:
        return output

    def _route(self, op: str, has_body: bool):
        async def endpoint(request: Request) -> Response:
            return await self.call(op, request if has_body else None)

        endpoint.__name__ = f"policy_{op}"
        return endpoint

    async def call(self, op: str, request: Request | None) -> Response:
        body = None
        if request is not None:
            try:
                body = load_json(await request.body())  # bounded depth: nothing deep reaches the worker queue
            except BodyError as exc:
                return error_reply(RequestError(str(exc)))
        deadline = time.monotonic() + self.request_timeout_s
        events = self._count_tokens(self._submit(op, body), body)
        head = await self._next(events, deadline)
        if head is _END or head is None:
            await events.aclose()
            return error_reply(RequestError("the request timed out", 504, "timeout", type_="timeout_error"))
        if head.get("stream"):
            return StreamingResponse(
                self._sse(events, deadline), media_type="text/event-stream", headers=head.get("headers") or {}
            )
        await events.aclose()
        return JSONResponse(head["body"], status_code=head["status"], headers=head.get("headers") or {})

    async def _next(self, events: AsyncIterator[dict], deadline: float) -> dict | object | None:
        try:
            return await asyncio.wait_for(anext(events, _END), max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            return None

    async def _sse(self, events: AsyncIterator[dict], deadline: float) -> AsyncIterator[str]:
        try:
            while True:
                event = await self._next(events, deadline)
                if event is _END:
                    break
                if event is None:
                    timeout = RequestError("the request timed out", 504, "timeout", type_="timeout_error")
                    yield f"data: {json.dumps(timeout.body())}\n\n"
                    break
                if "chunk" not in event:  # an error after the stream started
                    yield f"data: {json.dumps(event.get('body'))}\n\n"
                    break
                yield f"data: {json.dumps(event['chunk'])}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    @staticmethod
    async def _count_tokens(events: AsyncIterator[dict], body: Any) -> AsyncIterator[dict]:
        """`events`, passed on; their usage (else their token ids) is added to `metaclaw_tokens` by model name."""
        model = body.get("model") if isinstance(body, dict) else None
        counts = [0, 0]  # prompt, completion
        try:
            async for event in events:
                found = event.get("body") if "body" in event else event.get("chunk")
                if isinstance(found, dict):
                    usage = found.get("usage") or {}
                    choices = found.get("choices") or [{}]
                    counts[0] = usage.get("prompt_tokens") or len(found.get("prompt_token_ids") or ()) or counts[0]
                    counts[1] = usage.get("completion_tokens") or counts[1] + len(choices[0].get("token_ids") or ())
                yield event
        finally:
            metrics.count_tokens("policy", model if isinstance(model, str) else "default", *counts)

    async def _submit(self, op: str, body: Any) -> AsyncIterator[dict]:
        """Queue `{op, body}` for the worker and yield the events it streams back."""
        uid, queue, event = submit(self, {"op": op, "body": body})  # LitServe internals: litserve_compat
        try:
            async for data, status in self.data_streamer(queue, event, send_status=True):
                if status == LitAPIStatus.ERROR:
                    log.error("worker error for %s: %r", op, data)
                    err = RequestError("internal error (see the server log)", 500, type_="internal_server_error")
                    yield {"status": 500, "headers": {}, "body": err.body()}
                    return
                yield json.loads(data)
        finally:
            self.response_buffer.pop(uid, None)


class PolicyAPI(ls.LitAPI):
    """Builds the engine in the worker (`setup`) and runs each operation of `PolicyService` in a thread.

    Args:
        engine_factory: a picklable callable `(device) -> Engine` (runs in the worker process).
        adapter_root: root directory that adapter paths must stay inside.
        default_max_tokens: chat completion budget when the request sets none (None: rest of the context).
        model_root: the base model's `root` in `/v1/models`.
        request_timeout_s: see `PolicySpec`.
        max_concurrency: engine calls running or waiting at once in the worker.
        info: the server's effective config, reported in `/v1/models` (the base model's `metaclaw` field).
    """

    def __init__(
        self,
        engine_factory: Any,
        adapter_root: str,
        default_max_tokens: int | None = None,
        model_root: str = "",
        request_timeout_s: float = 300.0,
        max_concurrency: int = 64,
        info: dict[str, Any] | None = None,
        tool_call_format: str = "auto",
    ) -> None:
        super().__init__(spec=PolicySpec(request_timeout_s), enable_async=True)
        self.tool_call_format = tool_call_format
        self.info = info
        self.engine_factory = engine_factory
        self.adapter_root = adapter_root
        self.default_max_tokens = default_max_tokens
        self.model_root = model_root
        self.max_concurrency = max_concurrency

    def setup(self, device: str) -> None:
        import multiprocessing

        from metaclaw.serving.service import PolicyService

        if multiprocessing.parent_process() is not None:  # LitServe's spawned inference worker: die with the server
            from metaclaw.lifecycle import bind_to_spawning_parent

            bind_to_spawning_parent()

        if not logging.getLogger("metaclaw").handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            logging.getLogger("metaclaw").setLevel(logging.INFO)
        from metaclaw.profiling import start_from_env

        start_from_env("server-worker")
        self.engine = self.engine_factory(device)
        if self.info is not None:  # what the worker really runs with (devices.cpu_threads.serve)
            import torch

            self.info.setdefault("effective", {})["torch_threads"] = torch.get_num_threads()
        self.service = PolicyService(
            self.engine, self.adapter_root, self.default_max_tokens, self.model_root, info=self.info,
            tool_call_format=self.tool_call_format,
        )  # fmt: skip
        self.pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="engine")
        log.info("Engine ready: %s on %s (adapter root %s)", self.engine.model_name, device, self.adapter_root)

    async def decode_request(self, request: dict) -> dict:
        return request

    async def predict(self, x: dict) -> AsyncIterator[dict]:
        async for event in _iterate_in_thread(self.pool, lambda: self.service.handle(x["op"], x["body"])):
            yield event

    async def encode_response(self, output: AsyncIterator[dict]) -> AsyncIterator[dict]:
        async for event in output:
            yield event


async def _iterate_in_thread(pool: ThreadPoolExecutor, make: Any) -> AsyncIterator[Any]:
    """Drive the sync iterator `make()` in `pool`, handing items to the event loop as they come."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = False

    def run() -> None:
        try:
            iterator: Iterator[Any] = make()
            for item in iterator:
                loop.call_soon_threadsafe(queue.put_nowait, (item, None))
                if stop:
                    break
        except BaseException as exc:  # noqa: BLE001 - re-raised in the event loop
            loop.call_soon_threadsafe(queue.put_nowait, (_END, exc))
            return
        loop.call_soon_threadsafe(queue.put_nowait, (_END, None))

    future = loop.run_in_executor(pool, run)
    try:
        while True:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                break
            yield item
    finally:
        stop = True  # the thread finishes its current item, then exits
        if not future.done():
            await asyncio.shield(future)
