"""Shared request builders for the training server tests (Tinker-layout datums, adapter files)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

PROMPT = [5, 17, 42, 99, 7]
CONTINUATION = [120, 33, 250, 61]


def datum(prompt: list[int], response: list[int], advantage: float, behaviour: float = -2.0) -> dict:
    """Tinker layout: inputs = all[:-1], targets = all[1:], prompt positions carry 0.0."""
    tokens = prompt + response
    n_prompt = len(prompt) - 1
    return {
        "model_input_tokens": tokens[:-1],
        "target_tokens": tokens[1:],
        "logprobs": [0.0] * n_prompt + [behaviour] * len(response),
        "advantages": [0.0] * n_prompt + [advantage] * len(response),
    }


BATCH = [
    datum(PROMPT, CONTINUATION, 1.0),
    datum([3, 9], [200, 201, 202, 203, 204, 205], -0.5),  # another length: one padded forward
    datum(PROMPT[:3], [60], 0.7),
]


def adapter(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def step(server, sid: str, lr: float = 5e-2, k: int = 1) -> dict:
    for _ in range(k):
        fb = server.ok(
            "/v1/train/forward_backward", {"session_id": sid, "datums": BATCH, "loss_fn": "importance_sampling"}
        )
        assert fb["status"] == "ok" and fb["num_datums"] == 3
        assert fb["total_tokens"] == sum(len(d["model_input_tokens"]) for d in BATCH)
    return server.ok("/v1/train/optim_step", {"session_id": sid, "learning_rate": lr})


def continuation_logprobs(server, sid: str) -> list[float]:
    body = {
        "session_id": sid,
        "tokens": PROMPT + CONTINUATION,
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": True,
    }
    out = server.ok("/v1/sample", body)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(PROMPT + CONTINUATION)
    return out["prompt_logprobs"][len(PROMPT) :]
