"""`AdapterPublisher`: after every N optimizer steps, write the adapter, checkpoint, consume samples, hot-swap.

The callback keeps the order and the ranks in step; each job is its own piece: `AdapterWriter` (the adapter and
checkpoint files), `SampleConsumer` (the store's claims), `HotLoader` (the policy server). Order matters for
crash safety: (1) adapter directory (atomic rename), (2) Lightning checkpoint (atomic rename), (3) mark the
samples of the covered steps consumed, (4) ask the policy server to load the adapter. A crash between (2) and
(3) is repaired by `SampleStore.reconcile` at restart; the temp dirs and files a kill mid-write leaves
(`adapters/.step-*`, `checkpoints/*.tmp`) are removed when the next run starts.

Checkpoint cadence (`checkpoint_every_n_steps` k): steps (2) and (3) run at a publish only once k steps have
passed since the last checkpoint, and always when training ends; the adapter is written and served at every
publish. Samples of the steps after the last checkpoint stay `claimed`: a crash hands them back (`reconcile`
at restart), they are trained again from the checkpoint's weights, so none is lost and none is trained twice in
the run that survives; at most k - 1 steps of work are redone. On resume, an adapter published after the
checkpoint (the lost steps' work) is not served again: the checkpoint's own adapter is.


Staleness counts against the version actually served: the `ServedVersions` this publisher shares with the
datamodule hold the newest adapter the policy server confirmed loading (the published step when there is no
server), restored on resume by loading the checkpoint's adapter again. A hot-load failure leaves it at what is
still served, so samples the old adapter keeps producing are not stale; `max_hot_load_failures` failures in a
row stop the run (`HotLoadError`).

Many agents (docs/agents.md): with `agents` set (`AgentPublishing`), a publish writes and serves each adapter
trained since the last one in its own directory, under its own name; the one checkpoint holds them all.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from metaclaw import profiling
from metaclaw.agents import AgentProfiles
from metaclaw.devices import full_params
from metaclaw.modules.adapter_writer import AdapterWriter, clean_leftovers
from metaclaw.modules.agent_publish import AgentPublishing, rank_fingerprints
from metaclaw.modules.consumer import SampleConsumer
from metaclaw.modules.hot_load import HotLoader, HotLoadError
from metaclaw.modules.rewind import Rewind
from metaclaw.store import ServedVersions
from metaclaw.wire.client import Endpoint

__all__ = ["AdapterPublisher", "HotLoadError", "Release"]

log = logging.getLogger(__name__)


class Release(Protocol):
    """Decides when a published adapter is served (`metaclaw.evaluation.LiveEvaluator`: gate, evaluation)."""

    def submit(self, step: int, path: Path, hot_load: Callable[[Path], Any], agent: str = "default") -> None: ...

    def in_use(self) -> set[Path]:
        """Adapters `publish.keep_last` must keep on disk: candidates not decided on yet, a rollback's target."""
        ...


