"""Several agents' adapters in one PEFT model and one Lightning module: a step trains only its batch's adapter.

Every other adapter stays bit-identical (safetensors hashes of what `save_adapter` writes), even with AdamW
weight decay, and the optimizer keeps no state for adapters that took no step."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import lightning as L
import pytest
import torch

from metaclaw.advantages import RLAdvantage
from metaclaw.datamodules.rollout import collate_samples
from metaclaw.losses import ImportanceSamplingLoss
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.modules.policy import LoraPolicy
from metaclaw.store import Sample


def _batch(adapter: str, reward: float = 1.0) -> dict:
    samples = [
        Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], behaviour_logprobs=[-2.0] * 3, reward=reward, id=1),
        Sample(prompt_ids=[5, 7], response_ids=[11, 12], behaviour_logprobs=[-3.0] * 2, reward=-reward, id=2),
    ]
    return {**collate_samples(samples, pad_id=0), "adapter": adapter}


def _fit(module: OnlineRLModule, batches: list[dict]) -> None:
    trainer = L.Trainer(max_steps=len(batches), logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu", gradient_clip_val=1.0)  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))


def _digest(policy: LoraPolicy, adapter: str, directory: Path) -> str:
    path = policy.save_adapter(directory, adapter)
    return hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()


@pytest.fixture
def agents_policy(tiny_spec) -> LoraPolicy:
    return LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, adapters=["alice", "bob"])


def _module(policy: LoraPolicy) -> OnlineRLModule:
    return OnlineRLModule(
        policy=policy,
        loss=ImportanceSamplingLoss(),
        advantage=RLAdvantage(),
        optimizer=functools.partial(torch.optim.AdamW, lr=5e-2, weight_decay=0.1),
    )


def test_training_one_agent_leaves_every_other_agent_adapter_bit_identical(agents_policy, tmp_path):
    before = {a: _digest(agents_policy, a, tmp_path / f"before-{a}") for a in ("default", "alice", "bob")}
    module = _module(agents_policy)
    _fit(module, [_batch("alice"), _batch("alice", -1.0), _batch("bob")])
    after = {a: _digest(agents_policy, a, tmp_path / f"after-{a}") for a in ("default", "alice", "bob")}
    assert after["default"] == before["default"]  # never trained: weight decay did not touch it either
    assert after["alice"] != before["alice"] and after["bob"] != before["bob"]
    assert module.stepped == {"alice", "bob"}
    # the optimizer holds moments only for the adapters that stepped; one parameter group per adapter
    opt = module.optimizers().optimizer
    assert [g["adapter"] for g in opt.param_groups] == ["default", "alice", "bob"]
    stepped = {g["adapter"]: all(p in opt.state for p in g["params"]) for g in opt.param_groups}
    assert stepped == {"default": False, "alice": True, "bob": True}
    assert not any(p in opt.state for p in opt.param_groups[0]["params"])


def test_a_bob_step_does_not_move_alice_who_trained_before(agents_policy, tmp_path):
    module = _module(agents_policy)
    _fit(module, [_batch("alice")])
    alice = _digest(agents_policy, "alice", tmp_path / "alice-1")
    _fit(module, [_batch("bob")])  # Alice's Adam moments are non-zero now: a decayed or momentum step would move her
    assert _digest(agents_policy, "alice", tmp_path / "alice-2") == alice


def test_each_agent_adapter_is_saved_as_a_plain_peft_adapter_that_loads_back(agents_policy, tmp_path, tiny_spec):
    _fit(_module(agents_policy), [_batch("alice")])
    saved = agents_policy.save_adapter(tmp_path / "alice", "alice")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in saved.iterdir()}
    assert not any(p.is_dir() for p in saved.iterdir())  # lifted out of PEFT's `<dir>/alice/`
    fresh = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8)
    fresh.load_adapter(saved)  # into PEFT's default slot: the file is an ordinary single adapter
    mine = {k.replace(".alice.", ".default."): v for k, v in agents_policy.trainable_state_dict().items()
            if ".alice." in k}  # fmt: skip
    theirs = fresh.trainable_state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_every_agent_adapter_stays_trainable_while_another_is_applied(agents_policy):
    """DDP registers the trainable parameters once, when it wraps the model: each adapter must stay trainable."""
    every = {n for n, _ in agents_policy.named_parameters() if LoraPolicy._adapter_of(n) is not None}
    for adapter in ("alice", "bob", "default"):
        agents_policy.use_adapter(adapter)
        assert agents_policy.model.active_adapter == adapter
        assert {n for n, p in agents_policy.named_parameters() if p.requires_grad} == every


def test_one_adapter_policy_keeps_todays_parameters_and_checkpoint_keys(tiny_policy):
    names = set(tiny_policy.trainable_state_dict())
    assert names == {n for n, p in tiny_policy.named_parameters() if p.requires_grad}
    assert tiny_policy.adapter_names == ["default"]


def _fit_from(module: OnlineRLModule, batches: list[dict], ckpt: Path | None, max_steps: int, save: Path | None):
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt, weights_only=False)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer


def _moments(module: OnlineRLModule, adapter: str) -> list[torch.Tensor]:
    opt = module.optimizers().optimizer
    [group] = [g for g in opt.param_groups if g["adapter"] == adapter]
    return [opt.state[p]["exp_avg"].clone() for p in group["params"] if p in opt.state]


def test_agent_resume_with_agents_added_and_reordered_keeps_each_adapter_and_its_optimizer_state(tiny_spec, tmp_path):
    first = _module(LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, adapters=["alice"]))
    _fit_from(first, [_batch("alice"), _batch("default")], None, 2, tmp_path / "last.ckpt")
    alice = {k: v.clone() for k, v in first.policy.trainable_state_dict().items() if ".alice." in k}
    alice_moments = _moments(first, "alice")
    assert alice_moments

    # the config now lists bob first, then alice: bob is new, alice keeps her weights and Adam moments
    second = _module(LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, adapters=["bob", "alice"]))
    _fit_from(second, [_batch("bob")], tmp_path / "last.ckpt", 3, None)
    resumed = second.policy.trainable_state_dict()
    assert all(torch.equal(resumed[k], v) for k, v in alice.items())  # bob's step did not move alice either
    assert all(torch.equal(a, b) for a, b in zip(_moments(second, "alice"), alice_moments, strict=True))
    assert _moments(second, "bob")  # bob stepped with a fresh state


def test_agent_removed_from_the_config_resumes_as_a_one_adapter_run(tiny_spec, tmp_path):
    first = _module(LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8, adapters=["alice"]))
    _fit_from(first, [_batch("default"), _batch("alice")], None, 2, tmp_path / "last.ckpt")
    default = {k: v.clone() for k, v in first.policy.trainable_state_dict().items() if ".default." in k}
    second = _module(LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8))
    _fit_from(second, [_batch("default")], tmp_path / "last.ckpt", 2, None)  # restores, takes no new step
    assert all(torch.equal(second.policy.trainable_state_dict()[k], v) for k, v in default.items())
