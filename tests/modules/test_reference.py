"""The KL reference beside the policy's forward (`modules.reference`): the same logprobs as the adapter-disabled
policy, over weights it shares rather than copies, and a training step that uses it gives the in-line step's loss."""

from __future__ import annotations

import functools
import threading

import lightning as L
import pytest
import torch

from metaclaw.advantages import RLAdvantage
from metaclaw.datamodules.rollout import collate_samples
from metaclaw.losses import ImportanceSamplingLoss, KLPenalty
from metaclaw.modules import reference
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.store import Sample


def _perturb(policy) -> None:
    torch.manual_seed(1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)


def _batch() -> dict[str, torch.Tensor]:
    """Rows of different lengths and sampling distributions, one with no reply token to score."""
    rows = [([5, 6, 7], [8, 9, 10, 11], 0.7, 1.0), ([3, 4], [12, 13], 1.0, 0.9), ([9, 9, 9, 9, 9], [14], 0.6, 1.0)]
    samples = [Sample(prompt_ids=p, response_ids=r, behaviour_logprobs=[-2.0] * len(r), reward=1.0 - i,
                      temperature=t, meta={"sampling": {"top_p": tp}}, id=i + 1)
               for i, (p, r, t, tp) in enumerate(rows)]  # fmt: skip
    batch = collate_samples(samples, pad_id=0)
    batch["mask"][2] = 0  # nothing to score in this row: it stays 0, and nobody computes it
    return batch


def _inline(policy, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad(), policy.reference():
        return policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"], batch["temperature"],
                               batch["top_p"], batch["top_k"], mask=batch["mask"])  # fmt: skip


def test_the_copy_shares_every_weight_and_holds_no_adapter(tiny_policy):
    base = tiny_policy.model.get_base_model()
    plain = reference.shared_base(base)
    theirs = {p.data_ptr() for n, p in base.named_parameters() if "lora_" not in n}
    mine = {p.data_ptr() for p in plain.parameters()}
    assert mine and mine <= theirs  # no weight of its own: the very tensors (tied ones once)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    assert not any(t.is_meta for t in [*plain.parameters(), *plain.buffers()])
    assert not plain.training


def test_the_reference_thread_gives_the_adapter_disabled_policys_logprobs(tiny_policy):
    _perturb(tiny_policy)
    batch = _batch()
    expected = _inline(tiny_policy, batch)
    concurrent = reference.ConcurrentReference(tiny_policy.model.get_base_model(), chunk=3)
    try:
        got = concurrent.start(batch).result()
    finally:
        concurrent.close()
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert got[2].eq(0).all() and got[0].ne(0).any()
    with torch.no_grad():  # and not the adapted policy's: the adapter is really out
        adapted = tiny_policy.logprobs(batch["input_ids"], batch["target_ids"], batch["attention_mask"],
                                       batch["temperature"], mask=batch["mask"])  # fmt: skip
    assert not torch.allclose(got, adapted, atol=1e-3)


def test_the_trainers_thread_takes_the_rows_nobody_started(tiny_policy):
    """A busy machine: the reference thread cannot start, and `result()` computes every row itself."""
    batch = _batch()
    expected = _inline(tiny_policy, batch)
    concurrent = reference.ConcurrentReference(tiny_policy.model.get_base_model(), chunk=512)
    gate = threading.Event()
    concurrent._pool.submit(gate.wait)  # the one worker is held up
    try:
        work = concurrent.start(batch)
        got = work.result()
        assert threading.current_thread() is threading.main_thread()
    finally:
        gate.set()
        concurrent.close()
    assert torch.allclose(got, expected, atol=1e-5)


def test_an_error_in_the_reference_reaches_the_training_step(tiny_policy):
    batch = _batch()
    batch["input_ids"][0, 0] = 10**9  # not a token of the vocabulary
    concurrent = reference.ConcurrentReference(tiny_policy.model.get_base_model(), chunk=512)
    try:
        with pytest.raises(IndexError):
            concurrent.start(batch).result()
    finally:
        concurrent.close()


def _step_loss(policy, batch: dict[str, torch.Tensor], thread: bool) -> tuple[float, OnlineRLModule]:
    module = OnlineRLModule(policy=policy, loss=ImportanceSamplingLoss(), advantage=RLAdvantage(),
                            optimizer=functools.partial(torch.optim.AdamW, lr=0.0),
                            kl=KLPenalty(coef=0.5, reference_thread=thread))  # fmt: skip
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([batch], batch_size=None))
    return float(trainer.callback_metrics["loss/kl"]), module


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_step_with_the_reference_thread_logs_the_in_line_steps_kl(tiny_policy, monkeypatch):
    _perturb(tiny_policy)
    batch = _batch()
    started = []
    start = reference.ConcurrentReference.start
    monkeypatch.setattr(reference.ConcurrentReference, "start", lambda self, b: started.append(1) or start(self, b))
    inline, _ = _step_loss(tiny_policy, batch, thread=False)
    assert not started
    beside, module = _step_loss(tiny_policy, batch, thread=True)
    assert started == [1] and module._concurrent is None  # built for the fit, closed at its end
    assert inline > 0 and beside == pytest.approx(inline, abs=1e-5)


def test_auto_is_on_for_one_cpu_process_with_a_core_to_spare(monkeypatch):
    monkeypatch.setattr(reference, "host_cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert reference.wanted("auto", torch.device("cpu"), 1)
    assert not reference.wanted("auto", torch.device("cpu"), 2)  # DDP ranks: each has its cores already
    assert not reference.wanted("auto", torch.device("cuda", 0), 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not reference.wanted("auto", torch.device("cpu"), 1)  # the trainer has every core: no idle one
    assert reference.wanted(True, torch.device("cpu"), 2) and not reference.wanted(False, torch.device("cpu"), 1)
    with pytest.raises(ValueError, match="reference_thread"):
        KLPenalty(reference_thread="sometimes")
