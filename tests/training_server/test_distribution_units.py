"""`dist_logprobs` (tempered, top-k/top-p truncated softmax) and the bounded per-session sample memory."""

from __future__ import annotations

import torch

from metaclaw.distribution import Dist
from metaclaw.distribution.logprobs import dist_logprobs
from metaclaw.training_server.sample_memory import SampleMemory


def test_dist_logprobs_truncation() -> None:
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    target = torch.tensor([[1]])
    full = dist_logprobs(logits, target, [Dist()])
    assert torch.allclose(full, torch.log_softmax(logits, -1)[..., 1])
    top2 = dist_logprobs(logits, target, [Dist(top_k=2)])
    assert torch.allclose(top2, torch.log_softmax(logits[..., :2], -1)[..., 1])
    # top_p 0.5: the argmax alone holds 64% of the mass; the target is kept anyway and renormalised with it
    nucleus = dist_logprobs(logits, target, [Dist(top_p=0.5)])
    assert torch.allclose(nucleus, torch.log_softmax(logits[..., :2], -1)[..., 1])
    hot = dist_logprobs(logits, target, [Dist(temperature=0.5)])
    assert torch.allclose(hot, torch.log_softmax(logits / 0.5, -1)[..., 1])


def test_sample_memory_is_bounded() -> None:
    memory = SampleMemory(capacity=3)
    for i in range(5):
        memory.record([1, 2, i], Dist(temperature=0.5 + i))
    assert len(memory) == 3 and memory.lookup([1, 2, 0]) is None
    assert memory.lookup([1, 2, 4]) == Dist(temperature=4.5) and memory.last == Dist(temperature=4.5)
