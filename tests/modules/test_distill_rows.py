"""Distilled rows in a training batch (issue 42): cross-entropy on the plain prompt, never the policy loss.

A distilled row's behaviour logprobs are the hinted context's; put beside on-policy rows they must not enter the
importance ratio (the policy rows' ratio stays exactly 1), the advantage estimator never sees them, and a batch
of distilled rows only takes a step whose loss is −mean log π(reply | prompt without the preference).
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from metaclaw.advantages import RLAdvantage
from metaclaw.datamodules.rollout import collate_samples
from metaclaw.losses import CrossEntropyLoss, ImportanceSamplingLoss
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.store import Sample

PROMPT, REPLY = [5, 6, 7], [8, 9, 10]


def _on_policy(policy) -> list[float]:
    seq = torch.tensor([PROMPT + REPLY])
    with torch.no_grad():
        lp = policy.logprobs(seq[:, :-1], seq[:, 1:], torch.ones_like(seq[:, :-1]))
    return lp[0, len(PROMPT) - 1 :].tolist()


def _batch(policy, rewards: list[float], distilled: int) -> dict[str, torch.Tensor]:
    rows = [Sample(PROMPT, REPLY, _on_policy(policy), reward=r, id=i + 1) for i, r in enumerate(rewards)]
    rows += [Sample(PROMPT, REPLY, [-7.0, -7.0, -7.0], id=100 + i,  # the hinted context's: far from the plain prompt's
                    meta={"distilled": {"from": 1, "gain": 1.0}}) for i in range(distilled)]  # fmt: skip
    return collate_samples(rows, pad_id=0)


def _fit(policy, batch, lr: float = 0.0) -> tuple[OnlineRLModule, L.Trainer]:
    module = OnlineRLModule(policy=policy, loss=ImportanceSamplingLoss(max_ratio=5.0),
                            advantage=RLAdvantage(normalize="mean"),
                            optimizer=functools.partial(torch.optim.AdamW, lr=lr),
                            distill_loss=CrossEntropyLoss(aggregation="token-mean"), distill_weight=1.0)  # fmt: skip
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([batch], batch_size=None))
    return module, trainer


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_policy_rows_keep_ratio_one_and_distilled_rows_stay_out_of_the_ratio(tiny_policy):
    batch = _batch(tiny_policy, [1.0, -1.0], distilled=1)
    assert batch["distill"].tolist() == [False, False, True]
    _, trainer = _fit(tiny_policy, batch)
    m = trainer.callback_metrics
    assert m["loss/ratio_mean"].item() == pytest.approx(1.0, abs=1e-5)
    assert m["loss/ratio_max"].item() == pytest.approx(1.0, abs=1e-5)  # exp(-7 - log π) would be far from 1
    assert m["train/advantage_max"].item() == 1.0 and m["train/advantage_min"].item() == -1.0  # centred on 2 rows
    assert m["loss/distill_rows"].item() == 1.0
    plain = -torch.tensor(_on_policy(tiny_policy)).mean().item()
    assert m["loss/distill_nll_mean"].item() == pytest.approx(plain, abs=1e-4)  # under the plain prompt


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_batch_of_distilled_rows_only_steps_on_cross_entropy(tiny_policy):
    plain = -torch.tensor(_on_policy(tiny_policy)).mean().item()
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters() if "lora_" in n}
    module, trainer = _fit(tiny_policy, _batch(tiny_policy, [], distilled=2), lr=1e-2)
    assert module.skipped["zero_advantage"] == 0 and module.skipped["nonfinite"] == 0  # never zero-advantage
    assert trainer.callback_metrics["loss/total"].item() == pytest.approx(plain, abs=1e-4)
    after = dict(tiny_policy.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the adapter learnt
    assert -torch.tensor(_on_policy(tiny_policy)).mean().item() < plain  # the reply is likelier without the hint


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_without_a_distill_loss_a_distilled_row_is_refused_loudly(tiny_policy):
    module = OnlineRLModule(policy=tiny_policy, loss=ImportanceSamplingLoss(), advantage=RLAdvantage(),
                            optimizer=functools.partial(torch.optim.AdamW, lr=0.0))  # fmt: skip
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="no reward"):
        trainer.fit(module, torch.utils.data.DataLoader([_batch(tiny_policy, [1.0], 1)], batch_size=None))
