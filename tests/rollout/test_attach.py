"""Issue 41 (1): a training run attaching to a server it did not start (`serving.url`) checks, at start, the flags
publishing adapters needs, and names the one missing. A small stand-in plays vLLM's HTTP edge (vLLM cannot run
here); metaclaw's own policy server passes the same check."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from metaclaw.loop.live import live_loop
from metaclaw.rollout.probe import UpstreamCannotTrain, probe_attach
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore
from tests.rollout.test_probe import compose_cfg


def vllm_like(served: str = "tiny", max_model_len: int = 1024, runtime_lora: bool = True) -> FastAPI:
    """vLLM's answers to what the start checks ask: `--served-model-name`, `--max-model-len` and the runtime LoRA
    route (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`); completions carry token ids and logprobs (capture works)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served, "object": "model", "max_model_len": max_model_len}]}

    if runtime_lora:

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> JSONResponse:
            body = await request.json()
            if not body.get("lora_name") or not body.get("lora_path"):
                msg = "Both 'lora_name' and 'lora_path' must be provided."
                return JSONResponse({"error": {"message": msg, "type": "BadRequestError"}}, status_code=400)
            return JSONResponse({"status": "ok"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        logprobs = {"content": [{"token": "OK", "logprob": -0.1, "top_logprobs": []}]}
        choice = {"index": 0, "message": {"role": "assistant", "content": "OK"}, "finish_reason": "stop",
                  "token_ids": [7], "logprobs": logprobs}  # fmt: skip
        return {"id": "x", "object": "chat.completion", "model": body["model"], "prompt_token_ids": [1, 2, 3],
                "choices": [choice]}  # fmt: skip

    return app


@pytest.mark.parametrize(
    ("fake", "named"),
    [
        ({"served": "Qwen/Qwen3-8B"}, "--served-model-name tiny"),
        ({"max_model_len": 512}, "--max-model-len 1024"),
        ({"runtime_lora": False}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
    ],
    ids=["served-name", "max-model-len", "runtime-lora"],
)
def test_a_missing_flag_stops_the_run_at_start_and_is_named(tmp_path, fake, named):
    with ThreadedServer(vllm_like(**fake)) as up:
        cfg = compose_cfg(tmp_path, f"serving.url={up.url}")  # model=tiny: model.name tiny, max_seq_len 1024
        with pytest.raises(UpstreamCannotTrain) as err, live_loop(cfg, SampleStore(tmp_path / "s.sqlite"), None):
            pass
    assert named in str(err.value) and up.url in str(err.value)


def test_a_server_started_with_the_flags_passes(caplog):
    with ThreadedServer(vllm_like()) as up, caplog.at_level("INFO", logger="metaclaw.wire.attach"):
        probe_attach(up.url, None, "tiny", 1024)
    assert "loads LoRA adapters at run time" in caplog.text


def test_metaclaws_own_policy_server_passes(tiny_policy_server):
    probe_attach(tiny_policy_server.url, tiny_policy_server.key, "tiny", 1024)
