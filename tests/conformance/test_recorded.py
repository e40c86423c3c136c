"""The agents' own requests, recorded: what npm's OpenClaw, Claude Code and Codex sent through the proxy in
`make test-agents` (tests/agents/, `METACLAW_RECORD_FIXTURES=1` rewrites them; credentials never recorded,
machine paths and ids scrubbed), replayed here into the conformance rig (the tiny model, a 1,024-token context: the
context policy fits each one). Every request is answered 200 with a complete stream and captured with its token
ids and behaviour logprobs. These replace the shapes once written from memory (tests/conformance/fixtures.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from metaclaw.rollout.fit import ClientFit, ContextPolicy, ImagePolicy
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.store import SampleStore
from tests.conformance.conftest import PROXY_KEY
from tests.conformance.test_clients import sse_events
from tests.procs import free_port, serving

RECORDED = Path(__file__).parent / "recorded"
FILES = sorted(RECORDED.glob("*.jsonl"))
ENDS = {"/v1/chat/completions": "[DONE]", "/v1/messages": "message_stop", "/v1/responses": "response."}


@pytest.fixture(scope="module")
def rig(tiny_tokenizer, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The tiny model served at 8,192 positions (the embedded default's context; the tiny tokenizer needs about
    twice SmolLM2's tokens for these prompts, so the context policy fits every one) behind the proxy, defaults."""
    run_dir = tmp_path_factory.mktemp("recorded-server")
    port, key = free_port(), "recorded-server-key"
    cmd = [
        sys.executable,
        "serve.py",
        "model=tiny",
        "model.max_seq_len=8192",
        f"serve.port={port}",
        f"hydra.run.dir={run_dir}",
        f"serve.adapter_root={run_dir / 'adapters'}",
        "serve.default_max_tokens=16",
    ]
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, f"{url}/health", run_dir / "server.log", env={"METACLAW_API_KEY": key}):
        store = SampleStore(run_dir / "samples.sqlite")
        fit = ClientFit(ImagePolicy(), ContextPolicy(tokenizer=tiny_tokenizer))
        proxy = RolloutProxy(store, url, upstream_api_key=key, base_model="tiny", fit=fit)
        with ThreadedServer(create_app(proxy, api_key=PROXY_KEY)) as srv:
            yield SimpleNamespace(url=srv.url, store=store)


def requests_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_agent_has_recorded_traffic():
    assert {p.stem for p in FILES} == {"openclaw", "claude_code", "codex"}
    for path in FILES:
        text = path.read_text()
        for rec in requests_of(path):
            assert not {"authorization", "x-api-key", "cookie"} & {k.lower() for k in rec["headers"]}
        assert "/root/" not in text and "/home/" not in text, f"{path.name} holds a machine path"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_recorded_requests_are_answered_and_captured(rig, path: Path):
    for i, rec in enumerate(requests_of(path)):
        before = rig.store.count()
        headers = {k: v for k, v in rec["headers"].items() if k.lower() not in ("x-api-key", "authorization")}
        headers["authorization"] = f"Bearer {PROXY_KEY}"
        url = f"{rig.url}{rec['path']}" + (f"?{rec['query']}" if rec["query"] else "")
        r = httpx.post(url, headers=headers, json=rec["body"], timeout=300)
        assert r.status_code == 200, f"{path.stem} request {i}: {r.status_code} {r.text[:500]}"
        if rec["body"].get("stream"):
            end = ENDS[rec["path"]]
            assert end in r.text.strip().split("\n\n")[-1] or any(
                end in (name or "") or end in json.dumps(data)[:80] for name, data in sse_events(r.text)[-1:]
            ), f"{path.stem} request {i}: the stream did not complete: {r.text[-300:]}"
        samples = rig.store.select()
        assert len(samples) == before + 1, f"{path.stem} request {i} was not captured"
        s = samples[-1]
        assert s.response_ids and len(s.behaviour_logprobs) == len(s.response_ids)
        context = s.meta.fit.context or {}
        assert context.get("action") != "unfit", context
        # the reply budget: what the agent asked for, at most the room the context policy kept (Claude Code asks
        # for 32,000 tokens, Codex for none: on a CPU either is many minutes, past the agent's own timeout)
        assert len(s.response_ids) <= ContextPolicy().reserve_tokens
