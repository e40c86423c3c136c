"""The prefix-cache tenant reaches vLLM (issue 43, CVE-2025-46570): the request's `cache_salt` is in the prompt the
vLLM engine submits, for whole replies and streams. vLLM itself is not needed: a stand-in `vllm` module records
what the engine hands it (the real engine: tests/serving/test_vllm_engine.py, marker `vllm`)."""

from __future__ import annotations

import dataclasses
import sys
import types
from types import SimpleNamespace

import pytest

from metaclaw.serving.engines import SamplingParams
from metaclaw.serving.engines.salt import salted


def test_salted_sets_the_tenant_and_leaves_a_request_without_one_alone():
    prompt = {"prompt_token_ids": [1, 2]}
    assert salted(prompt, "t1") == {"prompt_token_ids": [1, 2], "cache_salt": "t1"}
    assert salted(prompt, None) == prompt and "cache_salt" not in prompt  # a copy: the caller's dict is untouched
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}  # a `vllm serve` request body
    assert salted(body, "t2")["cache_salt"] == "t2"
    with pytest.raises(ValueError, match="cache_salt"):
        salted(prompt, "")


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` whose engine records each prompt it is asked to generate from."""
    prompts: list[dict] = []

    class Engine:
        async def generate(self, prompt, sampling, request_id, lora_request):
            prompts.append(prompt)
            logprob = {7: SimpleNamespace(logprob=-0.5)}
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7], logprobs=[logprob], finish_reason="stop")])

    @dataclasses.dataclass
    class AsyncEngineArgs:
        model: str = ""
        logprobs_mode: str = ""

        def __init__(self, **kwargs):
            self.kwargs = kwargs

    vllm = types.ModuleType("vllm")
    vllm.inputs = SimpleNamespace(TokensPrompt=dict)
    vllm.SamplingParams = lambda **kw: kw
    vllm.AsyncEngineArgs = AsyncEngineArgs
    vllm.AsyncLLMEngine = SimpleNamespace(from_engine_args=lambda args: Engine())
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final", DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    return prompts


def test_the_vllm_engine_sends_the_requests_cache_salt(fake_vllm):
    from metaclaw.serving.engines.vllm import VLLMEngine

    engine = VLLMEngine("unused", tokenizer=None, model_name="tiny", max_seq_len=64)
    try:
        out = engine.generate([1, 2, 3], SamplingParams(max_tokens=4, cache_salt="agent-a"))
        assert out[0].token_ids == [7]
        stream = engine.stream([1, 2], SamplingParams(max_tokens=4, cache_salt="agent-b"))
        assert [d.token_id for d in stream] == [7]
        engine.generate([4], SamplingParams(max_tokens=4))  # no tenant: no salt (the shared cache, as before)
    finally:
        engine.close()
    assert fake_vllm == [{"prompt_token_ids": [1, 2, 3], "cache_salt": "agent-a"},
                         {"prompt_token_ids": [1, 2], "cache_salt": "agent-b"},
                         {"prompt_token_ids": [4]}]  # fmt: skip
