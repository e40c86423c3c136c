"""One distribution: driven as MetaClaw's remote client drives it, on-policy importance ratios are exactly 1.

MetaClaw's `remote_backend/client.py` samples through `/v1/sample` at T=0.7 without a `session_id` and sends
`forward_backward` no temperature. Each test drives a fresh server holding exactly one session that way and
reads the ratio twice: from the loss (importance_sampling with aggregation `sum` and advantage 1 on every sampled
token is −Σρ, so the mean ratio is −loss / n) and, where the server reports them, from the ratio metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .helpers import PROMPT, step
from .launch import Server, training_server

TOL = 1e-4


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A fresh server with exactly one session whose published adapter is not the base model's."""
    with training_server(tmp_path_factory.mktemp("distribution")) as srv:
        sid = srv.ok("/v1/lora/create", {"base_model": "tiny", "rank": 4})["session_id"]
        step(srv, sid, lr=5e-2)
        srv.ok("/v1/weights/save", {"session_id": sid, "name": "policy"})
        yield srv, sid


def metaclaw_sample(srv: Server, temperature: float, top_p: float, top_k: int, n: int = 3) -> list[dict]:
    """The exact payload of MetaClaw's SamplingClient.sample_async (no session_id)."""
    payload = {
        "tokens": PROMPT,
        "num_samples": n,
        "temperature": temperature,
        "max_tokens": 12,
        "top_k": top_k,
        "top_p": top_p,
        "stop": [],
    }
    return srv.ok("/v1/sample", payload)["sequences"]


def on_policy_datum(seq: dict) -> dict:
    tokens = PROMPT + seq["tokens"]
    n_prompt = len(PROMPT) - 1
    return {
        "model_input_tokens": tokens[:-1],
        "target_tokens": tokens[1:],
        "logprobs": [0.0] * n_prompt + seq["logprobs"],
        "advantages": [0.0] * n_prompt + [1.0] * len(seq["tokens"]),
    }


def metaclaw_forward_backward(srv: Server, sid: str, seqs: list[dict], **extra) -> dict:
    """The exact payload of MetaClaw's TrainingClient.forward_backward_async (no temperature), sum aggregation."""
    body = {
        "session_id": sid,
        "datums": [on_policy_datum(s) for s in seqs],
        "loss_fn": "importance_sampling",
        "loss_fn_config": {"aggregation": "sum"},
        **extra,
    }
    return srv.ok("/v1/train/forward_backward", body)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(0.7, 1.0, -1), (0.7, 0.8, 20), (1.3, 0.95, 0), (1.0, 1.0, 5)],
    ids=["T0.7", "T0.7-top_p0.8-top_k20", "T1.3-top_p0.95", "T1-top_k5"],
)
def test_metaclaw_client_on_policy_ratio_is_one(single, temperature: float, top_p: float, top_k: int) -> None:
    srv, sid = single
    seqs = [s for s in metaclaw_sample(srv, temperature, top_p, top_k) if s["tokens"]]
    n = sum(len(s["tokens"]) for s in seqs)
    assert n > 0
    out = metaclaw_forward_backward(srv, sid, seqs)
    assert abs(-out["loss"] / n - 1.0) < TOL, f"mean on-policy ratio {-out['loss'] / n}"
    metrics = out["metrics"]
    assert abs(metrics["ratio_min"] - 1) < TOL and abs(metrics["ratio_max"] - 1) < TOL, metrics
    assert metrics["datums_matched_to_samples"] == len(seqs)


def test_explicit_temperature_still_wins(single) -> None:
    srv, sid = single
    seqs = [s for s in metaclaw_sample(srv, 0.7, 1.0, -1) if s["tokens"]]
    same = metaclaw_forward_backward(srv, sid, seqs, temperature=0.7)["metrics"]
    assert abs(same["ratio_min"] - 1) < TOL and abs(same["ratio_max"] - 1) < TOL
    other = metaclaw_forward_backward(srv, sid, seqs, temperature=1.0)["metrics"]
    assert abs(other["ratio_min"] - 1) > 1e-3 or abs(other["ratio_max"] - 1) > 1e-3  # T=1 is another distribution


def test_single_session_client_needs_no_session_id(single) -> None:
    srv, sid = single
    body = {"tokens": PROMPT + [1, 2], "max_tokens": 1, "prompt_logprobs": True}
    implicit = srv.ok("/v1/sample", body)["prompt_logprobs"]
    assert implicit == srv.ok("/v1/sample", {**body, "session_id": sid})["prompt_logprobs"]
