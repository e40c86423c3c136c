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
from collections.abc import Callable
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
) -> FastAPI:
    """The app; `reply` may be a function of the request body; `delay_s` sleeps between streamed chunks."""
    app = FastAPI()
    state: dict[str, Any] = {"version": 0, "adapters": {}, "requests": [], "completions": []}
    app.state.scripted = state

    def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
        return [1] + [i for m in messages for i in word_ids(f"{m.get('role')} {content_text(m.get('content'))}")] + [2]

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
        lps = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in ids[1:]]
        return {"choices": [{"text": "", "prompt_logprobs": lps, "finish_reason": "length"}], "model": body["model"]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["requests"].append(body)
        if body.get("model") not in (base_model, *state["adapters"]):
            return JSONResponse({"error": {"message": f"unknown model {body.get('model')}"}}, status_code=404)
        last_user = next(
            (content_text(m.get("content")) for m in reversed(body["messages"]) if m["role"] == "user"), ""
        )
        tool = bool(body.get("tools")) and "tool" in last_user
        text = "" if tool else (reply(body) if callable(reply) else reply)
        words = text.split(" ") if text else []
        call = {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": body["tools"][0]["function"]["name"] if tool else "",
                "arguments": '{"city": "Berlin"}',
            },
        }
        resp_ids = [i for w in words for i in word_ids(w)] if text else word_ids("tool call berlin")
        resp_ids = resp_ids + [3]
        lps = [-0.25] * len(resp_ids)
        version = state["version"] if body.get("model") != base_model else 0
        headers = {"x-metaclaw-adapter-version": str(version)}
        finish = "tool_calls" if tool else "stop"
        p_ids = prompt_ids(body["messages"])
        want_lp, want_ids = body.get("logprobs"), body.get("return_token_ids")
        base = {
            "id": f"chatcmpl-{time.time_ns()}",
            "model": body["model"],
            "created": int(time.time()),
            "adapter_version": version,
        }
        if not body.get("stream"):
            msg = {"role": "assistant", "content": text or None}
            if tool:
                msg["tool_calls"] = [call]
            choice: dict[str, Any] = {"index": 0, "message": msg, "finish_reason": finish}
            if want_lp:
                entries = [{"token": str(t), "logprob": lp} for t, lp in zip(resp_ids, lps, strict=True)]
                choice["logprobs"] = {"content": entries}
            out = {
                **base,
                "object": "chat.completion",
                "choices": [choice],
                "usage": {"prompt_tokens": len(p_ids), "completion_tokens": len(resp_ids)},
            }
            if want_ids:
                choice["token_ids"] = resp_ids
                out["prompt_token_ids"] = p_ids
            return JSONResponse(out, headers=headers)

        async def gen():
            pieces: list[tuple[dict[str, Any], list[int]]] = []
            if tool:
                pieces.append(({"role": "assistant", "tool_calls": [{"index": 0, **call}]}, resp_ids[:-1]))
            else:
                n = len(words)
                for k, w in enumerate(words):
                    ids = word_ids(w)
                    pieces.append(({"content": w + (" " if k < n - 1 else "")}, ids))
            pieces.append(({}, [3]))
            for k, (delta, ids) in enumerate(pieces):
                last = k == len(pieces) - 1
                choice = {"index": 0, "delta": delta, "finish_reason": finish if last else None}
                if want_lp:
                    choice["logprobs"] = {"content": [{"token": str(t), "logprob": -0.25} for t in ids]}
                if want_ids:
                    choice["token_ids"] = ids
                chunk = {**base, "object": "chat.completion.chunk", "choices": [choice]}
                if k == 0 and want_ids:
                    chunk["prompt_token_ids"] = p_ids
                yield f"data: {json.dumps(chunk)}\n\n"
                if delay_s:
                    await asyncio.sleep(delay_s)
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)

    return app