class AdapterPublisher(L.Callback):
    """Publishes the adapter and a resumable checkpoint every `every_n_steps` optimizer steps.

    Args:
        run_dir: the run's output directory (`${hydra:runtime.output_dir}`).
        store_path: the sample store whose claims a checkpoint settles.
        every_n_steps: publish cadence.
        server_url: policy server base URL (`http://127.0.0.1:8000`) to hot-load each adapter into; None: the
            live loop connects its server (`connect`), or none.
        lora_name: the name the adapter is served under (the OpenAI `model` field).
        api_key: bearer key for the server.
        timeout_s: how long a load request may take.
        keep_last: keep only the newest this many adapter directories (None keeps all; by default 20).
        max_hot_load_failures: stop the run after this many failed hot-loads in a row (None: only warn).
        hot_load_async: hot-load on a background thread (the default): the step never waits for the server; the version
            served and a failure are learnt at the next publish (`metaclaw.modules.hot_load`).
        checkpoint_every_n_steps: write the resumable checkpoint (and consume its samples) at a publish once this
            many steps passed since the last one (4 by default: a crash redoes at most 3 steps), and at the end of
            training (see the module docstring).

        served: the adapter versions served, shared with the datamodule that claims against them (staleness);
            this publisher updates them. A fresh one when None.
        release: None (every adapter is served at once), or a `Release` that decides when `hot_load(path)` runs:
            at once (evaluation only) or after the candidate passed the gate (`publish.gate`, built by
            `metaclaw.loop.eval_wiring.build_evaluator`).
        agents: the run's agents, when several have adapters of their own (`AgentPublishing`, docs/agents.md).
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
        keep_last: int | None = 20,
        max_hot_load_failures: int | None = 3,
        hot_load_async: bool = True,
        checkpoint_every_n_steps: int = 4,
        served: ServedVersions | None = None,
        release: Release | None = None,
        agents: AgentProfiles | None = None,
        rewind: Rewind | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"publish.every_n_steps must be >= 1, got {every_n_steps}")
        if checkpoint_every_n_steps < 1:
            raise ValueError(f"publish.checkpoint_every_n_steps must be >= 1, got {checkpoint_every_n_steps}")
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.checkpointed_step = 0  # the step of the newest checkpoint on disk (its samples are consumed)
        self.every_n_steps, self.lora_name = every_n_steps, lora_name
        self.files = AdapterWriter(run_dir, keep_last)
        self.samples = SampleConsumer(store_path)
        self.server = HotLoader(server_url, lora_name, api_key, timeout_s, max_hot_load_failures, hot_load_async)
        self.run_dir = self.files.run_dir
        self.published: list[Path] = []
        self.cleaned: list[Path] = []
        self.served = served if served is not None else ServedVersions()
        self.release = release
        self.rewind = rewind  # forget --rollback: nothing published from older weights is served
        if rewind is not None:
            rewind.quiesce.append(self.server.settle)
        self.agents = AgentPublishing(agents, self) if agents is not None and agents.many else None
        self._last_step = -1

    @property
    def checkpoint_path(self) -> Path:
        return self.files.checkpoint_path

    @property
    def served_version(self) -> int:
        return self.server.served_version

    @property
    def stats(self) -> dict[str, int]:
        return self.server.stats

    def connect(self, server: Endpoint, restarting: Callable[[], bool] | None = None) -> None:
        """Hot-load into the live loop's policy server (its address and key, resolved once by the loop)."""
        self.server.connect(server, restarting)
        if self.agents is not None:
            self.agents.connect(server, restarting)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.cleaned = clean_leftovers(self.run_dir)
            if self.cleaned:
                log.warning("Removed leftovers of an interrupted write: %s", [str(p) for p in self.cleaned])

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """On resume, serve again what was served (`latest.json`: a rollback's pin, or the last adapter the gate let
        through), else the checkpoint's adapter, so staleness starts from the version actually served."""
        step = self._last_step = self.checkpointed_step = trainer.global_step  # published before it was written
        target = self.files.adapter_dir(step)
        served = self.files.read_latest() or {}  # the served pointer: a refused candidate is never in it
        # published after the checkpoint (that work is redone; a rollback's pin is the user's choice and stays)
        ahead = int(served.get("version") or 0) > step and not served.get("rolled_back")
        if ahead and trainer.is_global_zero and self.agents is None:
            log.warning("Served adapter v%s is newer than the checkpoint (step %d): serving the checkpoint's",
                        served.get("version"), step)  # fmt: skip
            if step > 0 and target.is_dir():
                self.files.write_latest(step, target, self.lora_name, None)
            else:  # no checkpoint yet: the base model is what the surviving run has trained
                (self.files.adapters / "latest.json").unlink(missing_ok=True)
        elif self.agents is None and step > 0 and Path(str(served.get("path"))).is_dir() and not ahead:
            target, step = Path(served["path"]), int(served.get("version") or 0)
        if step > 0 and trainer.is_global_zero and self.agents is not None:
            self.agents.serve_again(step)  # every adapter's newest published dir the checkpoint covers
        elif step > 0 and trainer.is_global_zero and target.exists():
            self.server.serve(target, step)
            self.server.settle()  # staleness starts from the version actually served
        self._sync_served(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.publish(trainer, pl_module)
        pl_module.log("train/publish_failures", float(self.stats["hot_load_failures"]), prog_bar=True, batch_size=1)
        pl_module.log("train/adapter_version_served", float(self.served_version), batch_size=1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0 and self._last_step != trainer.global_step:
            self.publish(trainer, pl_module, checkpoint=True)
        elif self.checkpointed_step != trainer.global_step:  # published, not yet checkpointed: nothing is redone
            self._checkpoint(trainer, trainer.global_step)
        self.server.settle()  # the final adapter is served before the run reports on it
        self._sync_served(trainer)
        if trainer.is_global_zero:  # the prefetched next batch was never trained on: hand it back
            self.samples.settle(trainer.global_step)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Lightning's SIGTERM stop is raised between two steps (after this one's publish): checkpoint what was
        trained, so a graceful stop redoes nothing. Any other exception may have cut a step short: nothing is
        written, and the samples of the steps after the last checkpoint go back to the queue."""
        if isinstance(exception, SIGTERMException) and trainer.global_step > self.checkpointed_step:
            if self._last_step != trainer.global_step:
                self.publish(trainer, pl_module, checkpoint=True)
            else:
                self._checkpoint(trainer, trainer.global_step)

    def publish(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: bool = False) -> None:
        """Write and serve the adapter; checkpoint when `checkpoint` or `checkpoint_every_n_steps` says so."""
        if self.server.asynchronous:  # the previous hot-load's outcome (it had the whole step to finish)
            with profiling.phase("hot_load_wait"):
                self.server.settle()
            self._sync_served(trainer)  # raises HotLoadError before anything more is published
        due = trainer.global_step - self.checkpointed_step >= self.checkpoint_every_n_steps
        if self.rewind is not None and self.rewind.checkpoint_due:  # the checkpoint holds weights left behind
            due, self.rewind.checkpoint_due = True, False
        with profiling.phase("publish"):
            self._publish(trainer, pl_module, checkpoint or due)

    def _checkpoint(self, trainer: L.Trainer, step: int) -> None:
        """The resumable checkpoint of `step` (atomic), then the samples of the steps it covers are consumed."""
        with profiling.phase("checkpoint"):
            trainer.save_checkpoint(self.files.checkpoint_tmp, weights_only=False)  # collective: rank 0 writes
            if trainer.is_global_zero:
                self.files.commit_checkpoint()
        if trainer.is_global_zero:
            self.samples.consume_through(step)
            if self.rewind is not None:  # the checkpoint holds the rewound weights: a restart keeps them
                self.rewind.settle()
        self.checkpointed_step = step

    def _publish(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: bool = True) -> None:
        step = self._last_step = trainer.global_step
        if self.agents is not None:  # one checkpoint of every adapter at each publish (docs/agents.md)
            self.published += self.agents.publish(trainer, pl_module)
            self.checkpointed_step = step
            self._sync_served(trainer)
            trainer.strategy.barrier("adapter_publisher")
            return
        target = self.files.adapter_dir(step)
        with full_params(trainer):  # FSDP: gather the shards (collective); a no-op otherwise
            if trainer.is_global_zero:
                pl_module.policy.save_adapter(target, version=step)
        fingerprints = self._rank_fingerprints(trainer, pl_module)
        if checkpoint:
            self._checkpoint(trainer, step)
        if trainer.is_global_zero:
            log.info("Published adapter v%d at %s%s", step, target, "" if checkpoint else " (no checkpoint yet)")
            # latest.json is the served pointer (what a restart serves): written when the adapter is served, so a
            # candidate the gate refuses or holds (or a step that finished under a rollback) never becomes it
            serve = self.guarded(partial(self._serve, step=step, fingerprints=fingerprints))
            if self.release is not None:  # it decides when the adapter is served (gate) and measures it
                self.release.submit(step, target, serve)
            else:
                serve(target)
            self.files.prune(self.release.in_use() if self.release is not None else ())
        self.published.append(target)
        self._sync_served(trainer)
        trainer.strategy.barrier("adapter_publisher")

    def guarded(self, serve: Callable[[Path], Any]) -> Callable[[Path], Any]:
        """`serve(path)` for weights written now: refused, and the folder removed, if a rewind (`forget
        --rollback`) comes before it runs (the gate may run it later, on its own thread)."""
        if self.rewind is None:
            return serve
        rewind, generation = self.rewind, self.rewind.weights_generation

        def guarded_serve(path: Path) -> None:
            if not rewind.serve_if_current(generation, partial(serve, path)):
                log.warning("Adapter %s holds weights from before a rewind (forget --rollback): not served, removed",
                            path)  # fmt: skip
                shutil.rmtree(path, ignore_errors=True)

        return guarded_serve

    def _serve(self, path: Path, step: int, fingerprints: Any = None) -> None:
        """Serve `path` (hot-load it into the policy server when there is one) and point `latest.json` at it."""
        self.files.write_latest(step, path, self.lora_name, fingerprints)
        with profiling.phase("hot_load_wait"):
            self.server.serve(path, step)

    def _sync_served(self, trainer: L.Trainer) -> None:
        """Every rank learns rank 0's served version (and a hot-load failure that must stop the run)."""
        fatal = self.server.fatal() or (self.agents.fatal() if self.agents is not None else None)
        versions = self.agents.served_versions() if self.agents is not None else {}
        served, versions, fatal = trainer.strategy.broadcast((self.server.served_version, versions, fatal), src=0)
        self.server.served_version = served
        if self.agents is not None:  # staleness per adapter
            self.agents.set_served_versions(versions)
        self.served.update(served, versions)  # what the datamodule claims against
        if fatal:
            raise HotLoadError(fatal)

    @staticmethod
    def _rank_fingerprints(trainer: L.Trainer, pl_module: L.LightningModule) -> list[list[float]]:
        """(sum, sum of squares) of the adapter on every rank: DDP replicas must be identical."""
        return rank_fingerprints(trainer, [p for p in pl_module.parameters() if p.requires_grad], pl_module.device)
