"""OnlineRLModule guards: a non-finite loss or an all-zero-advantage batch takes no optimizer step, counted."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from metaclaw.advantages import RLAdvantage
from metaclaw.datamodules.rollout import collate_samples
from metaclaw.losses import ImportanceSamplingLoss
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.store import Sample


def _batch(rewards: list[float], behaviour: float = -2.0) -> dict[str, torch.Tensor]:
    samples = [
        Sample(
            prompt_ids=[5, 6, 7],
            response_ids=[8, 9, 10],
            behaviour_logprobs=[behaviour] * 3,
            reward=r,
            id=i + 1,
        )
        for i, r in enumerate(rewards)
    ]
    return collate_samples(samples, pad_id=0)


def _poison(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch whose loss is NaN: what one non-finite behaviour logprob that got past validation would do."""
    batch = dict(batch)
    batch["behaviour_logprobs"] = batch["behaviour_logprobs"].clone()
    batch["behaviour_logprobs"][0, 3] = float("nan")
    return batch


def _fit(policy, batches: list[dict[str, torch.Tensor]]) -> tuple[OnlineRLModule, L.Trainer]:
    module = OnlineRLModule(
        policy=policy,
        loss=ImportanceSamplingLoss(),
        advantage=RLAdvantage(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
    )
    trainer = L.Trainer(
        max_steps=len(batches),
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        gradient_clip_val=1.0,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return module, trainer


def _lora(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_nan_batch_leaves_the_adapter_unchanged_and_is_counted(tiny_policy):
    before = _lora(tiny_policy)
    module, trainer = _fit(tiny_policy, [_poison(_batch([1.0, -1.0]))])
    assert _same(before, _lora(tiny_policy))  # no optimizer step: AdamW state untouched too
    assert all(torch.isfinite(p).all() for p in _lora(tiny_policy).values())
    assert module.skipped["nonfinite"] == 1
    assert trainer.callback_metrics["train/skipped_nonfinite"] == 1
    assert trainer.global_step == 1  # the claim keys (one per step) stay aligned with the optimizer steps


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_training_goes_on_after_a_nan_batch(tiny_policy):
    before = _lora(tiny_policy)
    module, trainer = _fit(tiny_policy, [_poison(_batch([1.0, -1.0])), _batch([1.0, -1.0])])
    after = _lora(tiny_policy)
    assert not _same(before, after) and all(torch.isfinite(p).all() for p in after.values())
    assert module.skipped["nonfinite"] == 1 and trainer.global_step == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_all_zero_advantage_batch_takes_no_step_and_is_counted(tiny_policy):
    before = _lora(tiny_policy)
    module, trainer = _fit(tiny_policy, [_batch([0.0, 0.0])])
    assert _same(before, _lora(tiny_policy))
    assert module.skipped["zero_advantage"] == 1
    assert trainer.callback_metrics["train/skipped_zero_advantage"] == 1
    assert trainer.callback_metrics["train/zero_advantage_frac"] == 1.0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_zero_advantage_fraction_counts_samples_without_signal(tiny_policy):
    module, trainer = _fit(tiny_policy, [_batch([0.0, 1.0, 0.0, -1.0])])
    assert module.skipped["zero_advantage"] == 0
    assert trainer.callback_metrics["train/zero_advantage_frac"] == 0.5


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean", "sum"])
def test_rank_losses_average_to_the_global_batch_aggregate(mode):
    """DDP averages the ranks' gradients: the scaled per-rank losses must average to the global aggregate."""
    from metaclaw.losses import aggregate
    from metaclaw.modules.online_rl import global_scale

    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    group = {"group_tokens": mask.sum(), "group_sequences": torch.tensor(3)}
    whole = aggregate(per_token, mask, mode)
    ranks = [[0], [1, 2]]  # uneven slices: one rank has 3 tokens, the other 3 in two sequences
    scaled = [aggregate(per_token[r], mask[r], mode) * global_scale(mode, mask[r], group, 2) for r in ranks]
    assert torch.allclose(sum(scaled) / 2, whole)
    assert global_scale(mode, mask, group, 1) == 1


def test_ppo_epochs_take_several_steps_per_batch_and_count_its_samples_once(tmp_path):
    """Issue 29.5: `data.epochs_per_batch=2` with `loss=ppo`: 4 optimizer steps on 2 claimed batches; the second
    epoch sees a moved policy (ratio != 1, so the clip matters), and `train/samples` counts each sample once."""
    from metaclaw.store import SampleStore
    from metaclaw.training import train
    from tests.entrypoints.test_train import compose_train

    metrics, objs = train(compose_train(tmp_path, "trainer.max_steps=4", "data.epochs_per_batch=2", "loss=ppo"))
    assert metrics["train/global_step"] == 4
    store = SampleStore(tmp_path / "samples.sqlite")
    consumed = store.select("consumed")
    assert len(consumed) == 8 and {s.claimed_step for s in consumed} == {0, 2}
    assert metrics["train/samples"] == 0  # the last step was the second epoch of a batch: no new sample
    bar = next(c for c in objs["trainer"].callbacks if type(c).__name__ == "LoopProgressBar")
    assert bar.samples == 8


def test_learning_rate_and_gradient_norm_are_logged_every_step(tiny_policy):
    """`train/lr` is the optimizer's; `train/grad_norm` the gradient's 2-norm before clipping (0 for a refused step)."""
    module, trainer = _fit(tiny_policy, [_batch([1.0, -1.0])])
    assert trainer.callback_metrics["train/lr"] == pytest.approx(1e-2)
    assert float(trainer.callback_metrics["train/grad_norm"]) > 0
    module, trainer = _fit(tiny_policy, [_batch([0.0, 0.0])])  # all-zero advantage: no gradient, no step
    assert float(trainer.callback_metrics.get("train/grad_norm", 0.0)) == 0.0  # never the previous step's


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_zero_advantage_step_hands_its_samples_back_to_the_store(tiny_policy, tmp_path):
    """No sample is consumed without a gradient (issue 42): the skipped step's samples are `ready` again."""
    from metaclaw.datamodules.rollout import RolloutDataModule
    from metaclaw.store import SampleStore

    store = SampleStore(tmp_path / "s.sqlite")
    ids = [store.insert(Sample([5, 6, 7], [8, 9, 10], [-2.0] * 3, reward=-1.0, status="ready")) for _ in range(2)]
    data = RolloutDataModule(str(tmp_path / "s.sqlite"), batch_size=2, min_batch_size=2, wait_timeout_s=0.5,
                             max_age_s=600.0)  # fmt: skip
    advantage = RLAdvantage(baseline_momentum=None)
    module = OnlineRLModule(policy=tiny_policy, loss=ImportanceSamplingLoss(), advantage=advantage,
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))  # fmt: skip
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert module.skipped["zero_advantage"] == 1 and data.deferred == 2
    assert [(store.get(i).status, store.get(i).meta.deferred) for i in ids] == [("ready", 1)] * 2


def test_a_fixed_store_consumes_a_zero_advantage_step_as_before(tmp_path):
    """`rollout=store` is the data set (no age bound): a sample handed back there could wait forever."""
    from metaclaw.datamodules.rollout import RolloutDataModule
    from metaclaw.store import SampleStore

    store = SampleStore(tmp_path / "s.sqlite")
    (one,) = [store.insert(Sample([5, 6, 7], [8, 9, 10], [-2.0] * 3, reward=-1.0, status="ready"))]
    store.claim_batch(step=0, max_samples=1)
    assert RolloutDataModule(str(tmp_path / "s.sqlite")).defer([one]) == 0 and store.get(one).status == "claimed"
