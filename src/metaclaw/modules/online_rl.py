"""`OnlineRLModule`: batch → policy logprobs → advantages → injected loss → optimizer step.

The maths lives in `metaclaw.losses` and `metaclaw.advantages`; this module only orchestrates and logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, MinMetric

from metaclaw.modules.policy import LoraPolicy


class OnlineRLModule(L.LightningModule):
    """Trains the LoRA adapter of `policy` on scored samples.

    Args:
        policy: the LoRA-wrapped model.
        loss: a policy loss (`metaclaw.losses`): `(logprobs, behaviour_logprobs, advantages, mask) -> LossOutput`.
        advantage: an estimator (`metaclaw.advantages`): `batch -> (advantages [B, T], metrics)`.
        optimizer: a partial taking the trainable parameters (Hydra `_partial_: true`).
        kl: optional KL-to-reference penalty; the reference is `policy` with its adapter disabled.
    """

    def __init__(
        self,
        policy: LoraPolicy,
        loss: torch.nn.Module,
        advantage: Callable[[dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]],
        optimizer: Callable[..., torch.optim.Optimizer],
        kl: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.policy, self.loss_fn, self.advantage, self.optimizer_factory, self.kl = (
            policy,
            loss,
            advantage,
            optimizer,
            kl,
        )
        self.policy.train()  # from_pretrained leaves modules in eval mode
        self.strict_loading = False  # checkpoints hold only the trainable (adapter) weights
        self.reward_mean, self.adv_mean = MeanMetric(), MeanMetric()
        self.adv_min, self.adv_max = MinMetric(), MaxMetric()
        self.tokens_per_s = MeanMetric()
        self._t0 = 0.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory([p for p in self.policy.parameters() if p.requires_grad])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        mask = batch["mask"]
        logprobs = self.policy.logprobs(
            batch["input_ids"], batch["target_ids"], batch["attention_mask"], batch["temperature"]
        )
        advantages, adv_metrics = self.advantage(batch)
        out = self.loss_fn(logprobs, batch["behaviour_logprobs"], advantages.detach(), mask)
        loss, metrics = out.loss, dict(out.metrics)
        if self.kl is not None and self.kl.coef > 0:
            with torch.no_grad(), self.policy.reference():
                ref = self.policy.logprobs(
                    batch["input_ids"], batch["target_ids"], batch["attention_mask"], batch["temperature"]
                )
            kl_out = self.kl(logprobs, ref, mask)
            loss = loss + kl_out.loss
            metrics.update(kl_out.metrics)
        with torch.no_grad():
            ratio = torch.exp((logprobs - batch["behaviour_logprobs"]) * mask)[mask.bool()]
            if ratio.numel():
                metrics["ratio_max"] = ratio.max()
        self._log_step(batch, advantages, loss, metrics, adv_metrics)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._t0
        if elapsed > 0:
            self.tokens_per_s(batch["attention_mask"].sum() / elapsed)
            self.log("train/tokens_per_s", self.tokens_per_s, on_step=True, on_epoch=False)

    def _log_step(
        self, batch: dict[str, Tensor], advantages: Tensor, loss: Tensor, metrics: dict, adv_metrics: dict
    ) -> None:
        mask = batch["mask"].bool()
        n = mask.shape[0]
        if batch["has_reward"].any():
            self.reward_mean(batch["reward"][batch["has_reward"]])
            self.log("rollout/reward_mean", self.reward_mean, on_step=True, on_epoch=False, batch_size=n)
        adv = advantages.detach()[mask]
        if adv.numel():
            self.adv_mean(adv)
            self.adv_min(adv)
            self.adv_max(adv)
            for name, metric in (("mean", self.adv_mean), ("min", self.adv_min), ("max", self.adv_max)):
                self.log(f"train/advantage_{name}", metric, on_step=True, on_epoch=False, batch_size=n)
        self.log("loss/total", loss.detach(), prog_bar=True, batch_size=n)
        self.log_dict({f"loss/{k}": v.float() for k, v in metrics.items()}, batch_size=n)
        self.log_dict({f"train/{k}": torch.as_tensor(v).float() for k, v in adv_metrics.items()}, batch_size=n)
        self.log("train/samples", float(n), reduce_fx="sum", batch_size=n)
        self.log("train/response_tokens", batch["mask"].sum(), batch_size=n)
        self.log(
            "train/adapter_version_lag", (self.global_step - batch["adapter_version"].float()).mean(), batch_size=n
        )

    def on_train_epoch_end(self) -> None:
        # An epoch is one stream of samples; it ends only when none arrived for `data.wait_timeout_s`.
        self.trainer.should_stop = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainable = {f"policy.{k}" for k in self.policy.trainable_state_dict()}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
