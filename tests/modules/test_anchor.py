"""`kl.reference=served`: the KL term's reference is the adapter the user is served, read from the served pointer."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from metaclaw.advantages import RLAdvantage
from metaclaw.datamodules.rollout import collate_samples
from metaclaw.losses import ImportanceSamplingLoss, KLPenalty
from metaclaw.modules.anchor import ServedAnchor
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.runfiles.layout import RunLayout
from metaclaw.store import Sample


def _batch() -> dict[str, torch.Tensor]:
    samples = [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], behaviour_logprobs=[-2.0] * 4,
                      reward=r, id=i + 1) for i, r in enumerate([1.0, -1.0])]  # fmt: skip
    return collate_samples(samples, pad_id=0)


def _perturb(policy, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.3)


def _kl_of_one_step(policy, run_dir, reference: str) -> tuple[float, ServedAnchor]:
    """The `loss/kl` of one step (lr 0: the weights stay) with the KL term toward `reference`."""
    module = OnlineRLModule(policy=policy, loss=ImportanceSamplingLoss(), advantage=RLAdvantage(),
                            optimizer=functools.partial(torch.optim.SGD, lr=0.0),
                            kl=KLPenalty(coef=1.0, reference=reference))  # fmt: skip
    anchor = ServedAnchor(run_dir)
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu", callbacks=[anchor])  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([_batch()], batch_size=None))
    return float(trainer.callback_metrics["loss/kl"]), anchor


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_kl_term_is_zero_at_the_served_adapter_and_not_toward_the_base_model(tmp_path, tiny_policy):
    """A trainer whose weights are the served adapter's has KL 0 to its reference (served), while the same trainer
    measured toward the base model is far from 0: a batch of equal thanks no longer pulls a learnt preference out."""
    _perturb(tiny_policy, 1)
    layout = RunLayout(tmp_path)
    path = tiny_policy.save_adapter(layout.adapters().version_dir(4))
    layout.adapters().write_latest(4, path, "policy")
    served_kl, anchor = _kl_of_one_step(tiny_policy, tmp_path, "served")
    base_kl, _ = _kl_of_one_step(tiny_policy, tmp_path, "base")
    assert served_kl == pytest.approx(0.0, abs=1e-6)
    assert base_kl > 1e-3
    assert anchor.changes == [(0, "default", str(path))]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_anchor_follows_the_served_pointer_and_falls_back_to_the_base_model(tmp_path, tiny_policy):
    """The pointer moves (the gate served a newer adapter, or a rollback an older one): the anchor moves with it;
    no pointer, or a pointer whose folder is gone, anchors the base model."""
    layout = RunLayout(tmp_path)
    folder = layout.adapters()
    _perturb(tiny_policy, 1)
    first = tiny_policy.save_adapter(folder.version_dir(4))
    _perturb(tiny_policy, 2)
    second = tiny_policy.save_adapter(folder.version_dir(8))
    anchor = ServedAnchor(tmp_path)
    assert anchor.served_path("default") is None  # nothing served yet: the base model
    folder.write_latest(4, first, "policy")
    assert anchor.served_path("default") == str(first)
    folder.write_latest(8, second, "policy", rolled_back=True)
    assert anchor.served_path("default") == str(second)
    folder.write_latest(12, tmp_path / "gone", "policy")
    assert anchor.served_path("default") is None
    folder.write_latest(8, second, "policy")
    kl, anchor = _kl_of_one_step(tiny_policy, tmp_path, "served")  # the trainer's weights are the second's
    assert kl == pytest.approx(0.0, abs=1e-6) and anchor.changes == [(0, "default", str(second))]


def test_an_unknown_reference_is_refused():
    with pytest.raises(ValueError, match="kl.reference"):
        KLPenalty(reference="teacher")
