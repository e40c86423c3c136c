"""Streaming `LightningDataModule`: ready samples from the store, batched by a token budget, one batch a step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from metaclaw.distribution import sample_distribution
from metaclaw.store import BACKLOG_POLICIES, Sample, SampleStore, ServedVersions, open_store

log = logging.getLogger(__name__)


def collate_samples(samples: list[Sample], pad_id: int, group: list[Sample] | None = None) -> dict[str, Tensor]:
    """Pack samples into right-padded `[B, T]` tensors with Tinker's shift: inputs = seq[:-1], targets = seq[1:].

    `mask` is 1 exactly on the positions whose target is a response token, so `behaviour_logprobs[b, t]` is the
    sampler's logprob of `target_ids[b, t]`. Rows without a teacher have NaN `teacher_logprobs`; samples without
    a reward have NaN `reward`. `temperature`, `top_p`, `top_k` are the sampler's (`meta["sampling"]`), so the
    trainer's logprobs are over the behaviour distribution.

    `distill` marks the rows whose reply was sampled with a stated preference in context (`meta.distilled`): the
    trainer gives them a cross-entropy term instead of the policy loss (`modules.distill_rows`).

    `group` is the whole step's batch when `samples` is one DDP rank's slice of it (default: `samples`): its
    rewards (`group_reward`, NaN when unscored), response tokens (`group_tokens`) and sequences
    (`group_sequences`) let every rank normalise rewards and average the loss over the global batch.
    """
    group = samples if group is None else group
    lengths = [s.num_tokens - 1 for s in samples]
    B, T = len(samples), max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    target_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    behaviour = torch.zeros(B, T)
    teacher = torch.full((B, T), float("nan"))
    dists = [sample_distribution(s.temperature, s.meta) for s in samples]
    for b, s in enumerate(samples):
        seq = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        n, p, r = lengths[b], len(s.prompt_ids), len(s.response_ids)
        input_ids[b, :n] = seq[:-1]
        target_ids[b, :n] = seq[1:]
        attention_mask[b, :n] = 1
        mask[b, p - 1 : p - 1 + r] = 1.0
        behaviour[b, p - 1 : p - 1 + r] = torch.tensor(s.behaviour_logprobs)
        if s.teacher_logprobs is not None:
            teacher[b, p - 1 : p - 1 + r] = torch.tensor(s.teacher_logprobs)
    return {
        **teacher_context(samples, pad_id),
        "input_ids": input_ids,
        "target_ids": target_ids,
        "attention_mask": attention_mask,
        "mask": mask,
        "behaviour_logprobs": behaviour,
        "teacher_logprobs": teacher,
        "reward": torch.tensor([float("nan") if s.reward is None else s.reward for s in samples]),
        "has_reward": torch.tensor([s.reward is not None for s in samples]),
        "has_teacher": torch.tensor([s.teacher_logprobs is not None for s in samples]),
        "temperature": torch.tensor([d["temperature"] for d in dists]),
        "top_p": torch.tensor([d["top_p"] for d in dists]),
        "top_k": torch.tensor([d["top_k"] for d in dists]),
        "adapter_version": torch.tensor([s.adapter_version for s in samples]),
        "sample_ids": torch.tensor([s.id for s in samples]),
        "group_reward": torch.tensor([float("nan") if s.reward is None else s.reward for s in group]),
        "group_tokens": torch.tensor(sum(len(s.response_ids) for s in group)),
        "group_sequences": torch.tensor(len(group)),
        # replies sampled with a stated preference in context (scoring.distill): a cross-entropy term, no ratio
        "distill": torch.tensor([s.meta.distilled is not None for s in samples]),
        # a corrected reply kept to be pulled toward its teacher's tokens: never trained on its own tokens
        "distill_own": torch.tensor([(s.meta.distilled or {}).get("kind") == "own" for s in samples]),
        "group_distill_tokens": torch.tensor(sum(len(s.response_ids) for s in group if s.meta.distilled is not None)),
        "group_distill_sequences": torch.tensor(sum(s.meta.distilled is not None for s in group)),
    }


def teacher_context(samples: list[Sample], pad_id: int) -> dict[str, Tensor]:
    """The self-distillation teacher's inputs (`modules.distill_rows`): for each distilled row that names the prompt
    the teacher read (`meta.distilled.teacher_prompt_ids`: the conversation with the person's stated preference in
    it), that prompt followed by the row's reply, right-padded like the policy's inputs; `teacher_mask` is 1 on the
    positions whose next token is a reply token (the same tokens, in the same order, as the row's `mask`). Empty
    when no row has one."""
    prompts = [(s.meta.distilled or {}).get("teacher_prompt_ids") for s in samples]
    if not any(prompts):
        return {}
    rows = [[*p, *s.response_ids][:-1] if p else [] for p, s in zip(prompts, samples, strict=True)]
    B, T = len(samples), max(len(r) for r in rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention, where = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
    for b, (p, row) in enumerate(zip(prompts, rows, strict=True)):
        if p:
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention[b, : len(row)] = 1
            where[b, len(p) - 1 : len(row)] = 1.0
    return {"teacher_input_ids": ids, "teacher_attention_mask": attention, "teacher_mask": where,
            "has_teacher_prompt": torch.tensor([bool(p) for p in prompts])}  # fmt: skip


def check_token_budget(max_tokens: int | None, max_sample_tokens: int | None, world_size: int) -> None:
    """Raise ValueError unless the step's token budget holds one longest sample per rank.

    Otherwise a step could never claim one sample per rank and the stream would wait forever.
    """
    if max_tokens is not None and max_sample_tokens is not None and max_tokens < world_size * max_sample_tokens:
        raise ValueError(
            f"data.max_tokens ({max_tokens}) must be >= the training processes ({world_size}) x "
            f"data.max_sample_tokens ({max_sample_tokens}) = {world_size * max_sample_tokens}: otherwise a step "
            "may never hold one sample per process"
        )


@dataclass(frozen=True)
class BatchShape:
    """How big a claimed batch is (`StreamingSampleDataset`'s arguments of these names)."""

    batch_size: int
    max_tokens: int | None
    max_sample_tokens: int | None
    min_samples: int = 1  # the fewest samples a step claims (at least one per rank)


@dataclass(frozen=True)
class Freshness:
    """Which samples a claim still takes: from recent enough adapters, skills and time (`data.*`)."""

    min_adapter_version: Callable[[], int | dict[str, int] | None]
    served_version: Callable[[], int | dict[str, int] | None]
    max_age_s: float | None
    latest_skill_generation_only: bool


class StreamingSampleDataset(IterableDataset):
    """Yields one collated batch per optimizer step, claimed from the store under that step's number.

    With `epochs` > 1 each claimed batch is yielded that many times in a row (`batch["epoch"]` 0, 1, ...): PPO-style
    epochs, several optimizer steps on one batch; the claim belongs to the first of them.

    Every rank claims the same global batch (claims are idempotent per step) and keeps its slice, so no sample
    is trained twice and ranks stay in lock-step. Waiting for samples blocks on the store, never spins.
    """

    def __init__(
        self,
        store_path: str | Path,
        first_step: Callable[[], int],
        pad_id: int,
        batch_size: int,
        max_tokens: int | None,
        max_sample_tokens: int | None,
        wait_timeout_s: float | None,
        rank: int = 0,
        world_size: int = 1,
        min_adapter_version: Callable[[], int | dict[str, int] | None] = lambda: None,
        max_backlog: int | None = None,
        gate: Callable[[], bool] | None = None,
        latest_skill_generation_only: bool = False,
        should_stop: Callable[[], bool] = lambda: False,
        partition: Callable[[str], str] | None = None,
        ungated: Callable[[], tuple[bool, set[str]] | None] = lambda: None,
        min_batch_size: int = 1,
        max_age_s: float | None = None,
        served_version: Callable[[], int | dict[str, int] | None] = lambda: None,
        epochs: int = 1,
    ) -> None:
        if batch_size < world_size:
            raise ValueError(f"data.batch_size ({batch_size}) must be >= the number of processes ({world_size})")
        check_token_budget(max_tokens, max_sample_tokens, world_size)
        if max_tokens is not None and max_sample_tokens is None and world_size > 1:
            max_sample_tokens = max_tokens // world_size  # so that one sample per rank always fits
        self.store_path, self.first_step, self.pad_id = store_path, first_step, pad_id
        self.shape = BatchShape(batch_size, max_tokens, max_sample_tokens, max(world_size, min_batch_size))
        self.wait_timeout_s, self.rank, self.world_size = wait_timeout_s, rank, world_size
        self.fresh = Freshness(min_adapter_version, served_version, max_age_s, latest_skill_generation_only)
        self.max_backlog, self.gate, self.should_stop = max_backlog, gate, should_stop
        self.epochs = epochs  # optimizer steps per claimed batch (PPO-style epochs)
        self.partition = partition  # agent id -> adapter: batches are single-adapter (docs/agents.md)
        # Many agents in mode=auto: `(open, adapters)`: whether a window is open now (never blocks) and the
        # adapters of `rl` agents, which train outside windows too. None: the gate blocks for every adapter.
        self.ungated = ungated
        self.end_reason: str | None = None  # why the stream ended (None: it has not, or the trainer stopped it)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        store = open_store(self.store_path)
        step = self.first_step()
        try:
            while True:
                batch = self._claim(store, step)
                if batch is None:
                    if self.should_stop():
                        self.end_reason = "stop requested"
                    else:
                        self.end_reason = f"no new sample for {self.wait_timeout_s:g}s (rollout.wait_timeout_s)"
                        if ready := store.count("ready"):
                            self.end_reason += f"; {ready} ready, fewer than the {self.shape.min_samples} a step needs"
                    log.info("The sample stream ends: %s", self.end_reason)
                    return
                out = collate_samples(batch[self.rank :: self.world_size], self.pad_id, group=batch)
                if self.partition is not None:
                    out["adapter"] = self.partition(batch[0].agent_id)  # the adapter this step trains
                for epoch in range(self.epochs):  # the claim is step `step`'s; the repeats only reuse it
                    yield out if self.epochs == 1 else {**out, "epoch": epoch}  # type: ignore[dict-item]
                    step += 1
        finally:
            store.close()

    def _claim(self, store: SampleStore, step: int) -> list[Sample] | None:
        timeout = self.wait_timeout_s if self.wait_timeout_s is not None else float("inf")
        deadline = time.monotonic() + timeout
        polled = time.monotonic()
        seen_ready = store.count("ready")
        while True:
            if self.should_stop():
                return None
            allowed = None
            ungated = self.ungated() if self.gate is not None else None
            if ungated is not None:  # per-agent windows: outside one, only the `rl` agents' adapters step
                open_now, always = ungated
                allowed = None if open_now else always
                if not open_now:  # time outside a window is not "no samples"
                    deadline += time.monotonic() - polled
                polled = time.monotonic()
            elif self.gate is not None:  # the scheduler: nothing is claimed outside a training window
                closed_since = time.monotonic()
                if not self.gate():
                    log.info("The scheduler is stopping: the stream ends")
                    return None
                deadline += time.monotonic() - closed_since  # time spent outside a window is not "no samples"
            batch = store.claim_batch(
                step,
                self.shape.batch_size,
                self.shape.max_tokens,
                self.shape.max_sample_tokens,
                self.fresh.min_adapter_version(),
                min_samples=self.shape.min_samples,
                max_backlog=self.max_backlog,
                latest_skill_generation_only=self.fresh.latest_skill_generation_only,
                partition=self.partition,
                partitions=allowed,
                # under a scheduler samples wait for a training window by design: only the version bound applies
                max_age_s=self.fresh.max_age_s if self.gate is None else None,
                served_version=self.fresh.served_version(),
            )
            if batch:
                return batch
            ready = store.count("ready")
            if ready > seen_ready:  # samples still arrive, only slower than a batch: the wait is for the next one
                deadline = max(deadline, time.monotonic() + timeout)
            seen_ready = ready
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if allowed is not None:  # outside a window: re-check it (and the `rl` agents' samples) every second
                time.sleep(min(left, 1.0))
            elif ready:  # some are ready, but no batch could be formed yet (fewer than one per rank)
                time.sleep(min(left, 0.2))  # poll gently: each claim attempt is a write transaction
            else:
                store.wait_for_ready(min(left, 0.5))  # short waits: a stop request is seen within 0.5 s


@dataclass(frozen=True)
class BatchSettings:
    """A step's batch (`RolloutDataModule`'s arguments of these names)."""

    batch_size: int
    min_batch_size: int
    max_tokens: int | None
    max_sample_tokens: int | None
    epochs_per_batch: int


@dataclass(frozen=True)
class SampleBounds:
    """How fresh a trained sample is and how many may wait (`RolloutDataModule`'s arguments of these names)."""

    max_staleness: int | None
    max_age_s: float | None
    max_backlog: int | None
    backlog_policy: str
    latest_skill_generation_only: bool


class RolloutDataModule(L.LightningDataModule):
    """Feeds `OnlineRLModule` from a `SampleStore`, whatever fills it (a shipped store, the live proxy, replay).

    Args:
        store_path: the SQLite sample store.
        batch_size: most samples per optimizer step (global, across ranks).
        min_batch_size: fewest samples per step: a step waits (up to `wait_timeout_s`) until this many are
            ready. RL's baseline is the batch mean, so a batch of one carries no reward signal.
        max_tokens: token budget per step (prompt + response, global); None for no budget.
        max_sample_tokens: samples longer than this are dropped (the model's context).
        wait_timeout_s: how long to wait for new samples before the stream (and so `fit`) ends; None: forever.
        max_staleness: never train a sample from an adapter more than this many versions behind the adapter
            the policy server serves or the trainer's own version, whichever is newer (settled `dropped`, reason
            `stale`); None: no bound in versions.
        max_age_s: never train a sample captured more than this many seconds ago (`stale` too); None: no bound.
            Not applied under a scheduler (mode=auto): samples captured outside a training window wait for one.
            Steps claim the newest ready samples first; both bounds settle the ones left behind
            (docs/online_loop.md, "Freshness").
        max_backlog: bound on the samples waiting to be trained; None: unbounded (a fixed store).
        backlog_policy: `drop_oldest` (each claim first drops the oldest ready samples beyond `max_backlog`,
            reason `backlog`) or `pause_capture` (the proxy stops capturing new turns while pending + ready
            reach `max_backlog`; they are still answered). See `SampleStore.capture_limit`.
        latest_skill_generation_only: drop samples gathered under an agent's older skill generation.
        pad_id: padding token id.
        epochs_per_batch: optimizer steps on each claimed batch (PPO-style epochs; > 1 needs a clipped loss,
            `loss=ppo` or `loss=cispo`). The samples are consumed once a checkpoint covers the claim's step; a
            resume between two epochs of a batch moves on to a new batch (the old one was trained at least once).
        served: the adapter versions the policy server serves (staleness counts against them), shared with the
            `AdapterPublisher` that updates them; a fresh one (version 0) when None.
        should_stop: the run's stop request (`StopController.should_stop`): ends a wait for samples.
        gate: called before every claim; blocks outside training windows (`IdleScheduler.wait_until_open`).
        partition: many agents (docs/agents.md): agent id -> adapter; a batch holds one adapter's samples and
            staleness counts per adapter.
        window_open: many agents under mode=auto: whether a window is open now, without waiting ...
        always_adapters: ... and the adapters of `rl` agents, which step outside windows too.
    """

    def __init__(
        self,
        store_path: str,
        batch_size: int = 4,
        max_tokens: int | None = 65536,
        max_sample_tokens: int | None = None,
        wait_timeout_s: float | None = 5.0,
        max_staleness: int | None = None,
        max_age_s: float | None = None,
        max_backlog: int | None = None,
        backlog_policy: str = "drop_oldest",
        latest_skill_generation_only: bool = True,
        pad_id: int = 0,
        min_batch_size: int = 1,
        epochs_per_batch: int = 1,
        served: ServedVersions | None = None,
        should_stop: Callable[[], bool] | None = None,
        gate: Callable[[], bool] | None = None,
        partition: Callable[[str], str] | None = None,
        window_open: Callable[[], bool] | None = None,
        always_adapters: Collection[str] = (),
    ) -> None:
        super().__init__()
        if epochs_per_batch < 1:
            raise ValueError(f"data.epochs_per_batch must be >= 1, got {epochs_per_batch}")
        if not 1 <= min_batch_size <= batch_size:
            raise ValueError(f"data.min_batch_size ({min_batch_size}) must be in [1, data.batch_size ({batch_size})]")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"data.max_staleness must be null or >= 0, got {max_staleness}")
        if max_age_s is not None and not max_age_s > 0:
            raise ValueError(f"data.max_age_s must be null or > 0, got {max_age_s}")
        if backlog_policy not in BACKLOG_POLICIES:
            raise ValueError(f"data.backlog_policy must be one of {BACKLOG_POLICIES}, got {backlog_policy!r}")
        if max_backlog is not None and max_backlog < batch_size:
            raise ValueError(f"data.max_backlog ({max_backlog}) must be null or >= data.batch_size ({batch_size})")
        self.store_path = store_path
        self.batching = BatchSettings(batch_size, min_batch_size, max_tokens, max_sample_tokens, epochs_per_batch)
        self.bounds = SampleBounds(max_staleness, max_age_s, max_backlog, backlog_policy, latest_skill_generation_only)
        self.wait_timeout_s, self.pad_id = wait_timeout_s, pad_id
        # The adapter version the policy server serves: staleness counts against it. The publisher updates it after
        # each publish (only to what the server confirmed loading); on resume it starts at the checkpoint's step.
        self.served = served if served is not None else ServedVersions()
        self.gate = gate
        self.should_stop: Callable[[], bool] = should_stop or (lambda: False)
        self.partition = partition
        self.window_open, self.always_adapters = window_open, set(always_adapters)

    @property
    def adapter_version(self) -> int:
        """The version the policy server serves (the one adapter's)."""
        return self.served.default

    @property
    def adapter_versions(self) -> dict[str, int]:
        """Each adapter's served version (many agents)."""
        return self.served.by_adapter

    def _ungated(self) -> tuple[bool, set[str]] | None:
        if self.window_open is None or not self.always_adapters:
            return None
        return self.window_open(), self.always_adapters

    def _min_adapter_version(self) -> int | dict[str, int] | None:
        if self.bounds.max_staleness is None:
            return None
        if self.partition is not None:  # each adapter against its own served version
            return {a: v - self.bounds.max_staleness for a, v in self.adapter_versions.items()}
        return self.adapter_version - self.bounds.max_staleness

    def trainer_version(self) -> int:
        """The version the trainer is at (its global step: the adapter it would publish now); 0 before a trainer
        is attached. The lag behind it is measured (`train/adapter_version_lag`, `metaclaw status`) and bounded
        in the loss (`loss.max_ratio`), never by dropping samples: a trainer ahead of what is served (the gate
        serves every 4th candidate in the main job) would otherwise find every new sample stale and starve. Counted
        against the trainer, the main job dropped 67 of 166 samples as stale and its stream ended after 10 steps
        (issue 42's measurement, session 15); `max_staleness` counts against the served version."""
        trainer = getattr(self, "trainer", None)
        return int(trainer.global_step) if trainer is not None else 0

    def _served_version(self) -> int | dict[str, int]:
        """The adapter version served now (each adapter's, with many): recorded on every claimed sample."""
        return dict(self.adapter_versions) if self.partition is not None else self.adapter_version

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        # Called after a checkpoint is restored and before any rank claims (Lightning barriers right after).
        if trainer.is_global_zero:
            outcome = open_store(self.store_path).reconcile(trainer.global_step)
            log.info("Sample store %s at step %d: %s", self.store_path, trainer.global_step, outcome)
        # Resumed: the checkpoint's adapter is the newest published one (the publisher serves it again at start).
        self.served.default = max(self.served.default, trainer.global_step)
        dataset = StreamingSampleDataset(
            self.store_path,
            lambda: trainer.global_step,
            self.pad_id,
            self.batching.batch_size,
            self.batching.max_tokens,
            self.batching.max_sample_tokens,
            self.wait_timeout_s,
            trainer.global_rank,
            trainer.world_size,
            self._min_adapter_version,
            self.bounds.max_backlog if self.bounds.backlog_policy == "drop_oldest" else None,
            self.gate,
            self.bounds.latest_skill_generation_only,
            should_stop=lambda: self.should_stop(),
            partition=self.partition,
            ungated=self._ungated,
            min_batch_size=self.batching.min_batch_size,
            max_age_s=self.bounds.max_age_s,
            served_version=self._served_version,
            epochs=self.batching.epochs_per_batch,
        )
        self._dataset = dataset
        return DataLoader(dataset, batch_size=None, num_workers=0)

    def defer(self, sample_ids: list[int]) -> int:
        """A step took no gradient (all advantages zero): its samples go back to the store's `ready` samples, to be
        trained beside other rewards (`SampleStore.defer`, `claims.plan_claim`); returns how many. Only where
        samples are bounded by age (`data.max_age_s`: the live rollouts), so that a deferred sample that never finds
        a companion is settled `stale`; a fixed store (`rollout=store`, the data set) consumes such a step as before."""
        if self.bounds.max_age_s is None:
            return 0
        store = open_store(self.store_path)
        try:
            n = store.defer(sample_ids)
        finally:
            store.close()
        self.deferred = getattr(self, "deferred", 0) + n  # `train/deferred_samples`
        return n

    @property
    def end_reason(self) -> str | None:
        """Why the sample stream ended the run (`StreamingSampleDataset.end_reason`); None if it did not."""
        dataset = getattr(self, "_dataset", None)
        return dataset.end_reason if dataset is not None else None
