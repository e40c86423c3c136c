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
from metaclaw.modules import distill_rows as distilled
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


# ----------------------------------------------------------------------------- the top-k teacher (self-distillation)

HINT = [11, 12, 13]  # the preference, as the teacher read it before the prompt


def _taught(policy, teacher_prompt: list[int], rewards=(1.0, -1.0), kind: str = "own") -> dict:
    rows = [Sample(PROMPT, REPLY, _on_policy(policy), reward=r, id=i + 1) for i, r in enumerate(rewards)]
    about = {"from": 1, "kind": kind, "teacher_prompt_ids": teacher_prompt}
    rows.append(Sample(PROMPT, REPLY, [-7.0] * len(REPLY), id=100, temperature=0.7, meta={"distilled": about}))
    return collate_samples(rows, pad_id=0)


def _fit_topk(policy, batch, lr: float = 0.0, steps: int = 1, top_k: int = 8) -> tuple[OnlineRLModule, L.Trainer]:
    module = OnlineRLModule(policy=policy, loss=ImportanceSamplingLoss(max_ratio=5.0),
                            advantage=RLAdvantage(normalize="mean"),
                            optimizer=functools.partial(torch.optim.AdamW, lr=lr),
                            distill_loss=CrossEntropyLoss(aggregation="token-mean"), distill_top_k=top_k)  # fmt: skip
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([batch] * steps, batch_size=None))
    return module, trainer


def test_the_teacher_context_aligns_with_the_reply(tiny_policy):
    batch = _taught(tiny_policy, HINT + PROMPT)
    assert batch["has_teacher_prompt"].tolist() == [False, False, True]
    where = batch["teacher_mask"][2].bool()
    ids = batch["teacher_input_ids"][2]
    # the position after each teacher-mask position holds the next reply token (its last one is the final target)
    following = torch.cat([ids, torch.tensor([REPLY[-1]])])[1:][where]
    assert following.tolist() == REPLY
    assert int(where.sum()) == int(batch["mask"][2].sum())  # as many positions as the student's


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_teacher_that_reads_what_the_student_reads_gives_kl_zero_and_ratio_one(tiny_policy):
    """One distribution: a fresh adapter is the base model, so a teacher given the plain prompt is the student:
    the top-k KL is 0 and the policy rows' ratio stays exactly 1."""
    _, trainer = _fit_topk(tiny_policy, _taught(tiny_policy, list(PROMPT)))
    m = trainer.callback_metrics
    assert m["loss/distill_topk_kl"].item() == pytest.approx(0.0, abs=1e-5)
    assert m["loss/distill_teacher_rows"].item() == 1.0
    assert m["loss/ratio_mean"].item() == pytest.approx(1.0, abs=1e-5)
    assert m["loss/ratio_max"].item() == pytest.approx(1.0, abs=1e-5)


def test_a_hinted_teacher_pulls_the_student_toward_its_top_tokens(tiny_policy):
    """The student (no hint) moves toward what the hinted teacher would say at each reply token: gradient steps on
    the soft-target term shrink the top-k-and-tail KL (plain SGD: a small step follows the gradient)."""
    batch = _taught(tiny_policy, HINT + PROMPT, rewards=())
    on = batch["has_teacher_prompt"]

    def kl() -> float:
        with torch.no_grad():
            return distilled.self_distilled(tiny_policy, batch, on, 8)[2]["distill_topk_kl"].item()

    opt = torch.optim.SGD([p for p in tiny_policy.parameters() if p.requires_grad], lr=10.0)
    first = kl()
    assert first > 1e-5  # the hint changes the teacher's distribution
    for _ in range(5):
        _, soft, _ = distilled.self_distilled(tiny_policy, batch, on, 8)
        opt.zero_grad()
        (-(soft * batch["mask"]).sum() / batch["mask"].sum()).backward()
        opt.step()
    assert kl() < first / 2


def test_the_tail_makes_the_kl_exact():
    """Top-k plus the tail: KL 0 exactly when the student gives the k tokens the teacher's probabilities (whatever
    it does inside the tail), positive otherwise, and the soft log-likelihood is highest there."""
    teacher = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
    soft, kl = distilled.tailed(teacher, teacher.clone())
    assert kl.item() == pytest.approx(0.0, abs=1e-6)
    other = torch.log(torch.tensor([[0.3, 0.3, 0.3]]))
    soft2, kl2 = distilled.tailed(teacher, other)
    assert kl2.item() > 0.05 and soft2.item() < soft.item()
    padded = torch.tensor([[0.0, float("-inf")]])  # a position that kept one token: the tail is empty
    assert distilled.tailed(padded, torch.tensor([[0.0, -3.0]]))[1].item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_with_top_k_off_a_hinted_reply_trains_on_its_tokens(tiny_policy):
    _, trainer = _fit_topk(tiny_policy, _taught(tiny_policy, HINT + PROMPT, kind="hinted"), top_k=0)
    assert "loss/distill_topk_kl" not in trainer.callback_metrics
    assert trainer.callback_metrics["loss/distill_rows"].item() == 1.0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_corrected_reply_without_its_teacher_is_never_trained_on_its_own_tokens(tiny_policy, caplog):
    """Never against the user: the corrected reply's own row without teacher tokens (top_k 0) would reinforce the
    reply the person corrected; it is left out, loudly, and a batch of nothing else takes no step."""
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters() if "lora_" in n}
    with caplog.at_level("WARNING", logger="metaclaw.modules.distill_rows"):
        module, _ = _fit_topk(tiny_policy, _taught(tiny_policy, HINT + PROMPT, rewards=()), lr=1e-2, top_k=0)
    assert "no teacher tokens" in caplog.text
    assert module.skipped["zero_advantage"] == 1
    after = dict(tiny_policy.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
