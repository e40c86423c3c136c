"""Recording stand-ins for the privacy end-to-end test: a judge endpoint, a forwarding teacher endpoint, and a
Lightning callback that keeps every training batch."""

from __future__ import annotations

import json
from typing import Any

import httpx
import lightning as L
from fastapi import FastAPI, Request

BATCHES: list[dict[str, Any]] = []  # every batch the trainer stepped on (the callback is built by Hydra)


class BatchRecorder(L.Callback):
    """Keeps the token ids of every training batch (`+callbacks.rec._target_=tests.privacy.recorders.BatchRecorder`)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        BATCHES.append({k: v.tolist() for k, v in batch.items() if hasattr(v, "tolist") and "ids" in k})


def recording_judge() -> FastAPI:
    """`/v1/chat/completions` that records each request and answers a verdict of -1 with a hint."""
    app = FastAPI()
    app.state.requests = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        app.state.requests.append(await request.json())
        content = "\\boxed{-1} <hint>Answer with the number only.</hint>"
        return {
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]
        }

    return app


def recording_forwarder(upstream: str) -> FastAPI:
    """Forwards every POST to `upstream` (the policy server) and records the request body: the teacher's view."""
    app = FastAPI()
    app.state.requests = []

    @app.post("/{path:path}")
    async def forward(path: str, request: Request) -> Any:
        body = await request.body()
        app.state.requests.append(json.loads(body))
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(f"{upstream}/{path}", content=body, headers={"content-type": "application/json"})
        return r.json()

    return app
