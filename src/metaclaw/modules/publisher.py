"""`AdapterPublisher`: after every N optimizer steps, write the adapter, checkpoint, consume samples, hot-swap.

Order matters for crash safety: (1) adapter directory (atomic rename), (2) Lightning checkpoint (atomic
rename), (3) mark the samples of the covered steps consumed, (4) ask the policy server to load the adapter.
A crash between (2) and (3) is repaired by `SampleStore.reconcile` at restart.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import lightning as L
import torch

from metaclaw.datamodules.store import SampleStore

log = logging.getLogger(__name__)


def adapter_name(step: int) -> str:
    return f"step-{step:06d}"


class AdapterPublisher(L.Callback):
    """Publishes the adapter and a resumable checkpoint every `every_n_steps` optimizer steps.

    Args:
        run_dir: the run's output directory (`${hydra:runtime.output_dir}`).
        store_path: the sample store whose claims a checkpoint settles.
        every_n_steps: publish cadence.
        server_url: policy server base URL (`http://127.0.0.1:8000`) to hot-load each adapter into; None: none.
        lora_name: the name the adapter is served under (the OpenAI `model` field).
        api_key: bearer key for the server.
        timeout_s: how long a load request may take.
        keep_last: keep only the newest this many adapter directories (None keeps all).
    """

    def __init__(
        self,
        run_dir: str,
        store_path: str,
        every_n_steps: int = 1,
        server_url: str | None = None,
        lora_name: str = "policy",
        api_key: str | None = None,
        timeout_s: float = 30.0,
        keep_last: int | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"publish.every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"publish.keep_last must be >= 1 or null, got {keep_last}")
        self.run_dir, self.store_path, self.every_n_steps = Path(run_dir), store_path, every_n_steps
        self.server_url, self.lora_name, self.api_key, self.timeout_s = server_url, lora_name, api_key, timeout_s
        self.keep_last = keep_last
        self.published: list[Path] = []

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "last.ckpt"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.publish(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        last = self.published[-1].name if self.published else None
        if trainer.global_step > 0 and last != adapter_name(trainer.global_step):
            self.publish(trainer, pl_module)
        if trainer.is_global_zero:  # the prefetched next batch was never trained on: hand it back
            SampleStore(self.store_path).reconcile(trainer.global_step)

    def publish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        target = self.run_dir / "adapters" / adapter_name(step)
        if trainer.is_global_zero:
            pl_module.policy.save_adapter(target)
        fingerprints = self._rank_fingerprints(trainer, pl_module)
        tmp = self.checkpoint_path.with_suffix(".ckpt.tmp")
        trainer.save_checkpoint(tmp, weights_only=False)  # collective: every rank calls it, rank 0 writes
        if trainer.is_global_zero:
            os.replace(tmp, self.checkpoint_path)
            SampleStore(self.store_path).mark_consumed(step)
            (self.run_dir / "adapters" / "latest.json").write_text(
                json.dumps(
                    {"version": step, "path": str(target), "name": self.lora_name, "rank_fingerprints": fingerprints}
                )
            )
            log.info("Published adapter v%d at %s", step, target)
            self._hot_load(target)
            self._prune()
        self.published.append(target)
        datamodule = trainer.datamodule
        if datamodule is not None and hasattr(datamodule, "adapter_version"):
            datamodule.adapter_version = step
        trainer.strategy.barrier("adapter_publisher")

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for old in sorted((self.run_dir / "adapters").glob("step-*"))[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _rank_fingerprints(trainer: L.Trainer, pl_module: L.LightningModule) -> list[list[float]]:
        """(sum, sum of squares) of the adapter on every rank: DDP replicas must be identical."""
        weights = [p.detach().double() for p in pl_module.parameters() if p.requires_grad]
        mine = torch.stack([sum(w.sum() for w in weights), sum((w * w).sum() for w in weights)])
        gathered = trainer.strategy.all_gather(mine.to(pl_module.device))
        return gathered.reshape(-1, 2).tolist()

    def _hot_load(self, path: Path) -> None:
        if not self.server_url:
            return
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"lora_name": self.lora_name, "lora_path": str(path.resolve())}
        try:
            r = httpx.post(
                f"{self.server_url.rstrip('/')}/v1/load_lora_adapter",
                json=body,
                headers=headers,
                timeout=self.timeout_s,
            )
            r.raise_for_status()
        except httpx.HTTPError as e:  # serving keeps the previous adapter; training goes on
            log.warning("Policy server did not load %s: %s", path, e)
