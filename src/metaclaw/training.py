"""`train(cfg)`: build policy, data, module, callbacks, loggers and trainer from the config, then fit."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from metaclaw.agents import AgentProfiles, size_max_loras
from metaclaw.config import trainer_device_kwargs, validate_train_config
from metaclaw.control.api import mount_plane
from metaclaw.control.plane import build_control
from metaclaw.datamodules.seed import seed_store
from metaclaw.devices import resolve_devices, torch_threads
from metaclaw.evaluation.report import write_report
from metaclaw.export.apply import ApplyImport
from metaclaw.loop.eval_wiring import build_evaluator, build_watch, gate_measures
from metaclaw.loop.live import Live, live_loop, run_skills_only
from metaclaw.loop.wiring import build_privacy
from metaclaw.memory_plan import check_memory
from metaclaw.modules.anchor import ServedAnchor
from metaclaw.modules.online_rl import OnlineRLModule
from metaclaw.modules.progress import LoopProgressBar
from metaclaw.modules.rewind import Rewind, RewindCallback
from metaclaw.runfiles import protect_run
from metaclaw.stopping import GracefulStop, RunAbandoned, RunFailed, StopController
from metaclaw.store import SampleStore, ServedVersions, open_store
from metaclaw.tracking import AdapterArtifacts, build_loggers, is_wandb, log_hyperparams

log = logging.getLogger(__name__)


def build_callbacks(cfg: DictConfig) -> list:
    """The extra Lightning callbacks named under `callbacks:` (null entries are skipped)."""
    return [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]


def build_scheduler(cfg: DictConfig, agents: AgentProfiles, stop: StopController) -> Any:
    """The run's `IdleScheduler`: `mode.scheduler` (mode=auto), or, in a mode=rl run with `auto` agents, the
    `scheduler` node, whose windows then gate only those agents' adapters (docs/agents.md). A stop request ends
    its wait for a window; the adapters of `rl` agents step outside windows (`ungated`)."""
    node = cfg.mode.get("scheduler")
    if not node and agents.needs_scheduler(cfg.mode.name):
        node = cfg.get("scheduler")
    if not node:
        return None
    ungated = agents.ungated_adapters(cfg.mode.name)
    return instantiate(node, _partial_=True)(should_stop=stop.should_stop, ungated=ungated)


def build_datamodule(cfg: DictConfig, pad_id: int, agents: AgentProfiles, scheduler: Any, stop: StopController,
                     served: ServedVersions) -> Any:  # fmt: skip
    """`data`, with what it depends on: the served versions it claims against, the stop request, the scheduler's
    gate, and, with many adapters, which adapter each agent's samples train (a batch holds one adapter's)."""
    ungated = scheduler.ungated if scheduler is not None else frozenset()
    return instantiate(cfg.data, _partial_=True)(
        pad_id=pad_id,
        served=served,
        should_stop=stop.should_stop,
        gate=scheduler.wait_until_open if scheduler is not None else None,
        partition=agents.adapter_of if agents.many or ungated else None,
        window_open=(lambda: scheduler.refresh().open) if ungated else None,  # `rl` agents step outside windows
        always_adapters=ungated,
    )


def build_publisher(cfg: DictConfig, served: ServedVersions, release: Any, agents: AgentProfiles,
                    rewind: Rewind | None = None) -> Any:  # fmt: skip
    """`publish` (its `gate` settings are the release's: `metaclaw.loop.eval_wiring.build_evaluator`; `rewind`: the
    control plane's `forget --rollback` requests, `metaclaw.modules.rewind`)."""
    node = OmegaConf.to_container(cfg.publish, resolve=True)
    assert isinstance(node, dict), "publish must be a mapping"
    settings = {k: v for k, v in node.items() if k != "gate"}
    return instantiate(settings, _partial_=True)(served=served, release=release, agents=agents, rewind=rewind)


def bind_rebase(evaluator: Any, rewind: Rewind, agents: AgentProfiles) -> None:
    """The gate's rebase (`publish.gate.rebase_after`) asks the trainer, through `rewind`, to go back to the served
    adapter of the agent whose candidates it refused (without forget's ban on serving older weights)."""
    if evaluator is not None:
        evaluator.gatekeeper.rebase.to = lambda agent, path: rewind.request(agents.adapter_of(agent), path, False)


def build_trainer(cfg: DictConfig, agents: AgentProfiles, adapters: Path, callbacks: list) -> L.Trainer:
    """Lightning's `Trainer` from `trainer` and `devices`, with the run's loggers (one or several, the resolved
    config logged as hyperparameters, keys redacted: metaclaw.tracking); `callbacks` (None entries skipped) run
    before the progress bar, the W&B adapter artifacts of `adapters` (with a W&B logger) and `callbacks:`."""
    bar = [LoopProgressBar()] if cfg.trainer.get("enable_progress_bar", True) else []
    loggers = build_loggers(cfg)
    every = (cfg.get("artifacts") or {}).get("every_n_steps")  # W&B: the served adapters, and every N-th step's
    artifacts = [AdapterArtifacts(adapters, every_n_steps=every)] if any(is_wandb(lg) for lg in loggers) else []
    trainer = L.Trainer(
        **cfg.trainer,
        **trainer_device_kwargs(cfg.devices, several_adapters=agents.many),  # DDP: docs/agents.md
        default_root_dir=str(cfg.run_dir),
        logger=loggers,
        callbacks=[*(c for c in callbacks if c is not None), *bar, *artifacts, *build_callbacks(cfg)],
    )
    log_hyperparams(trainer.loggers, cfg)
    return trainer


def build_policy(cfg: DictConfig, agents: AgentProfiles) -> tuple[Any, Any, Any]:
    """`(spec, tokenizer, policy)`: the model's spec, its tokenizer, and the PEFT policy (one adapter per agent
    with an adapter of its own, on one base: docs/agents.md)."""
    spec = instantiate(cfg.model)
    extra = {"adapters": agents.own_adapters} if agents.many else {}
    policy = instantiate(cfg.policy, model=spec.load_model(), **extra)
    size_max_loras(cfg, agents)
    trainable, total = policy.num_parameters()
    log.info("Policy %s: %.2fM trainable / %.2fM parameters", spec.name, trainable / 1e6, total / 1e6)
    return spec, spec.load_tokenizer(), policy


def prepare_store(cfg: DictConfig, tokenizer, policy) -> SampleStore:
    """Open the run's store; fill it from `rollout.seed_file` when it is empty (first run, not a resume).

    With `data.backlog_policy=pause_capture` the proxy's writes through this store pause at `data.max_backlog`.
    """
    pause = cfg.data.get("backlog_policy") == "pause_capture"
    privacy = build_privacy(cfg)  # secrets and personal data are screened before any write (docs/privacy.md)
    store = open_store(cfg.store_path, capture_limit=cfg.data.get("max_backlog") if pause else None, screen=privacy)
    seed_file = cfg.rollout.get("seed_file")
    if seed_file and store.count() == 0:
        seed_store(store, seed_file, tokenizer, policy, cfg.method.needs_reward, cfg.method.needs_teacher)
    return store


def served_anchor(cfg: DictConfig) -> ServedAnchor | None:
    """`kl.reference=served` (the default) with a KL term: the callback that keeps its reference on the served
    adapter (`modules.anchor`); None otherwise. Where no gate measures candidates (`publish.gate.enabled=false`, or
    nothing to measure with, as on `rollout=store`) nothing checks what is served against the base model, so the
    base model stays the reference (said once)."""
    kl = cfg.get("kl")
    if not kl or float(kl.get("coef") or 0) <= 0 or kl.get("reference", "served") != "served":
        return None
    if not gate_measures(cfg):
        log.info("kl.reference=served, but no gate measures what is served: the KL term pulls toward the base model "
                 "(publish.gate, docs/learning.md \"What the KL term pulls toward\")")  # fmt: skip
        return None
    return ServedAnchor(cfg.run_dir)


def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train the adapter; returns `(metrics, objects)` so tests can inspect what was built.

    SIGTERM / SIGINT stop it cleanly (`metaclaw.stopping`); a component that died raises `RunFailed`.
    """
    protect_run(cfg)  # 0700 / 0600 run files; keys given as overrides leave the .hydra/ dumps
    if cfg.mode.train:  # the server this run starts shares the CPU with training: devices.cpu_threads
        serves_here = bool(cfg.rollout.get("proxy")) and not cfg.serving.get("url")
        check_memory(cfg, resolve_devices(cfg, serves_here=serves_here))  # GPUs: fits, or refused with numbers
    validate_train_config(cfg)
    if not cfg.mode.train:  # mode=skills_only: proxy + skills, no policy, no training
        return run_skills_only(cfg)
    with torch_threads(cfg.devices.cpu_threads.get("train") if cfg.devices.get("cpu_threads") else None):
        return _train(cfg)


def _train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """`train` under its torch thread budget: build every part with what it depends on, serve, fit, report."""
    L.seed_everything(cfg.seed, workers=True)
    agents = AgentProfiles.from_config(cfg)  # many agents: one adapter each, on one base (docs/agents.md)
    spec, tokenizer, policy = build_policy(cfg, agents)
    store = prepare_store(cfg, tokenizer, policy)
    log.info("Sample store %s: %s", store.path, store.counts())
    stop = StopController(cfg.get("stop", {}).get("on_signal", "finish"))
    scheduler = build_scheduler(cfg, agents, stop)
    served = ServedVersions()  # the publisher updates it; the datamodule claims against it (staleness)
    datamodule = build_datamodule(cfg, tokenizer.pad_token_id, agents, scheduler, stop, served)
    distill = cfg.get("distill")
    distill_loss = instantiate(distill.loss) if distill and distill.enabled else None  # learning from the words
    module = OnlineRLModule(policy=policy, loss=instantiate(cfg.loss), advantage=instantiate(cfg.method.advantage),
                            optimizer=instantiate(cfg.optimizer), kl=instantiate(cfg.kl), distill_loss=distill_loss,
                            distill_weight=float(distill.weight) if distill else 1.0,
                            distill_top_k=int(distill.get("top_k", 0)) if distill else 0)  # fmt: skip
    # Live evaluation and the publish gate: rank 0 only (it is the one that serves and hot-loads).
    evaluator = build_evaluator(cfg) if rank_zero_only.rank == 0 else None
    rewind = Rewind(cfg.run_dir)  # forget --rollback: the trainer goes back to the clean adapter (modules.rewind)
    bind_rebase(evaluator, rewind, agents)  # publish.gate.rebase_after: refusals send the trainer back to the served
    publisher = build_publisher(cfg, served, evaluator, agents, rewind)
    health = instantiate(cfg.health) if cfg.get("health") else None
    control = build_control(cfg, store, scheduler)  # `python -m metaclaw status|pause|...` on the proxy's port
    if control:
        control.rewind = rewind
    trainer = build_trainer(cfg, agents, publisher.files.adapters, [
        RewindCallback(rewind, cfg.store_path), served_anchor(cfg),  # rewinds before the publisher; kl.reference
        publisher, ApplyImport(cfg.run_dir, agents, publisher),  # after the publisher: `metaclaw import` wins
        evaluator, scheduler, health, GracefulStop(stop)])  # fmt: skip
    ckpt = publisher.checkpoint_path if publisher.checkpoint_path.exists() else None
    if ckpt:
        log.info("Resuming from %s", ckpt)
    build_watch(cfg, evaluator, store, control)  # roll a served adapter back when its verdicts regress
    t0 = time.monotonic()
    # rollout=proxy|replay: server, proxy, scorer, replay. DDP workers re-run this script: only rank 0 serves.
    services = (live_loop(cfg, store, tokenizer, stop, partial(mount_plane, control) if control else None, evaluator)
                if rank_zero_only.rank == 0 else nullcontext(Live(stop=stop)))  # fmt: skip
    with stop.signals_installed(), services as live:
        if (server := live.upstream) is not None:
            publisher.connect(server, live.server.unavailable if live.server else None)
        if health is not None:
            health.attach(proxy=live.proxy, worker=live.worker, capture_store=store, served=served)
        if control:
            control.attach(live, trainer)
        fit(cfg, trainer, module, datamodule, ckpt, stop, publisher)
        driver_stats = dict(getattr(live.driver, "stats", {}) or {})
    if stop.error:
        raise RunFailed(stop.error)
    report = None if evaluator is None else report_run(cfg, trainer, datamodule, evaluator, store, stop,
                                                       time.monotonic() - t0, driver_stats)  # fmt: skip
    finish_loggers(trainer)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics["train/global_step"] = trainer.global_step
    if report is not None and report.get("final_compliance") is not None:  # the sweep objective (metaclaw.cli)
        metrics["heldout/final_compliance"] = float(report["final_compliance"])
    return metrics, {"trainer": trainer, "module": module, "datamodule": datamodule, "store": store,
                     "publisher": publisher, "tokenizer": tokenizer, "spec": spec, "live": live,
                     "scheduler": scheduler, "control": control, "evaluator": evaluator, "report": report}  # fmt: skip


def fit(cfg: DictConfig, trainer: L.Trainer, module: Any, datamodule: Any, ckpt: Path | None,
        stop: StopController, publisher: Any) -> None:  # fmt: skip
    """`trainer.fit` until it ends or a stop request ends it; then settle the store's claims (rank 0): after a
    stop, the steps after the newest checkpoint (`publish.checkpoint_every_n_steps`) go back to the queue."""
    try:
        with stop.fitting():
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
    except RunAbandoned as why:
        log.warning("%s: samples of unpublished steps go back to the queue", why)
    except SIGTERMException:  # Lightning's own SIGTERM handling: raised after the step (already published)
        stop.request("received SIGTERM")
    if stop.stopping and trainer.is_global_zero:
        log.info("Stopped (%s) at step %d: %s", stop.reason, trainer.global_step,
                 open_store(cfg.store_path).reconcile(publisher.checkpointed_step))  # fmt: skip
    elif trainer.is_global_zero:  # a finished run: the batch Lightning fetched ahead goes back to the queue
        open_store(cfg.store_path).release_claims(trainer.global_step)


def report_run(cfg: DictConfig, trainer: L.Trainer, datamodule: Any, evaluator: Any, store: SampleStore,
               stop: StopController, wall: float, driver_stats: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Write and print the run's report (`metaclaw.evaluation.report`): the curve, and why the run ended early."""
    at_limit = stop.stopping or trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
    ended = None if at_limit else getattr(datamodule, "end_reason", None)
    if ended is not None:  # the stream ended before max_time / max_steps: the agent or the server stalled
        log.warning("The run ended early at step %d: %s", trainer.global_step, ended)
    report = write_report(
        Path(cfg.run_dir), evaluator.results, store, trainer.global_step, wall, driver_stats,
        unfinished=evaluator.unfinished, ended_early=ended,
    )  # fmt: skip
    print(report["text"], flush=True)
    return report


def finish_loggers(trainer: L.Trainer) -> None:
    for lg in trainer.loggers:  # one W&B run per multirun job
        if hasattr(lg, "experiment") and type(lg).__name__ == "WandbLogger":
            lg.experiment.finish()
