"""The live loop around `trainer.fit`: policy server, rollout proxy, scoring worker and (optionally) replay.

`training.train` enters `live_loop(cfg, store, tokenizer)`; for `rollout=store` it does nothing. Otherwise it
starts (or connects to) the policy server, serves the proxy on `rollout.proxy.port`, scores in the background,
and with `rollout=replay` drives the proxy with the shipped example conversations. The parts are built from
their own config nodes (`metaclaw.loop.wiring`); this module only starts and stops them, in order.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from metaclaw.loop.policy_server import SERVER_NODES, PolicyServerProcess
from metaclaw.loop.wiring import build_proxy, build_worker
from metaclaw.rollout.probe import probe_attach, probe_capture
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.proxy_app import warn_open
from metaclaw.rollout.replay import ReplayDriver
from metaclaw.rollout.server import ThreadedServer
from metaclaw.runfiles.layout import RunLayout
from metaclaw.scoring.worker import ScoringWorker
from metaclaw.simulate.agents import SimulatedUsers
from metaclaw.simulate.user import SimulatedUser
from metaclaw.stopping import StopController
from metaclaw.store import SampleStore, open_store
from metaclaw.wire.client import Endpoint, load_adapter

log = logging.getLogger(__name__)


@dataclass
class Live:
    """What the live loop started (all None for `rollout=store`)."""

    server_url: str | None = None
    server_key: str | None = None  # the key of `server_url`: per run for the server we start (never logged)
    server: PolicyServerProcess | None = None
    eval_server: PolicyServerProcess | None = None  # live evaluation's own server (`devices.eval_server`)
    stop: StopController = field(default_factory=StopController)
    proxy_url: str | None = None
    proxy: RolloutProxy | None = None
    worker: ScoringWorker | None = None
    driver: ReplayDriver | SimulatedUser | SimulatedUsers | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def upstream(self) -> Endpoint | None:
        """The policy server every part talks to, resolved once (None before it is known)."""
        return Endpoint(self.server_url, self.server_key) if self.server_url else None


def server_nodes(cfg: DictConfig) -> dict[str, Any]:
    """The resolved settings the policy server gets: every field of `model`, `backend`, `devices` and `serve`."""
    return {name: OmegaConf.to_container(cfg[name], resolve=True) for name in SERVER_NODES if name in cfg}


def reload_latest_adapter(run_dir: str | Path, server: Endpoint, timeout_s: float = 60.0) -> None:
    """After a restart: hot-load the newest published adapters into the new server: `adapters/latest.json` and
    each agent's own `adapters/agents/<id>/latest.json` (docs/agents.md)."""
    for folder in RunLayout(run_dir).all_adapters().values():
        info = folder.read_latest()
        if info is None:
            continue
        load_adapter(server, info["name"], info["path"], timeout_s)
        log.info("Policy server restarted: adapter %s v%s reloaded", info["name"], info.get("version"))


def _server_process(cfg: DictConfig, key: str, role: str) -> PolicyServerProcess:
    process = cfg.serving.process
    return PolicyServerProcess(
        server_nodes(cfg),
        run_dir=cfg.run_dir,
        api_key=key,
        script=process.get("script"),
        extra_args=list(process.get("extra_args") or []),
        startup_timeout_s=process.startup_timeout_s,
        max_restarts=process.get("max_restarts", 0),
        poll_s=process.get("poll_s", 1.0),
        role=role,
    )


def start_policy_server(cfg: DictConfig, live: Live, stack: ExitStack, evaluation: bool = False) -> None:
    """Start serve.py from this run's config with a per-run key; watch it (restart, or stop the run).

    `evaluation`: also start live evaluation's own server (`devices.eval_server`: the same settings and key, its
    own process and port; both load at once). It is watched too: restarted, and past its restarts evaluation
    goes back to the policy server, said loudly (training goes on)."""
    key = cfg.serve.get("api_key") or secrets.token_urlsafe(32)
    server = _server_process(cfg, key, "policy")
    servers = [server, _server_process(cfg, key, "eval")] if evaluation else [server]
    for each in servers:
        stack.callback(each.stop)
        each.launch()
    for each in servers:
        each.wait_ready()
    live.server, live.server_url, live.server_key = server, server.url, key
    server.watch(
        on_restart=lambda: reload_latest_adapter(cfg.run_dir, Endpoint(server.url, key)),
        on_death=lambda reason: live.stop.request(reason, error=True),
    )
    if evaluation:
        live.eval_server = servers[1]

        def lost(reason: str) -> None:
            log.error("%s; live evaluation goes back to the policy server (devices.eval_server)", reason)
            live.eval_server = None
            if live.extras.get("on_eval_server_lost"):
                live.extras["on_eval_server_lost"]()

        servers[1].watch(on_restart=lambda: None, on_death=lost)


def connect_policy_server(cfg: DictConfig, live: Live, stack: ExitStack, evaluation: bool = False) -> Endpoint:
    """`serving.url` when set, else the server this run starts: the one place the upstream is decided.
    `evaluation`: the run evaluates live; with `devices.eval_server` (resolved by the device plan) it gets a
    server of its own (`live.eval_server`)."""
    serving = cfg.serving
    if serving.get("url"):
        live.server_url, live.server_key = serving.url.rstrip("/"), serving.get("api_key")
    elif not cfg.mode.train:
        raise ValueError("mode=skills_only forwards to serving.url: set it to an OpenAI-compatible base URL")
    else:
        start_policy_server(cfg, live, stack, evaluation and bool(cfg.devices.get("eval_server")))
    assert live.upstream is not None
    return live.upstream


