"""`AdapterPublisher`: after every N optimizer steps, write the adapter, checkpoint, consume samples, hot-swap.

Order matters for crash safety: (1) adapter directory (atomic rename), (2) Lightning checkpoint (atomic
rename), (3) mark the samples of the covered steps consumed, (4) ask the policy server to load the adapter.
A crash between (2) and (3) is repaired by `SampleStore.reconcile` at restart; the temp dirs and files a kill
mid-write leaves (`adapters/.step-*`, `checkpoints/*.tmp`) are removed when the next run starts.

Staleness counts against the version actually served: the datamodule's `adapter_version` is the newest adapter
the policy server confirmed loading (the published step when there is no server), restored on resume by loading
the checkpoint's adapter again. A hot-load failure leaves it at what is still served, so samples the old adapter
keeps producing are not stale; `max_hot_load_failures` failures in a row stop the run (`HotLoadError`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import lightning as L
import torch

from metaclaw.devices import full_params
from metaclaw.store import open_store
from metaclaw.wire import bearer_headers

log = logging.getLogger(__name__)


def adapter_name(step: int) -> str:
    return f"step-{step:06d}"


class HotLoadError(RuntimeError):
    """The policy server refused or missed every hot-load for too long: nothing new is being served."""


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove what a kill mid-write leaves in `run_dir` (relative paths of what was removed, sorted).

    `write_dir_atomically` fills `adapters/.step-NNNNNN-xxxx` and parks the replaced copy in
    `adapters/.step-NNNNNN.old`; the checkpoint is written to `checkpoints/last.ckpt.tmp` first.
    """
    removed = []
    for path in [*(run_dir / "adapters").glob(".step-*"), *(run_dir / "checkpoints").glob("*.tmp")]:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.relative_to(run_dir))
    return sorted(removed)


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
        max_hot_load_failures: stop the run after this many failed hot-loads in a row (None: only warn).
        gate: config of the publish gate (`enabled`, `margin`), read by `metaclaw.loop.eval_wiring`; the
            object that evaluates and gates is attached as `release` (see below).

    `release`: None, or an object with `submit(step, path, hot_load)` (`metaclaw.evaluation.LiveEvaluator`)
    that decides when `hot_load(path)` runs: at once (evaluation only) or after the candidate passed the gate.
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
        max_hot_load_failures: int | None = 3,
        gate: Any = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"publish.every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"publish.keep_last must be >= 1 or null, got {keep_last}")
        self.run_dir, self.store_path, self.every_n_steps = Path(run_dir), store_path, every_n_steps
        self.server_url, self.lora_name, self.api_key, self.timeout_s = server_url, lora_name, api_key, timeout_s
        if max_hot_load_failures is not None and max_hot_load_failures < 1:
            raise ValueError(f"publish.max_hot_load_failures must be >= 1 or null, got {max_hot_load_failures}")
        self.keep_last, self.max_hot_load_failures = keep_last, max_hot_load_failures
        self.published: list[Path] = []
        self.cleaned: list[Path] = []
        self.served_version = 0  # the adapter version the policy server confirmed (published, without a server)
        self.stats = {"hot_load_failures": 0, "hot_load_failures_in_a_row": 0}
        self.server_restarting: Callable[[], bool] = lambda: False  # set by the live loop (loop/live.py)
        self._last_hot_load_error = ""
        self.gate_config = gate
        self.release: Any = None

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "last.ckpt"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.cleaned = clean_leftovers(self.run_dir)
            if self.cleaned:
                log.warning("Removed leftovers of an interrupted write: %s", [str(p) for p in self.cleaned])

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """On resume, serve the checkpoint's adapter again, so staleness starts from the resumed version."""
        step = trainer.global_step
        target = self.run_dir / "adapters" / adapter_name(step)
        if step > 0 and trainer.is_global_zero and target.exists():
            self.served_version = self._hot_load(target, step) if self.server_url else step
        self._sync_served(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.publish(trainer, pl_module)
        pl_module.log("train/publish_failures", float(self.stats["hot_load_failures"]), prog_bar=True, batch_size=1)
        pl_module.log("train/adapter_version_served", float(self.served_version), batch_size=1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        last = self.published[-1].name if self.published else None
        if trainer.global_step > 0 and last != adapter_name(trainer.global_step):
            self.publish(trainer, pl_module)
        if trainer.is_global_zero:  # the prefetched next batch was never trained on: hand it back
            open_store(self.store_path).reconcile(trainer.global_step)

    def publish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        target = self.run_dir / "adapters" / adapter_name(step)
        with full_params(trainer):  # FSDP: gather the shards (collective); a no-op otherwise
            if trainer.is_global_zero:
                pl_module.policy.save_adapter(target)
        fingerprints = self._rank_fingerprints(trainer, pl_module)
        tmp = self.checkpoint_path.with_suffix(".ckpt.tmp")
        trainer.save_checkpoint(tmp, weights_only=False)  # collective: every rank calls it, rank 0 writes
        if trainer.is_global_zero:
            os.replace(tmp, self.checkpoint_path)
            open_store(self.store_path).mark_consumed(step)
            (self.run_dir / "adapters" / "latest.json").write_text(
                json.dumps(
                    {"version": step, "path": str(target), "name": self.lora_name, "rank_fingerprints": fingerprints}
                )
            )
            log.info("Published adapter v%d at %s", step, target)
            if self.release is not None:  # it decides when the adapter is served (gate) and measures it
                self.release.submit(step, target, partial(self._serve, step=step))
            else:
                self._serve(target, step)
            self._prune()
        self.published.append(target)
        self._sync_served(trainer)
        trainer.strategy.barrier("adapter_publisher")

    def _sync_served(self, trainer: L.Trainer) -> None:
        """Every rank learns rank 0's served version (and a hot-load failure that must stop the run)."""
        fatal = None
        limit = self.max_hot_load_failures
        if limit is not None and self.stats["hot_load_failures_in_a_row"] >= limit:
            fatal = (
                f"The policy server at {self.server_url} failed to load {limit} adapters in a row "
                f"(last: {self._last_hot_load_error}); it still serves v{self.served_version}, so training "
                "would go on without its updates reaching the agent. Check the server (server/server.log) or "
                "raise publish.max_hot_load_failures."
            )
        self.served_version, fatal = trainer.strategy.broadcast((self.served_version, fatal), src=0)
        datamodule = trainer.datamodule
        if datamodule is not None and hasattr(datamodule, "adapter_version"):
            datamodule.adapter_version = self.served_version
        if fatal:
            raise HotLoadError(fatal)

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

    def _serve(self, path: Path, step: int) -> None:
        """Serve `path` (hot-load it into the policy server when there is one)."""
        self.served_version = self._hot_load(path, step) if self.server_url else step

    def _hot_load(self, path: Path, step: int) -> int:
        """Ask the server to load `path`; returns the version it now serves (unchanged when the load failed)."""
        headers = bearer_headers(self.api_key)
        body = {"lora_name": self.lora_name, "lora_path": str(path.resolve())}
        try:
            r = httpx.post(
                f"{self.server_url.rstrip('/')}/v1/load_lora_adapter",
                json=body,
                headers=headers,
                timeout=self.timeout_s,
            )
            r.raise_for_status()
            reply = r.json()
            version = reply.get("adapter_version", step) if isinstance(reply, dict) else step
        except (httpx.HTTPError, ValueError) as e:  # serving keeps the previous adapter; training goes on
            if self.server_restarting():  # dead or restarting: the watchdog restarts it (and reloads the newest
                # adapter) or stops the run naming what died; these are not hot-load failures
                log.warning("Policy server is down: %s will be loaded if it comes back (%s)", path.name, e)
                return self.served_version
            self.stats["hot_load_failures"] += 1
            self.stats["hot_load_failures_in_a_row"] += 1
            self._last_hot_load_error = f"{path.name}: {e}"[:300]
            log.warning(
                "Policy server did not load %s (%d in a row): %s", path, self.stats["hot_load_failures_in_a_row"], e
            )
            return self.served_version
        self.stats["hot_load_failures_in_a_row"] = 0
        return int(version) if isinstance(version, int) else step
