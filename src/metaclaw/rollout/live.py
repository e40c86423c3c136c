"""The live loop around `trainer.fit`: policy server, rollout proxy, scoring worker and (optionally) replay.

`training.train` enters `live_loop(cfg, store, tokenizer)`; for `rollout=store` it does nothing. Otherwise it
starts (or connects to) the policy server, serves the proxy on `rollout.proxy.port`, scores in the background,
and with `rollout=replay` drives the proxy with the shipped example conversations.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from metaclaw.datamodules.store import SampleStore
from metaclaw.rollout.app import create_app
from metaclaw.rollout.fit import build_fit
from metaclaw.rollout.policy_server import PolicyServerProcess
from metaclaw.rollout.proxy import RolloutProxy
from metaclaw.rollout.replay import ReplayDriver
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.skills_hook import FailSafeInjector
from metaclaw.scoring.teacher import TeacherClient, hinted_prompt_ids
from metaclaw.scoring.worker import ScoringWorker
from metaclaw.simulate.user import SimulatedUser

log = logging.getLogger(__name__)


@dataclass
class Live:
    """What the live loop started (all None for `rollout=store`)."""

    server_url: str | None = None
    proxy_url: str | None = None
    proxy: RolloutProxy | None = None
    worker: ScoringWorker | None = None
    driver: ReplayDriver | SimulatedUser | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def build_injector(cfg: DictConfig) -> FailSafeInjector | None:
    """The proxy's skill injector when `skills.enabled` (wrapped so a skills failure never fails a request)."""
    skills = cfg.get("skills")
    if not skills or not skills.enabled or not skills.get("injector"):
        return None
    injector = instantiate(skills.injector)
    log.info("Skills: injecting from %s (_shared/ + one folder per X-Agent-Id)", getattr(injector, "root", "?"))
    return FailSafeInjector(injector)


def build_evolver(cfg: DictConfig, server_url: str | None) -> Any:
    """The skill evolver when `skills.enabled` and `skills.evolver` are set; `base_url: null` means our server."""
    skills = cfg.get("skills")
    if not skills or not skills.enabled or not skills.get("evolver"):
        return None
    ev = skills.evolver
    overrides: dict[str, Any] = {}
    if ev.get("base_url") is None:
        if not server_url:
            raise ValueError("skills.evolver.base_url is null and there is no policy server: set the base URL")
        overrides["base_url"] = f"{server_url.rstrip('/')}/v1"
        if ev.get("api_key") is None:
            overrides["api_key"] = cfg.serving.get("api_key")
    evolver = instantiate(ev, **overrides)
    every = skills.get("evolve_every_n_turns")
    log.info(
        "Skills: evolving with %s at %s when a session ends%s",
        getattr(evolver, "model", "?"),
        getattr(evolver, "base_url", "?"),
        f" and every {every} main turns of an agent" if every else "",
    )
    return evolver


def build_worker(cfg: DictConfig, store: SampleStore, tokenizer: Any, server_url: str | None) -> ScoringWorker:
    """The scoring worker for `cfg.method`, judge from `cfg.judge`, teacher from `cfg.teacher`, skill evolver."""
    judge = instantiate(cfg.judge)
    if hasattr(judge, "bind") and server_url:
        judge.bind(server_url)
    teacher = None
    if cfg.method.needs_teacher:
        t = cfg.teacher
        url = t.get("url") or server_url
        if not url:
            raise ValueError("method needs teacher logprobs: set teacher.url or run with a policy server")
        teacher = TeacherClient(url, t.model, t.get("api_key"), t.timeout_s)
    return ScoringWorker(
        store,
        judge,
        needs_reward=cfg.method.needs_reward,
        needs_teacher=cfg.method.needs_teacher,
        teacher=teacher,
        render_teacher_prompt=lambda sample, hint: hinted_prompt_ids(tokenizer, sample, hint),
        evolver=build_evolver(cfg, server_url),
        evolve_every_n_turns=cfg.skills.evolve_every_n_turns if cfg.get("skills") else None,
        **cfg.rollout.scoring,
    )


@contextmanager
def live_loop(cfg: DictConfig, store: SampleStore, tokenizer: Any, evaluator: Any = None) -> Iterator[Live]:
    """Start the online loop's services for the duration of the block; everything is stopped on exit.

    `evaluator` (a `LiveEvaluator`) is bound to the policy server and started before the simulated user.
    """
    rollout = cfg.rollout
    if not rollout.get("proxy"):
        yield Live()
        return
    for name in ("httpx", "httpx2"):  # one line per proxied request drowns the progress
        logging.getLogger(name).setLevel(logging.WARNING)
    with ExitStack() as stack:
        live = Live()
        serving = cfg.serving
        if serving.get("url"):
            live.server_url = serving.url.rstrip("/")
        elif not cfg.mode.train:
            raise ValueError("mode=skills_only forwards to serving.url: set it to an OpenAI-compatible base URL")
        else:
            server = PolicyServerProcess(**serving.process, run_dir=cfg.run_dir)
            live.server_url = stack.enter_context(server).url
        p = rollout.proxy
        live.proxy = RolloutProxy(
            store,
            live.server_url,
            upstream_api_key=serving.get("api_key"),
            policy_model=p.policy_model,
            base_model=p.base_model,
            default_temperature=p.default_temperature,
            default_agent_id=p.default_agent_id,
            request_timeout_s=p.request_timeout_s,
            capture=bool(cfg.mode.train),
            skills=build_injector(cfg),
            fit=build_fit(p, tokenizer),
        )
        app = create_app(live.proxy, p.get("api_key"), p.max_body_bytes, p.served_model)
        proxy_srv = stack.enter_context(ThreadedServer(app, host=p.host, port=p.port))
        live.proxy_url = proxy_srv.url
        log.info(
            "Rollout proxy ready: point your agent at base_url=%s/v1 (policy server %s)",
            live.proxy_url,
            live.server_url,
        )
        if not cfg.mode.train:  # skills_only: forward and inject, nothing to score, train or evolve
            yield live
            return
        live.worker = build_worker(cfg, store, tokenizer, live.server_url).start()
        stack.callback(live.worker.stop)
        if evaluator is not None:
            from metaclaw.evaluation.build import bind_evaluator

            bind_evaluator(cfg, evaluator, live.server_url)
            stack.callback(evaluator.stop)
        if rollout.get("simulated_user"):
            user_cfg = OmegaConf.to_container(rollout.simulated_user, resolve=True)
            live.driver = SimulatedUser(f"{live.proxy_url}/v1", api_key=p.get("api_key"), **user_cfg)
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
    """`mode=skills_only`: serve the proxy (skills injected, nothing trained) until interrupted."""
    if not cfg.rollout.get("proxy"):
        raise ValueError("mode=skills_only needs a proxy: use rollout=proxy")
    store = SampleStore(cfg.store_path)
    with live_loop(cfg, store, tokenizer=None) as live:
        try:
            while True:
                time.sleep(report_every_s)
                log.info("Proxy: %s", live.proxy.stats)
        except KeyboardInterrupt:
            log.info("Stopping")
    return {}, {"store": store, "live": live}
