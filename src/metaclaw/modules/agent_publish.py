"""Publishing many agents' adapters (docs/agents.md): each adapter trained since the last publish is written to
its own directory and hot-loaded under its own name; one checkpoint holds them all.

`AdapterPublisher` keeps the order and the ranks in step and hands a publish to `AgentPublishing.publish` when
agents have adapters of their own. The default adapter keeps the publisher's own `AdapterWriter` and
`HotLoader` (`adapters/step-NNNNNN/`, served as `policy`); each agent's adapter gets a writer on
`adapters/agents/<id>/` and a loader for `<lora_name>:<id>`. Every adapter goes through the live evaluator and gate
(`release.submit(..., agent=<id>)`), which evaluates it when that agent has an evaluator and serves it at once
otherwise. An adapter that took no step since the last publish is not written again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from metaclaw.agents import DEFAULT_ADAPTER, AgentProfiles
from metaclaw.modules.adapter_writer import AdapterWriter
from metaclaw.modules.hot_load import HotLoader
from metaclaw.wire.client import Endpoint

log = logging.getLogger(__name__)


def rank_fingerprints(trainer: L.Trainer, params: list[nn.Parameter], device: torch.device) -> list[list[float]]:
    """(sum, sum of squares) of `params` on every rank (collective): DDP replicas must be identical."""
    weights = [p.detach().double() for p in params]
    mine = torch.stack([sum(w.sum() for w in weights), sum((w * w).sum() for w in weights)])
    return trainer.strategy.all_gather(mine.to(device)).reshape(-1, 2).tolist()


class AgentPublishing:
    """The per-adapter files and hot-loads of a run whose agents have adapters of their own.

    Args:
        profiles: the run's agents.
        publisher: the `AdapterPublisher` whose writer and loader serve the default adapter (and whose
            settings every agent's writer and loader copy).
    """

    def __init__(self, profiles: AgentProfiles, publisher: Any) -> None:
        self.profiles, self.publisher = profiles, publisher
        files, server = publisher.files, publisher.server
        self.parts: dict[str, tuple[AdapterWriter, HotLoader]] = {DEFAULT_ADAPTER: (files, server)}
        for adapter in profiles.own_adapters:
            name = profiles.by_adapter(adapter).lora_name
            writer = AdapterWriter(files.run_dir, files.keep_last, adapter)
            loader = HotLoader(server.server_url, name, server.api_key, server.timeout_s, server.max_failures)
            self.parts[adapter] = (writer, loader)

    def connect(self, server: Endpoint, restarting: Callable[[], bool] | None = None) -> None:
        for adapter, (_, loader) in self.parts.items():
            if adapter != DEFAULT_ADAPTER:
                loader.connect(server, restarting)

    def served_versions(self) -> dict[str, int]:
        """The version each adapter is served at (staleness counts per adapter)."""
        return {adapter: loader.served_version for adapter, (_, loader) in self.parts.items()}

    def set_served_versions(self, versions: dict[str, int]) -> None:
        for adapter, version in versions.items():
            self.parts[adapter][1].served_version = version

    def fatal(self) -> str | None:
        """The first agent loader that failed too often in a row (the default one is the publisher's)."""
        return next((why for a, (_, loader) in self.parts.items() if a != DEFAULT_ADAPTER
                     for why in [loader.fatal()] if why), None)  # fmt: skip

    def publish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[Path]:
        """Write and serve each adapter trained since the last publish, after one checkpoint of them all."""
        step = trainer.global_step
        take = getattr(pl_module, "take_stepped", None)
        stepped = sorted(take() if take is not None else ())
        targets = {a: self.parts[a][0].adapter_dir(step) for a in stepped}
        policy = pl_module.policy  # every rank the same adapters (DDP: `stepped` follows the shared batches)
        fingerprints = {a: rank_fingerprints(trainer, policy.adapter_parameters(a), pl_module.device) for a in stepped}
        if trainer.is_global_zero:
            for adapter, target in targets.items():
                pl_module.policy.save_adapter(target, adapter, version=step)
        files = self.publisher.files
        trainer.save_checkpoint(files.checkpoint_tmp, weights_only=False)  # collective: rank 0 writes
        if trainer.is_global_zero:
            files.commit_checkpoint()
            self.publisher.samples.consume_through(step)
            if self.publisher.rewind is not None:  # the checkpoint holds the rewound weights
                self.publisher.rewind.settle()
            for adapter, target in targets.items():
                writer, loader = self.parts[adapter]
                log.info("Published adapter %s v%d at %s", loader.lora_name, step, target)
                serve = self.publisher.guarded(partial(_serve_and_point, writer, loader, step=step,
                                                       fingerprints=fingerprints[adapter]))  # fmt: skip
                release = self.publisher.release
                if release is not None:  # the live evaluator and gate: per agent (docs/agents.md)
                    agent = self.profiles.by_adapter(adapter).name
                    release.submit(step, target, serve, agent=agent)
                else:
                    serve(target)
                writer.prune(release.in_use() if release is not None else ())
        return list(targets.values())

    def serve_again(self, step: int) -> None:
        """On resume: serve each adapter's newest directory the checkpoint covers (its weights are in it)."""
        for writer, loader in self.parts.values():
            covered = writer.folder.newest_at_or_before(step)
            if covered is not None:
                version, path = covered
                loader.serve(path, version)


def _serve_and_point(writer: AdapterWriter, loader: HotLoader, path: Path, step: int, fingerprints: Any) -> None:
    """Serve an agent's adapter and point its `latest.json` (the served pointer a restart reloads) at it."""
    writer.write_latest(step, path, loader.lora_name, fingerprints)
    loader.serve(path, step)