@contextmanager
def live_loop(
    cfg: DictConfig,
    store: SampleStore,
    tokenizer: Any,
    stop: StopController | None = None,
    wrap_app: Callable[[Any], Any] | None = None,
    evaluator: Any = None,
) -> Iterator[Live]:
    """Start the online loop's services for the duration of the block; everything is stopped on exit.

    `stop` is the run's stop controller: a policy server that dies past its restarts requests a failed stop.
    `wrap_app` wraps the proxy's ASGI app (the control plane mounts `/control/*` with it).
    `evaluator` (a `LiveEvaluator`) is bound to the policy server and started before the simulated user.
    """
    live = Live(stop=stop or StopController())
    rollout = cfg.rollout
    if not rollout.get("proxy"):
        yield live
        return
    for name in ("httpx", "httpx2"):  # one line per proxied request drowns the progress
        logging.getLogger(name).setLevel(logging.WARNING)
    with ExitStack() as stack:
        server = connect_policy_server(cfg, live, stack, evaluation=evaluator is not None)
        p = rollout.proxy
        if cfg.mode.train:  # refuse a run the upstream cannot feed, before any agent is pointed at the proxy
            probe_capture(server, p.get("base_model"), p.request_timeout_s)
            if cfg.serving.get("url"):  # a server this run did not start: the flags adapters need (docs/gpu.md)
                probe_attach(server.url, server.api_key, p.get("base_model") or cfg.model.name, cfg.model.max_seq_len)
        service = build_proxy(cfg, store, tokenizer, server)
        live.proxy = service.proxy
        app = wrap_app(service.app) if wrap_app else service.app
        if p.get("agent_keys"):  # per-agent keys: a key holder is pinned to its agent (docs/privacy.md)
            from metaclaw.privacy.access import AgentKeyMiddleware, check_agent_keys

            keys = check_agent_keys(OmegaConf.to_container(p.agent_keys), p.get("api_key"))
            app = AgentKeyMiddleware(app, p.api_key, keys, store)
        drain_s = cfg.get("stop", {}).get("drain_timeout_s", 30.0)
        proxy_srv = stack.enter_context(ThreadedServer(app, host=p.host, port=p.port, drain_timeout_s=drain_s))
        live.proxy_url = proxy_srv.url
        if not p.get("api_key"):
            warn_open(live.proxy_url, p.host)
        log.info("Rollout proxy ready: point your agent at base_url=%s/v1", live.proxy_url)
        if not cfg.mode.train:  # skills_only: forward and inject, nothing to score, train or evolve
            yield live
            return
        live.worker = build_worker(cfg, store, tokenizer, server).start()
        stack.callback(live.worker.stop)
        privacy = getattr(store, "screen", None)
        if getattr(privacy, "retention_days", None) is not None:  # trained samples older than N days: deleted
            from metaclaw.privacy.forget import RetentionSweeper

            stack.callback(RetentionSweeper(store.path, privacy.retention_days, privacy.retention_check_s).start().stop)
        if evaluator is not None:
            from metaclaw.loop.eval_wiring import bind_evaluator

            eval_url = live.eval_server.url if live.eval_server is not None else None
            bind_evaluator(cfg, evaluator, server.url, server.api_key, store, eval_url=eval_url)
            live.extras["on_eval_server_lost"] = evaluator.rebind_eval
            stack.callback(evaluator.stop)
        if rollout.get("simulated_user"):
            user_cfg = OmegaConf.to_container(rollout.simulated_user, resolve=True)
            if user_cfg.get("agents"):  # several simulated users, each its own agent (docs/agents.md)
                live.driver = SimulatedUsers(f"{live.proxy_url}/v1", user_cfg, api_key=p.get("api_key"))
            else:
                user_cfg.pop("agents", None)
                live.driver = SimulatedUser(f"{live.proxy_url}/v1", api_key=p.get("api_key"), **user_cfg)
            live.driver.backlog = store.backlog  # max_ahead: no new session while enough turns wait to train
            stack.callback(live.driver.stop)
            live.driver.start()
            if evaluator is not None:  # the final evaluations need the CPU more than more turns
                evaluator.before_final_wait = live.driver.stop
        elif rollout.get("replay"):
            r = rollout.replay
            live.driver = ReplayDriver(f"{live.proxy_url}/v1", api_key=p.get("api_key"), **r).start()
            stack.callback(live.driver.stop)
            log.info("Replaying %s against the proxy", r.file)
        yield live


def run_skills_only(cfg: DictConfig, report_every_s: float = 30.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """`mode=skills_only`: serve the proxy (skills injected, nothing trained) until SIGTERM / SIGINT."""
    if not cfg.rollout.get("proxy"):
        raise ValueError("mode=skills_only needs a proxy: use rollout=proxy")
    store = open_store(cfg.store_path)
    stop = StopController()
    with stop.signals_installed(), live_loop(cfg, store, tokenizer=None, stop=stop) as live:
        while not stop.wait(report_every_s):
            log.info("Proxy: %s", live.proxy.stats)
    return {}, {"store": store, "live": live}
