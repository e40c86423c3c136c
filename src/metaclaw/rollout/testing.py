"""A scripted OpenAI-compatible upstream with the policy server's response shapes, for tests and the bench.

It "tokenises" by words (one id per word, stable hash), answers with a scripted reply (or a tool call when
the request has tools and the last user message says "tool"), and reports `prompt_token_ids`, `token_ids`,
`logprobs`, the adapter version (header and body), `/v1/completions` prompt logprobs and adapter loading.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from metaclaw.messages import content_text


def word_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % 1000 + 10 for w in text.split()]


def scripted_upstream(
    reply: str | Callable[[dict[str, Any]], str] = "Sure, here is the answer.",
    delay_s: float = 0.0,
    base_model: str = "tiny",
    prompt_logprob: Callable[[list[int]], float] | None = None,
    answer_n: bool = False,
) -> FastAPI:
    """The app; `reply` may be a function of the request body; `delay_s` sleeps between streamed chunks;
    `prompt_logprob` gives the logprob of every token of a scored prompt (`/v1/completions`) from its ids (default
    -0.5); `answer_n`: a non-streamed chat answer has the request's `n` choices (the same reply each), not one."""
    app = FastAPI()
    state: dict[str, Any] = {"version": 0, "adapters": {}, "requests": [], "completions": []}
    app.state.scripted = state

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m} for m in [base_model, *state["adapters"]]]}

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> dict:
        body = await request.json()
        state["version"] += 1
        state["adapters"][body["lora_name"]] = body["lora_path"]
        return {"status": "ok", "version": state["version"]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        state["completions"].append(body)
        ids = body["prompt"]
        lp = -0.5 if prompt_logprob is None else prompt_logprob(ids)
        lps = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t in ids[1:]]
        return {"choices": [{"text": "", "prompt_logprobs": lps, "finish_reason": "length"}], "model": body["model"]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["requests"].append(body)
        if body.get("model") not in (base_model, *state["adapters"]):
            return JSONResponse({"error": {"message": f"unknown model {body.get('model')}"}}, status_code=404)
        answer = _answer(body, reply, state["version"] if body.get("model") != base_model else 0)
        headers = {"x-metaclaw-adapter-version": str(answer.version)}
        if not body.get("stream"):
            return JSONResponse(_completion(answer, int(body.get("n") or 1) if answer_n else 1), headers=headers)
        return StreamingResponse(_chunks(answer, delay_s), media_type="text/event-stream", headers=headers)

    return app


def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
    return [1] + [i for m in messages for i in word_ids(f"{m.get('role')} {content_text(m.get('content'))}")] + [2]


@dataclass
class _Answer:
    """One scripted chat answer: its text (or tool call), ids, logprobs and what the request asked back."""

    body: dict[str, Any]
    text: str
    tool: bool
    call: dict[str, Any]
    resp_ids: list[int]
    version: int
    want_lp: Any
    want_ids: Any

    @property
    def finish(self) -> str:
        return "tool_calls" if self.tool else "stop"

    @property
    def words(self) -> list[str]:
        return self.text.split(" ") if self.text else []

    @property
    def base(self) -> dict[str, Any]:
        return {"id": f"chatcmpl-{time.time_ns()}", "model": self.body["model"], "created": int(time.time()),
                "adapter_version": self.version}  # fmt: skip


def _answer(body: dict[str, Any], reply: str | Callable[[dict[str, Any]], str], version: int) -> _Answer:
    last_user = next((content_text(m.get("content")) for m in reversed(body["messages"]) if m["role"] == "user"), "")
    tool = bool(body.get("tools")) and "tool" in last_user
    text = "" if tool else (reply(body) if callable(reply) else reply)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": body["tools"][0]["function"]["name"] if tool else "", "arguments": '{"city": "Berlin"}'},
    }
    words = text.split(" ") if text else []
    resp_ids = ([i for w in words for i in word_ids(w)] if text else word_ids("tool call berlin")) + [3]
    return _Answer(body, text, tool, call, resp_ids, version, body.get("logprobs"), body.get("return_token_ids"))


def _completion(a: _Answer, n: int = 1) -> dict[str, Any]:
    """The non-streamed answer (`chat.completion`), as `n` choices."""
    msg: dict[str, Any] = {"role": "assistant", "content": a.text or None}
    if a.tool:
        msg["tool_calls"] = [a.call]
    choice: dict[str, Any] = {"index": 0, "message": msg, "finish_reason": a.finish}
    if a.want_lp:
        choice["logprobs"] = {"content": [{"token": str(t), "logprob": -0.25} for t in a.resp_ids]}
    p_ids = prompt_ids(a.body["messages"])
    out = {
        **a.base,
        "object": "chat.completion",
        "choices": [choice],
        "usage": {"prompt_tokens": len(p_ids), "completion_tokens": len(a.resp_ids)},
    }
    if a.want_ids:
        choice["token_ids"] = a.resp_ids
        out["prompt_token_ids"] = p_ids
    out["choices"] += [{**choice, "index": i} for i in range(1, n)]
    return out


async def _chunks(a: _Answer, delay_s: float) -> AsyncIterator[str]:
    """The streamed answer: a chunk per word (or the tool call), then the finish chunk and `[DONE]`."""
    pieces: list[tuple[dict[str, Any], list[int]]] = []
    if a.tool:
        pieces.append(({"role": "assistant", "tool_calls": [{"index": 0, **a.call}]}, a.resp_ids[:-1]))
    else:
        n = len(a.words)
        pieces += [({"content": w + (" " if k < n - 1 else "")}, word_ids(w)) for k, w in enumerate(a.words)]
    pieces.append(({}, [3]))
    base = a.base
    for k, (delta, ids) in enumerate(pieces):
        last = k == len(pieces) - 1
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": a.finish if last else None}
        if a.want_lp:
            choice["logprobs"] = {"content": [{"token": str(t), "logprob": -0.25} for t in ids]}
        if a.want_ids:
            choice["token_ids"] = ids
        chunk = {**base, "object": "chat.completion.chunk", "choices": [choice]}
        if k == 0 and a.want_ids:
            chunk["prompt_token_ids"] = prompt_ids(a.body["messages"])
        yield f"data: {json.dumps(chunk)}\n\n"
        if delay_s:
            await asyncio.sleep(delay_s)
    yield "data: [DONE]\n\n"
