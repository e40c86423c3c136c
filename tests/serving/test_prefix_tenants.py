"""Issue 43 (finding 8): the prefix cache was shared across agents and keys, so how fast a prompt was answered said
whether another tenant had sent it (vLLM's `cache_salt` answer to CVE-2025-46570). Entries are now found only by
requests of the same tenant; the proxy gives each agent and client key its own salt."""

from __future__ import annotations

import httpx
import pytest
import torch

from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import create_app
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.serving.engines.hf import HFEngine
from metaclaw.serving.prefix_cache import PrefixCache
from metaclaw.serving.sampling import SamplingParams
from metaclaw.store import SampleStore


def _kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]


def test_a_tenants_entries_are_found_by_that_tenant_only():
    cache = PrefixCache(max_bytes=1 << 20, min_tokens=4)
    cache.store("m", list(range(20)), _kv(20), tenant="alice")
    assert cache.lookup("m", list(range(20)), 19, tenant="bob") == (0, None)
    assert cache.lookup("m", list(range(20)), 19) == (0, None)  # no salt is a tenant of its own
    assert cache.lookup("m", list(range(20)), 19, tenant="alice")[0] == 19
    cache.store("m", list(range(20)), _kv(20), tenant="bob")
    assert len(cache) == 2  # one per tenant: bob's copy does not replace alice's
    cache.forget("m")  # a freed adapter version: every tenant's entries go
    assert len(cache) == 0 and cache.bytes == 0


def _onnx_engine(spec):
    pytest.importorskip("onnxruntime", reason="the ONNX engine needs the onnx extra: pip install 'metaclaw[onnx]'")
    from metaclaw.serving.engines.onnx import OnnxEngine

    return OnnxEngine.from_backend(spec, max_batch_size=1, quantize="fp32", prefix_cache_mb=16)


@pytest.mark.parametrize("build", [lambda spec: HFEngine.from_spec(spec, max_batch_size=1, prefix_cache_mb=16),
                                   _onnx_engine], ids=["hf", "onnx"])  # fmt: skip
def test_the_engine_reuses_a_prefix_only_within_its_cache_salt(tiny_spec, build, tmp_path, monkeypatch):
    monkeypatch.setenv("METACLAW_CACHE", str(tmp_path))
    engine = build(tiny_spec)
    prompt = list(engine.tokenizer.encode("The secret plan is blue. " * 4))
    engine.generate(prompt, SamplingParams(max_tokens=2, cache_salt="alice"))
    before = dict(engine.prefix.stats)
    engine.generate(prompt, SamplingParams(max_tokens=2, cache_salt="mallory"))
    assert engine.prefix.stats["hits"] == before["hits"]  # mallory's prompt found nothing of alice's
    engine.generate(prompt, SamplingParams(max_tokens=2, cache_salt="alice"))
    assert engine.prefix.stats["hits"] == before["hits"] + 1  # alice's own next turn still reuses it


def test_the_proxy_salts_each_agent_and_key_apart(tmp_path):
    store = SampleStore(tmp_path / "samples.sqlite")
    with ThreadedServer(scripted_upstream()) as upstream:
        with ThreadedServer(create_app(RolloutProxy(store, upstream.url, base_model="tiny"))) as srv:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "forged"}
            for agent, key in (("alice", "k1"), ("bob", "k1"), ("alice", "k2"), ("alice", "k1")):
                headers = {"X-Agent-Id": agent, "Authorization": f"Bearer {key}", "X-Session-Id": f"{agent}{key}"}
                assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=headers).status_code == 200
            completion = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
            alice = {"X-Agent-Id": "alice", "Authorization": "Bearer k1"}
            httpx.post(f"{srv.url}/v1/completions", json=completion, headers=alice)
        salts = [r["cache_salt"] for r in upstream.server.config.app.state.scripted["requests"]]
        legacy = upstream.server.config.app.state.scripted["completions"][0]["cache_salt"]
    assert len(set(salts[:3])) == 3 and salts[3] == salts[0] == legacy and "forged" not in salts
    store.close()
