"""A temperature too small to divide by is greedy, once, for every engine: `temperature_or_greedy` in the request
vocabulary (`SamplingParams`) and `Dist.of` agree, so behaviour and training logprobs stay over one distribution.
On main a chat request with `temperature: 1.1e-308` (found by the OpenAPI fuzzer) overflowed `logits / T` and the
policy server answered 500."""

from __future__ import annotations

import httpx
import pytest
import torch

from metaclaw.distribution import GREEDY_BELOW, Dist
from metaclaw.distribution.logprobs import sample_tokens, token_logprobs
from metaclaw.wire.sampling import SamplingParams


@pytest.mark.parametrize("t", [0.0, 1.1e-308, 1e-30, GREEDY_BELOW / 2])
def test_a_vanishing_temperature_is_greedy_in_the_vocabulary_and_the_distribution(t):
    params = SamplingParams(temperature=t)
    assert params.temperature == 0.0 and params.distribution() == Dist() == Dist.of(t)
    params.validate()


def test_temperatures_at_and_above_the_threshold_are_kept():
    assert SamplingParams(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW
    assert Dist.of(0.7).temperature == 0.7
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1e-308).validate()  # negative stays refused


def test_greedy_sampling_reports_the_logprob_training_recomputes():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample_tokens(logits, 1.1e-308)
    assert torch.equal(tokens, logits.argmax(-1))
    recomputed = token_logprobs(logits, tokens, *Dist.of(1.1e-308))
    assert torch.allclose(torch.exp(recomputed - logprobs), torch.ones(3))  # ratio 1


def test_the_policy_server_answers_a_vanishing_temperature_like_greedy(tiny_policy_server):
    headers = {"Authorization": f"Bearer {tiny_policy_server.key}"}

    def ask(t: float) -> dict:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": t,
                "logprobs": True, "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{tiny_policy_server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    tiny, zero = ask(1.1e-308), ask(0.0)
    assert tiny["token_ids"] == zero["token_ids"]
    assert [x["logprob"] for x in tiny["logprobs"]["content"]] == [x["logprob"] for x in zero["logprobs"]["content"]]
