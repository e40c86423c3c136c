"""One distribution (issue 42): a distilled reply's behaviour logprobs are the hinted context's, ratio 1 there.

A real policy server (`serve.py model=tiny`) samples the hinted reply; the trainer's policy (adapter off, the
teacher) recomputes its logprobs under the hinted prompt: ratio 1. Under the plain prompt, the one the row is
trained on, they differ: that is why a distilled row never enters an importance ratio (`modules.distill_rows`).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from metaclaw.scoring.distill import ContextDistiller, hinted_conversation, unasked_conversation
from metaclaw.store import Sample, SampleText
from metaclaw.wire.render import chat_prompt_ids
from tests.serving.conftest import running_server

PREFERENCE = "Your name is Kuro, always introduce yourself as Kuro."


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    # the fp32 engine: a ratio of exactly 1 needs the trainer's own numbers (the int8 engine's is counted, not 1)
    with running_server(
        tmp_path_factory.mktemp("serve-run"), tmp_path_factory.mktemp("adapters"), "backend.cpu_engine=hf"
    ) as live:
        yield live


@pytest.mark.parametrize(("temperature", "cool"), [(1.0, 0.5), (0.7, None)])  # sampled cooler, then as the turn
def test_distilled_reply_has_ratio_one_under_the_hinted_prompt_only(policy_server, tiny_policy, tiny_tokenizer,
                                                                    temperature, cool):  # fmt: skip
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = chat_prompt_ids(tiny_tokenizer, messages)
    source = Sample(prompt, [5, 6], [-1.0, -1.0], text=SampleText(messages=messages, response_text="Paris."), id=1,
                    temperature=temperature, meta={"sampling": {"top_p": 1.0, "top_k": -1}})  # fmt: skip
    distiller = ContextDistiller(policy_server.url, "tiny", policy_server.api_key, min_gain=-1e9, max_tokens=24,
                                 own_reply=True, temperature=cool, min_relevance=-1e9)  # fmt: skip
    rows, info = asyncio.run(distiller.distill(source, PREFERENCE))
    assert info["sampled_at"] == (cool or temperature)  # `samples` hinted replies per correction
    replies = [r for r in rows if r.meta.distilled["kind"] == "hinted"]
    assert replies and info["accepted"] == len(replies) and len(rows) == len(replies) + 1  # and the own row
    hinted = chat_prompt_ids(tiny_tokenizer, hinted_conversation(messages, "Paris.", PREFERENCE, distiller.form))
    unasked = chat_prompt_ids(tiny_tokenizer, unasked_conversation(messages, "", PREFERENCE, distiller.form))
    # the top-k teacher reads exactly the prompt the server's teacher sampled under
    (mine,) = [r for r in rows if r.meta.distilled["kind"] == "own"]
    assert mine.meta.distilled["teacher_prompt_ids"] == hinted

    def trainer_logprobs(prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
        seq = torch.tensor([prompt_ids + response_ids])
        with torch.no_grad(), tiny_policy.reference():
            lp = tiny_policy.logprobs(seq[:, :-1], seq[:, 1:], torch.ones_like(seq[:, :-1]), temperature=temperature)
        return lp[0, len(prompt_ids) - 1 :]

    for new in replies:  # every accepted reply: ratio 1 under the hinted prompt, not under the plain one
        assert new.prompt_ids == prompt and new.temperature == temperature
        behaviour = torch.tensor(new.behaviour_logprobs)
        ratio = torch.exp(trainer_logprobs(hinted, new.response_ids) - behaviour)
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4), ratio
        # the request's relevance compares the same reply under one distribution, with and without the request
        alone = trainer_logprobs(unasked, new.response_ids)
        assert new.meta.distilled["relevance"] == pytest.approx(float((behaviour - alone).mean()), abs=1e-3)
        assert not torch.allclose(trainer_logprobs(prompt, new.response_ids), behaviour, atol=1e-3)
