"""Upstreams that cannot be trained from are refused at start; an open proxy says who can reach it and does not
advertise internal URLs."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.loop.live import live_loop
from metaclaw.rollout.probe import UpstreamCannotTrain, probe_capture
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore

REPO = Path(__file__).resolve().parents[2]
register_resolvers()
STANDARD = {"model", "messages", "max_tokens", "temperature", "logprobs", "top_logprobs", "stream", "user", "n"}


def plain_upstream(strict: bool) -> FastAPI:
    """An OpenAI-compatible server with no token ids; `strict` refuses fields OpenAI does not define."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "plain"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        unknown = sorted(set(body) - STANDARD)
        if strict and unknown:
            msg = f"Unrecognized request argument supplied: {unknown[0]}"
            return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=400)
        msg = {"role": "assistant", "content": "OK"}
        return {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
        }

    return app


def compose_cfg(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "model=tiny",
                "rollout=proxy",
                "rollout.proxy.port=0",
                f"skills.library_root={tmp_path / 'skills'}",
                f"hydra.run.dir={tmp_path}",
                f"run_dir={tmp_path}",
                *overrides,
            ],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


@pytest.mark.parametrize("strict", [False, True], ids=["no-token-ids", "refuses-extra-fields"])
def test_a_training_run_is_refused_when_the_upstream_cannot_feed_it(tmp_path, strict):
    with ThreadedServer(plain_upstream(strict)) as up:
        with pytest.raises(UpstreamCannotTrain) as err:
            probe_capture(up.url)
        msg = str(err.value)
        assert up.url in msg and "mode=skills_only" in msg and "metaclaw serve" in msg and "return_token_ids" in msg
        assert ("refused" in msg) if strict else ("no prompt_token_ids" in msg)

        cfg = compose_cfg(tmp_path, f"serving.url={up.url}")
        with pytest.raises(UpstreamCannotTrain), live_loop(cfg, SampleStore(tmp_path / "s.sqlite"), tokenizer=None):
            pass


def test_skills_only_needs_no_token_ids_and_an_open_proxy_warns(tmp_path, caplog):
    with ThreadedServer(plain_upstream(strict=True)) as up:
        cfg = compose_cfg(tmp_path, "mode=skills_only", f"serving.url={up.url}", "rollout.proxy.api_key=null")
        store = SampleStore(tmp_path / "s.sqlite")
        with caplog.at_level(logging.WARNING, logger="metaclaw.rollout.proxy_app"), live_loop(cfg, store, None) as live:
            health = httpx.get(f"{live.proxy_url}/health").json()
            r = httpx.post(
                f"{live.proxy_url}/v1/chat/completions",
                json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "OK"
        assert health["status"] == "ok" and up.url not in str(health) and str(up.port) not in str(health)
        [warning] = [rec.getMessage() for rec in caplog.records if "no API key" in rec.getMessage()]
        assert "every user and process on this machine" in warning and "METACLAW_PROXY_API_KEY" in warning


def test_our_upstream_passes_the_probe(upstream):
    probe_capture(upstream.url, model="tiny")


def test_proxy_key_forms_are_the_documented_ones(tmp_path, upstream):
    from tests.rollout.conftest import make_harness

    for h in make_harness(tmp_path, upstream, api_key="s3cret"):
        url, body = f"{h.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        ok = [{"Authorization": "Bearer s3cret"}, {"Authorization": "bearer s3cret"}, {"x-api-key": "s3cret"}]
        ok.append({"Authorization": "s3cret"})  # bare key: accepted on purpose (docs/online_loop.md)
        for headers in ok:
            assert httpx.post(url, json=body, headers=headers).status_code == 200, headers
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}, {"x-api-key": ""}]:
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        for path in ("/v1/feedback", "/v1/sessions/done", "/v1/models", "/openapi.json"):
            assert (
                httpx.request(
                    "POST" if path.startswith("/v1/f") or "done" in path else "GET", f"{h.url}{path}"
                ).status_code
                == 401
            )
