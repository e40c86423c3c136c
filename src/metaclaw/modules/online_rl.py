"""`OnlineRLModule`: batch → policy logprobs → advantages → injected loss → optimizer step.

The maths lives in `metaclaw.losses` and `metaclaw.advantages`; this module only orchestrates, guards and logs.

Guards (every rank decides the same, so DDP never waits on a rank that skipped): a step whose loss is not finite
on any rank, whose advantages are 0 on every response token of the global batch, or whose claimed batch holds a
sample forgotten since the claim (`metaclaw.modules.rewind`), takes no optimizer step (the
adapter and AdamW's state are left as they were) but still counts, so claim keys stay aligned with `global_step`.
In one process `training_step` returns `None` and Lightning skips backward and the step. Lightning refuses `None`
under DDP, so there every rank backpropagates `loss × 0` (DDP's all-reduce stays in step) and `on_after_backward`
drops the gradients: AdamW skips parameters without one. Both are counted (`train/skipped_nonfinite`,
`train/skipped_zero_advantage`).

Under DDP each rank holds a slice of the global batch; `global_scale` rescales each rank's loss so that the
gradient DDP averages is the loss aggregated over the global batch (token-mean over all its tokens), not the
mean of per-rank aggregates.

Many agents (docs/agents.md): the policy may hold several named adapters; every batch is one adapter's
(`batch["adapter"]`), which is made active before the step, so only its weights get gradients. AdamW skips
parameters without a gradient (no update, no weight decay, no moment change), so every other adapter stays
bit-identical. Each adapter has its own parameter group; `stepped` says which adapters the publisher must write.
Under DDP every rank trains the same adapter in a step (the store's claim of a step is one batch, whichever rank
makes it) and this is checked before each step (`same_adapter`); DDP runs with `find_unused_parameters`, so the
adapters the step does not train keep no gradient on any rank (docs/agents.md, "Several training processes").
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from metaclaw import profiling
from metaclaw.losses.kl import KLPenalty
from metaclaw.modules import distill_rows as distilled
from metaclaw.modules.agent_state import ADAPTERS_KEY, remap_optimizer_state, same_adapter
from metaclaw.modules.policy import LoraPolicy

if TYPE_CHECKING:
    from metaclaw.advantages.base import AdvantageEstimator
    from metaclaw.losses.base import PolicyLoss

# Returning None from training_step is how a step is skipped in one process (counted in `train/skipped_*`).
warnings.filterwarnings("ignore", message=r".*`training_step` returned `None`.*")


def global_scale(mode: str, mask: Tensor, batch: dict[str, Tensor], world_size: int) -> Tensor:
    """Factor that turns this rank's aggregated loss into its share of the global-batch aggregate.

    DDP averages gradients over ranks, so rank r's loss is scaled by `world_size × local / global` (tokens for
    `token-mean`, sequences for `seq-mean`) and by `world_size` for `sum`; 1 in a single process.
    """
    if world_size == 1:
        return mask.new_ones(())
    if mode == "sum":
        return mask.new_tensor(float(world_size))
    if mode == "token-mean":
        local, total = mask.sum(), batch["group_tokens"].to(mask.dtype)
    elif mode == "seq-mean":
        local, total = (mask.sum(dim=-1) > 0).sum().to(mask.dtype), batch["group_sequences"].to(mask.dtype)
    else:
        raise ValueError(f"unknown aggregation {mode!r}")
    return world_size * local / total.clamp(min=1)


class OnlineRLModule(L.LightningModule):
    """Trains the LoRA adapter of `policy` on scored samples.

    Args:
        policy: the LoRA-wrapped model.
        loss: a policy loss (`metaclaw.losses`): `(logprobs, behaviour_logprobs, advantages, mask) -> LossOutput`.
        advantage: an estimator (`metaclaw.advantages`): `batch -> (advantages [B, T], metrics)`.
        optimizer: a partial taking the trainable parameters (Hydra `_partial_: true`).
        kl: optional KL-to-reference penalty (`losses.KLPenalty`); its `reference` is the adapter the user is
            served (`policy.anchored()`) or the base model (`policy.reference()`).
        distill_loss: the term of distilled rows (`batch["distill"]`, replies sampled with a stated preference
            in context: `modules.distill_rows`); None: such rows are refused by the advantage estimator.
        distill_weight: its weight beside the policy loss.
        distill_top_k: distilled rows that name the prompt their teacher read are trained toward the teacher's
            top-k tokens at each position (`distill_rows.self_distilled`); 0: the sampled tokens only.
    """

    def __init__(
        self,
        policy: LoraPolicy,
        loss: PolicyLoss,
        advantage: AdvantageEstimator,
        optimizer: Callable[..., torch.optim.Optimizer],
        kl: KLPenalty | None = None,
        distill_loss: PolicyLoss | None = None,
        distill_weight: float = 1.0,
        distill_top_k: int = 0,
    ) -> None:
        super().__init__()
        self.policy, self.loss_fn, self.advantage, self.optimizer_factory = policy, loss, advantage, optimizer
        self.kl = kl
        self.distill = None if distill_loss is None else distilled.DistillTerm(distill_loss, distill_weight,
                                                                               distill_top_k)  # fmt: skip
        self.policy.train()  # from_pretrained leaves modules in eval mode
        self.strict_loading = False  # checkpoints hold only the trainable (adapter) weights
        self.reward_mean = MeanMetric()
        self.tokens_per_s = MeanMetric()
        self._t0 = 0.0
        # steps that took no optimizer step, by reason
        self.skipped = {"nonfinite": 0, "zero_advantage": 0, "forgotten": 0}
        self.stepped: set[str] = set()  # adapters trained since the publisher last wrote them (`take_stepped`)
        self.current_adapter = "default"  # the adapter of the batch in progress
        self._refused = False  # the step in progress takes no optimizer step (DDP: its gradients are dropped)

    @property
    def many(self) -> bool:
        return len(getattr(self.policy, "adapter_names", ["default"])) > 1

    def take_stepped(self) -> set[str]:
        """The adapters trained since the last call (the publisher writes those), and start counting anew."""
        stepped, self.stepped = self.stepped, set()
        return stepped

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if not self.many:
            return self.optimizer_factory([p for p in self.policy.parameters() if p.requires_grad])
        groups = [{"params": self.policy.adapter_parameters(a), "adapter": a} for a in self.policy.adapter_names]
        return self.optimizer_factory(groups)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        """`trainer.gradient_clip_val` by norm under FSDP too: the norm over every rank's shards (FSDP's own
        `clip_grad_norm_`; Lightning's FSDP precision refuses `norm` clipping)."""
        from lightning.pytorch.strategies import FSDPStrategy

        if (
            gradient_clip_val
            and gradient_clip_algorithm in (None, "norm")
            and isinstance(self.trainer.strategy, FSDPStrategy)
        ):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()
        if isinstance(batch, dict) and "attention_mask" in batch and not batch.get("epoch"):  # cycle_profile: padding
            mask = batch["attention_mask"]
            profiling.record("train_positions", 0.0, 0.0, float(mask.numel()), count=0)
            profiling.record("train_tokens", 0.0, 0.0, float(mask.sum()), count=0)
            profiling.record("train_samples", 0.0, 0.0, float(mask.shape[0]), count=0)
        self.current_adapter = batch.get("adapter", "default") if isinstance(batch, dict) else "default"
        if self.many:
            if self._trainer is not None and self.trainer.world_size > 1:  # DDP: one adapter on every rank
                names = list(self.policy.adapter_names)
                mine = names.index(self.current_adapter) if self.current_adapter in names else -1
                gathered = self.all_gather(torch.tensor([mine], device=self.device)).reshape(-1).tolist()
                same_adapter(names, gathered)
            self.policy.use_adapter(self.current_adapter)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        world_size = self.trainer.world_size if self._trainer is not None else 1
        self.policy.checkpoint_for(int(batch["input_ids"].numel()))
        rows = distilled.distilled_rows(batch) if self.distill is not None else None
        mask, distill_mask = distilled.split_mask(batch["mask"], rows)  # distilled rows: cross-entropy only
        ref = self._kl_reference(batch, mask)  # first: the anchor's weights go in and out before any graph exists
        taught = distilled.teacher_rows(batch, rows, self.distill.top_k if self.distill is not None else 0)
        if world_size > 1:  # every rank runs the teacher's forward or none does (FSDP gathers weights in each)
            every = self.all_gather(torch.tensor([taught is not None], device=self.device)).reshape(-1)
            taught = taught if bool(every.all()) else None
        distill_mask = distilled.without_untaught_own(batch, distill_mask, taught)
        if taught is not None:  # rows trained toward the teacher's top-k, in the same forward
            logprobs, soft, soft_metrics = distilled.self_distilled(self.policy, batch, taught, self.distill.top_k)  # type: ignore[union-attr]
        else:
            logprobs = self._logprobs(batch)
        advantages, adv_metrics = distilled.policy_advantages(self.advantage, batch, rows)
        out = self.loss_fn(logprobs, batch["behaviour_logprobs"], advantages.detach(), mask)
        loss, metrics = out.loss, dict(out.metrics)
        totals = distilled.part_totals(batch, distilled=False) if rows is not None else batch
        loss = loss * global_scale(getattr(self.loss_fn, "aggregation", "token-mean"), mask, totals, world_size)
        if rows is not None and self.distill is not None:
            d_agg = getattr(self.distill.loss, "aggregation", "token-mean")
            d_totals = distilled.part_totals(batch, True)
            learnt = logprobs if taught is None else torch.where(taught[:, None], soft, logprobs)
            d_loss, d_metrics = distilled.distill_term(self.distill.loss, learnt, batch, distill_mask, rows)
            loss = loss + self.distill.weight * d_loss * global_scale(d_agg, distill_mask, d_totals, world_size)
            metrics.update(d_metrics if taught is None else {**d_metrics, **soft_metrics})
        if ref is not None and self.kl is not None:
            kl_out = self.kl(logprobs, ref, mask)
            loss = loss + kl_out.loss * global_scale(self.kl.aggregation, mask, totals, world_size)
            metrics.update(kl_out.metrics)
        mask, advantages = batch["mask"], distilled.with_distilled(advantages, distill_mask)  # distilled rows teach
        skip = self._skip_reason(loss, advantages.detach(), mask, bool(batch.get("forgotten")))
        if skip is not None:
            self.skipped[skip] += 1
        if skip == "zero_advantage":
            self._defer(batch)
        self._log_step(batch, advantages, loss, metrics, adv_metrics, skip)
        if skip is None:
            self.stepped.add(batch.get("adapter", "default"))
        if self.many:
            self._log_agent(batch, loss, metrics, skip)
        self._refused = skip is not None
        if skip is None:
            return loss
        return None if world_size == 1 else loss * 0.0  # DDP: see the module docstring

    def _kl_reference(self, batch: dict[str, Tensor], mask: Tensor) -> Tensor | None:
        """The KL term's reference logprobs `[B, T]` (None: no KL term this step): under the served adapter
        (`kl.reference=served`: `LoraPolicy.anchored`, the base model until one is served) or the base model."""
        if self.kl is None or self.kl.coef <= 0 or not bool(mask.any()):
            return None
        served = self.kl.reference == "served"
        with torch.no_grad(), self.policy.anchored() if served else self.policy.reference(), \
                profiling.phase("kl_reference"):  # fmt: skip
            return self._logprobs(batch)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step (forward, backward and the optimizer inside its closure), timed as `train_step`."""
        with profiling.phase("train_step"):
            super().optimizer_step(*args, **kwargs)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """`train/grad_norm` (the global 2-norm before clipping; 0 for a refused step, which has no gradient) and
        `train/lr`, every optimizer step."""
        grads = [] if self._refused else [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)
        self.log("train/lr", float(optimizer.param_groups[0]["lr"]), on_step=True, on_epoch=False, batch_size=1)

    def on_after_backward(self) -> None:
        """A refused step under DDP: drop the (all-reduced) gradients, so AdamW leaves every weight as it was."""
        if self._refused:
            for p in self.parameters():
                p.grad = None

    def _log_agent(self, batch: dict[str, Any], loss: Tensor, metrics: dict, skip: str | None) -> None:
        """The step's figures again under `agent/<adapter>/...`: each agent's curve on its own."""
        prefix, n = f"agent/{batch.get('adapter', 'default')}/", batch["mask"].shape[0]
        self.log(f"{prefix}train/samples", float(n), reduce_fx="sum", batch_size=n)
        if skip is not None:
            self.log(f"{prefix}train/skipped_{skip}", 1.0, reduce_fx="sum", batch_size=n)
            return
        self.log(f"{prefix}loss/total", loss.detach(), batch_size=n)
        self.log_dict({f"{prefix}loss/{k}": torch.as_tensor(v).float() for k, v in metrics.items()}, batch_size=n)
        if batch["has_reward"].any():
            self.log(f"{prefix}rollout/reward_mean", batch["reward"][batch["has_reward"]].mean(), batch_size=n)

    def _defer(self, batch: dict[str, Any]) -> None:
        """No sample is consumed without a gradient: a batch whose advantages are all zero (equal rewards) goes
        back to the store (each rank its own slice), to be trained beside other rewards (`RolloutDataModule.defer`).
        A run fed by a plain data loader has no store: its batch is only skipped."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        defer = getattr(datamodule, "defer", None)
        if defer is not None and "sample_ids" in batch:
            defer([int(i) for i in batch["sample_ids"].tolist() if int(i) >= 0])

    def _skip_reason(self, loss: Tensor, advantages: Tensor, mask: Tensor, forgotten: bool = False) -> str | None:
        """`forgotten` if any rank's slice holds a sample forgotten since the claim (`modules.rewind`),
        `nonfinite` if the loss is not finite on any rank, `zero_advantage` if no rank has a non-zero one."""
        on = mask > 0
        flags = torch.stack([(~torch.isfinite(loss.detach())).float(), (advantages[on] != 0).any().float(),
                             torch.tensor(float(forgotten), device=loss.device)]).to(self.device)  # fmt: skip
        if self._trainer is not None and self.trainer.world_size > 1:
            flags = self.all_gather(flags).reshape(-1, 3).max(dim=0).values
        if flags[2] > 0:
            return "forgotten"
        if flags[0] > 0:
            return "nonfinite"
        if flags[1] == 0:
            return "zero_advantage"
        return None

    def _logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """Policy logprobs at the response positions, over the distribution each sample was drawn from."""
        ones = torch.ones_like(batch["temperature"])
        return self.policy.logprobs(
            batch["input_ids"],
            batch["target_ids"],
            batch["attention_mask"],
            batch["temperature"],
            batch.get("top_p", ones),
            batch.get("top_k", -ones.long()),
            mask=batch["mask"],
        )

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._t0
        if elapsed > 0:
            self.tokens_per_s(batch["attention_mask"].sum() / elapsed)
            self.log("train/tokens_per_s", self.tokens_per_s, on_step=True, on_epoch=False)

    def _log_step(
        self,
        batch: dict[str, Tensor],
        advantages: Tensor,
        loss: Tensor,
        metrics: dict,
        adv_metrics: dict,
        skip: str | None,
    ) -> None:
        mask = batch["mask"].bool()
        n = mask.shape[0]
        for reason, count in self.skipped.items():
            self.log(f"train/skipped_{reason}", float(count), prog_bar=True, reduce_fx="max", batch_size=n)
        deferred = (
            getattr(getattr(self._trainer, "datamodule", None), "deferred", 0) if self._trainer is not None else 0
        )
        self.log("train/deferred_samples", float(deferred), reduce_fx="max", batch_size=n)
        signal = ((advantages.detach() != 0) & mask).any(dim=-1)
        self.log("train/zero_advantage_frac", 1.0 - signal.float().mean(), batch_size=n)
        if skip in ("nonfinite", "forgotten"):  # nothing from this step may reach the running means
            return
        if batch["has_reward"].any():
            self.reward_mean(batch["reward"][batch["has_reward"]])
            self.log("rollout/reward_mean", self.reward_mean, on_step=True, on_epoch=False, batch_size=n)
        self.log("loss/total", loss.detach(), prog_bar=True, batch_size=n)
        self.log_dict({f"loss/{k}": v.float() for k, v in metrics.items()}, batch_size=n)
        self.log_dict({f"train/{k}": torch.as_tensor(v).float() for k, v in adv_metrics.items()}, batch_size=n)
        self.log("train/samples", 0.0 if batch.get("epoch") else float(n), reduce_fx="sum", batch_size=n)  # new ones
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
        if self.many:
            checkpoint[ADAPTERS_KEY] = list(self.policy.adapter_names)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Agents added, removed or reordered since the checkpoint: each keeps its own optimizer state."""
        names = list(getattr(self.policy, "adapter_names", ["default"]))
        old = checkpoint.get(ADAPTERS_KEY, ["default"])
        if old == names or not checkpoint.get("optimizer_states"):
            return
        new = [(a, len(self.policy.adapter_parameters(a))) for a in names]
        states = checkpoint["optimizer_states"]
        states[0] = remap_optimizer_state(states[0], old, new, grouped=self.many)
