"""Build the live evaluator and publish gate from the composed config (`eval`, `publish.gate`, `preference`)."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from metaclaw.evaluation.evaluator import ComplianceEvaluator
from metaclaw.evaluation.live import LiveEvaluator

log = logging.getLogger(__name__)


def build_evaluator(cfg: DictConfig) -> LiveEvaluator | None:
    """The `LiveEvaluator` callback when `eval.enabled` (or `publish.gate.enabled`) and a verifier exists."""
    ev = cfg.get("eval") or {}
    gate = (cfg.publish.get("gate") or {}).get("enabled", False)
    if not ev.get("enabled") and not gate:
        return None
    if not (cfg.rollout.get("simulated_user") and cfg.get("preference")):
        if gate:
            raise ValueError(
                "publish.gate.enabled needs a verifier to score candidates: use rollout=simulated_user "
                "(a preference), or turn the gate off"
            )
        log.info("Live evaluation off: rollout=%s has no verifier (needs rollout=simulated_user)", cfg.rollout.name)
        return None
    return LiveEvaluator(
        evaluator=None,
        run_dir=cfg.run_dir,
        base_model=cfg.model.name,
        every_n_adapters=ev.get("every_n_adapters", 1),
        gate=bool(gate),
        margin=float((cfg.publish.get("gate") or {}).get("margin", 0.1)),
        eval_name=ev.get("eval_name", "metaclaw-eval"),
        api_key=cfg.serving.get("api_key"),
        max_pending=ev.get("max_pending", 2),
        final_timeout_s=ev.get("final_timeout_s", 300.0),
    )


def bind_evaluator(cfg: DictConfig, evaluator: LiveEvaluator, server_url: str, server_key: str | None) -> None:
    """Point the evaluator at the running policy server (with its key) and start it (base model first)."""
    from metaclaw.loop.wiring import build_injector

    ev, user = cfg.eval, cfg.rollout.simulated_user
    prefs: Any = OmegaConf.to_container(cfg.preference.rules, resolve=True)
    evaluator.bind(
        server_url,
        ComplianceEvaluator(
            server_url,
            prefs,
            tasks_file=user.get("tasks_file"),
            n_prompts=ev.n_prompts,
            samples_per_prompt=ev.samples_per_prompt,
            max_tokens=ev.max_tokens,
            temperature=ev.temperature,
            system=cfg.preference.get("system"),
            api_key=server_key,
            concurrency=ev.concurrency,
            seed=ev.seed,
            injector=build_injector(cfg),
            agent_id=user.get("agent_id", "simulated-user"),
        ),
        api_key=server_key,
    )
    evaluator.start(baseline=True)
