"""`metaclaw.modules.rewind` (issue 43, `forget --rollback`): the trainer goes back to the clean state and trains
on from it; a claimed batch holding a forgotten sample takes no step; nothing published from older weights is
served. The live service end to end: tests/privacy/test_forget_live.py."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import torch

from metaclaw.advantages import RLAdvantage
from metaclaw.datamodules.rollout import collate_samples
from metaclaw.losses import ImportanceSamplingLoss
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.modules.policy import LoraPolicy
from metaclaw.modules.publisher import AdapterPublisher
from metaclaw.modules.rewind import Rewind, RewindCallback
from metaclaw.store import Sample, SampleStore

LR = 1e-2


def _batch(ids: tuple[int, int]) -> dict:
    samples = [
        Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], behaviour_logprobs=[-2.0] * 3, reward=1.0, id=ids[0]),
        Sample(prompt_ids=[5, 7], response_ids=[11, 12], behaviour_logprobs=[-3.0] * 2, reward=-1.0, id=ids[1]),
    ]
    return collate_samples(samples, pad_id=0)


def _stored(path: Path) -> tuple[int, int]:
    store = SampleStore(path)
    ids = [store.insert(Sample(prompt_ids=[5, 6], response_ids=[7], behaviour_logprobs=[-1.0], reward=1.0))
           for _ in range(2)]  # fmt: skip
    store.close()
    return ids[0], ids[1]


class AskAfterFirstStep(L.Callback):
    """What the control plane does from its own thread, here between steps 1 and 2: ask for the base model."""

    def __init__(self, rewind: Rewind | None) -> None:
        self.rewind = rewind

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == 1 and self.rewind is not None:
            self.rewind.request("default", None)


def _train(tiny_spec, store: Path, rewind: Rewind | None) -> tuple[OnlineRLModule, float]:
    present = _stored(store)
    module = OnlineRLModule(LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8), ImportanceSamplingLoss(),
                            RLAdvantage(), functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.0))  # fmt: skip
    callbacks = [RewindCallback(rewind or Rewind(), store), AskAfterFirstStep(rewind)]
    trainer = L.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu", callbacks=callbacks)  # fmt: skip
    batches = [_batch(present), _batch((9001, 9002)), _batch(present)]  # 9001, 9002: forgotten after the claim
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    b = [p for n, p in module.policy.named_parameters() if "lora_B" in n]
    return module, max(float(p.detach().abs().max()) for p in b)


def test_a_rewind_to_the_base_model_holds_and_a_forgotten_batch_takes_no_step(tiny_spec, tmp_path):
    module, b_max = _train(tiny_spec, tmp_path / "rewound.sqlite", Rewind())
    assert module.skipped["forgotten"] == 1  # the batch whose samples left the store
    # back to B = 0 with fresh AdamW moments before step 2 (dropped), then one step: |update| <= lr
    assert 0 < b_max <= LR * (1 + 1e-4)
    plain, plain_max = _train(tiny_spec, tmp_path / "plain.sqlite", None)
    assert plain.skipped["forgotten"] == 1 and plain_max > LR * 1.05  # two steps on: the check can fail


def test_nothing_published_from_weights_before_a_rewind_is_served(tmp_path):
    rewind = Rewind()
    publisher = AdapterPublisher(str(tmp_path / "run"), str(tmp_path / "s.sqlite"), rewind=rewind)
    served: list[Path] = []
    old = tmp_path / "run" / "adapters" / "step-000003"
    old.mkdir(parents=True)
    stale = publisher.guarded(served.append)  # written from the weights of generation 0
    rewind.request("default", None)  # the control plane rolls back before the gate serves it
    stale(old)
    assert served == [] and not old.exists()
    rewind.take()
    rewind.weights_generation = rewind.generation  # the trainer took the request: its weights are clean again
    fresh = tmp_path / "run" / "adapters" / "step-000004"
    fresh.mkdir()
    publisher.guarded(served.append)(fresh)
    assert served == [fresh]


def test_a_rewind_no_checkpoint_holds_yet_is_applied_again_after_a_restart(tiny_spec, tmp_path):
    Rewind(tmp_path / "run").request("default", None)  # asked; the service stopped before its next checkpoint
    rewind = Rewind(tmp_path / "run")  # the restarted run
    assert rewind.pending_record("default") == {"path": None, "done": False}
    policy = LoraPolicy(tiny_spec.load_model(), rank=4, alpha=8)
    with torch.no_grad():  # the checkpoint it resumes from: weights trained on the forgotten turns
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.fill_(0.5)
    module = OnlineRLModule(policy, ImportanceSamplingLoss(), RLAdvantage(),
                            functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.0))  # fmt: skip
    store = tmp_path / "s.sqlite"
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu",
                        callbacks=[RewindCallback(rewind, store)])  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([_batch(_stored(store))], batch_size=None))
    b_max = max(float(p.detach().abs().max()) for n, p in policy.named_parameters() if "lora_B" in n)
    assert 0 < b_max <= LR * (1 + 1e-4)  # one step from the base model, not from 0.5
    rewind.settle()  # what the publisher does once a checkpoint holds the rewound weights
    assert rewind.pending_record("default") is None
