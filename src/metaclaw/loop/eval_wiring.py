"""Build the live evaluator and publish gate from the composed config (`eval`, `publish.gate`, `preference`).

Many agents (docs/agents.md): every agent with an adapter of its own is evaluated on its own: with a verifier,
by the simulated user that speaks as it (`rollout.simulated_user` and its `agents`), with that user's preference;
with the judge fallback, on the held-out turns of the agents its adapter serves.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from metaclaw.agents import AgentProfiles
from metaclaw.evaluation.cache import BaselineCache, model_fingerprint
from metaclaw.evaluation.evaluator import ComplianceEvaluator
from metaclaw.evaluation.live import LiveEvaluator
from metaclaw.evaluation.regression import RegressionWatch
from metaclaw.evaluation.turns import HeldoutTurnsEvaluator
from metaclaw.loop.wiring import build_injector, has_verifier, heldout_share
from metaclaw.simulate.agents import user_settings
from metaclaw.store import SampleStore

log = logging.getLogger(__name__)


def build_watch(cfg: DictConfig, evaluator: LiveEvaluator | None, store: SampleStore, control: Any) -> None:
    """Give the gating evaluator a `RegressionWatch` (`publish.gate.rollback`) that rolls back through `control`,
    and, with a scheduler, hold every accepted candidate while a rollback (the user's or the watch's) stands."""
    spec = (cfg.publish.get("gate") or {}).get("rollback") or {}
    if evaluator is None or control is None or not evaluator.gate:
        return
    if control.scheduler is not None:  # a rollback pauses training: no candidate replaces it until resume

        def frozen() -> str | None:
            step = getattr(control.scheduler.state, "rollback_step", None)
            return None if step is None else f"rolled back to step {step}: resume to serve new adapters"

        evaluator.frozen = frozen
    if not spec.get("enabled"):
        return
    evaluator.watch = RegressionWatch(
        store, control.rollback, min_turns=int(spec["min_turns"]), margin=float(spec["margin"]),
        alpha=float(spec["alpha"]),
    )  # fmt: skip


def simulated_agents(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """The simulated user whose preference verifies each training agent's adapter: `{profile name: settings}`.

    Raises:
        ValueError: when two simulated users train one adapter (one adapter is evaluated against one
            preference): list one of them under `agents` with a mode of its own.
    """
    profiles = AgentProfiles.from_config(cfg)
    out: dict[str, dict[str, Any]] = {}
    for user in user_settings(OmegaConf.to_container(cfg.rollout.simulated_user, resolve=True)):
        agent_id = user.get("agent_id", "simulated-user")
        profile = profiles.resolve(agent_id)
        if not profile.trains:
            continue
        if profile.name in out:
            raise ValueError(
                f"simulated users {out[profile.name]['agent_id']!r} and {agent_id!r} both train the adapter of "
                f"agent {profile.name!r}, which is evaluated against one preference: give {agent_id!r} an adapter "
                f"of its own (+agents.{agent_id}.mode=rl) or turn eval off"
            )
        out[profile.name] = user
    return out


def gate_measures(cfg: DictConfig) -> bool:
    """Whether the publish gate measures each candidate before it is served, as `build_evaluator` sets it up: the
    gate on, and a verifier, or judged held-out turns of a live rollout, to measure with. The same answer on every
    rank (the config's), where the evaluator itself exists on rank 0 only."""
    if not (cfg.publish.get("gate") or {}).get("enabled", False):
        return False
    if has_verifier(cfg):
        return True
    return bool(heldout_share(cfg) and cfg.rollout.get("proxy") and cfg.method.get("needs_reward"))


def build_evaluator(cfg: DictConfig) -> LiveEvaluator | None:
    """The `LiveEvaluator` callback when `eval.enabled` (or `publish.gate.enabled`) and a verifier exists, or,
    without one, when `eval.judge_fallback.heldout_share` > 0 on a rollout whose turns the judge scores (the gate
    then measures candidates on those held-out turns)."""
    ev = cfg.get("eval") or {}
    gate_cfg = cfg.publish.get("gate") or {}
    gate = gate_cfg.get("enabled", False)
    if not ev.get("enabled") and not gate:
        return None
    if not has_verifier(cfg):
        if gate and (not heldout_share(cfg) or not cfg.method.get("needs_reward")):
            log.warning(
                "publish.gate.enabled but nothing to measure candidates with (no verifier, %s): EVERY ADAPTER IS "
                "SERVED UNMEASURED. Hold out turns (eval.enabled=true, eval.judge_fallback.heldout_share > 0, a "
                "method with rewards) or use rollout=simulated_user",
                "no held-out turns" if not heldout_share(cfg) else f"method={cfg.method.name} gives no reward",
            )
            gate = False
        if not heldout_share(cfg) or not cfg.rollout.get("proxy"):
            log.info(
                "Live evaluation off: rollout=%s has no verifier; eval.judge_fallback.heldout_share > 0 holds out a "
                "share of the sessions the proxy captures and reports the judge's verdicts on them",
                cfg.rollout.name,
            )
            return None
        if not cfg.method.get("needs_reward"):
            log.warning("Live evaluation off: eval.judge_fallback needs a judge reward and method=%s gives none "
                        "(method=rl|combine)", cfg.method.name)  # fmt: skip
            return None
    elif not simulated_agents(cfg):
        if gate:
            raise ValueError("publish.gate.enabled: no simulated user speaks as an agent that trains (no verifier)")
        log.info("Live evaluation off: no simulated user speaks as an agent that trains")
        return None
    return LiveEvaluator(
        evaluator=None,
        run_dir=cfg.run_dir,
        base_model=cfg.model.name,
        every_n_adapters=ev.get("every_n_adapters", 1),
        gate=bool(gate),
        margin=float(gate_cfg.get("margin", 0.1)),
        alpha=float(gate_cfg.get("alpha", 0.05)),
        max_nll_increase=gate_cfg.get("max_nll_increase"),
        min_turns=int(gate_cfg.get("min_turns", 8)),
        rebase_after=gate_cfg.get("rebase_after"),
        watch_every_s=float((gate_cfg.get("rollback") or {}).get("every_s", 30.0)),
        eval_name=ev.get("eval_name", "metaclaw-eval"),
        api_key=cfg.serving.get("api_key"),
        max_pending=ev.get("max_pending", 2),
        final_timeout_s=ev.get("final_timeout_s", 300.0),
        max_share=ev.get("max_share"),
        baseline=ev.get("baseline", "first"),
    )


def bind_evaluator(
    cfg: DictConfig,
    evaluator: LiveEvaluator,
    server_url: str,
    server_key: str | None,
    store: SampleStore | None = None,
    eval_url: str | None = None,
) -> None:
    """Point the evaluator at the running policy server (with its key) and start it (base model first); without
    a verifier, at the run's store (the judge fallback). `eval_url`: evaluation's own server (`devices.eval_server`),
    where every evaluation request goes (the agent's server is only asked what it serves)."""
    ev = cfg.eval
    measure_on = eval_url or server_url
    quality = ev.get("quality") or {}
    base_model = cfg.model.name if quality.get("enabled", True) else None
    profiles = AgentProfiles.from_config(cfg)
    if not has_verifier(cfg):
        if store is None:
            raise ValueError("the judge fallback of live evaluation needs the run's sample store")
        fallback = ev.get("judge_fallback") or {}
        for adapter in profiles.adapters:  # each adapter: the held-out turns of the agents it serves
            owner = (lambda a, mine=adapter: profiles.adapter_of(a) == mine) if profiles.many else None
            turns = HeldoutTurnsEvaluator(
                store, measure_on, base_model, api_key=server_key, max_turns=fallback.get("max_turns", 32),
                min_turns=fallback.get("min_turns", 4), nll_margin=float(quality.get("nll_margin", 1.0)), owner=owner,
                keep_examples=3 if (cfg.get("privacy") or {}).get("show_text") else 0,  # users' turns: docs/privacy.md
                concurrency=int(ev.get("concurrency", 4)), quality_turns=int(fallback.get("quality_turns", 8)),
            )  # fmt: skip
            profile = profiles.by_adapter(adapter)
            evaluator.add_agent(profile.name, turns, lora_name=profile.lora_name, owner=owner)
        evaluator.bind(server_url, api_key=server_key, eval_url=eval_url)
        evaluator.start()
        return
    injector = build_injector(cfg)
    cache, cache_parts = baseline_cache(cfg)
    for agent, user in simulated_agents(cfg).items():  # each agent's adapter against its own user's preference
        profile = profiles.resolve(agent)
        mine = profile.adapter
        evaluator.add_agent(
            agent,
            ComplianceEvaluator(
                measure_on,
                user["preferences"],
                tasks_file=user.get("tasks_file"),
                n_prompts=ev.n_prompts,
                samples_per_prompt=ev.samples_per_prompt,
                max_tokens=ev.max_tokens,
                temperature=ev.temperature,
                system=user.get("system"),
                api_key=server_key,
                concurrency=ev.concurrency,
                seed=ev.seed,
                injector=injector,
                agent_id=user.get("agent_id", "simulated-user"),
                base_model=base_model,
                nll_margin=float(quality.get("nll_margin", 1.0)),
                cache=cache,
                cache_parts=cache_parts,
                baseline_name=cfg.model.name,
                thinking=cfg.model.get("thinking"),
            ),
            lora_name=profile.lora_name,
            owner=(lambda a, mine=mine: profiles.adapter_of(a) == mine) if profiles.many else None,
        )
    evaluator.bind(server_url, api_key=server_key, eval_url=eval_url)
    evaluator.start(baseline=True)


def baseline_cache(cfg: DictConfig) -> tuple[BaselineCache | None, dict[str, Any] | None]:
    """The cache of the base model's held-out replies (`eval.cache`) and what identifies the served base model:
    its files' content hash, the model, backend and inference devices settings."""
    node = cfg.eval.get("cache") or {}
    if not node.get("enabled", False):
        return None, None
    try:
        where = instantiate(cfg.model).local_dir()
    except Exception as e:  # noqa: BLE001 - no cache rather than no evaluation
        log.warning("Eval cache off: cannot locate the model's files (%s)", e)
        return None, None
    parts = {
        "model_files": model_fingerprint(where),
        "model_config": OmegaConf.to_container(cfg.model, resolve=True),
        "backend": OmegaConf.to_container(cfg.backend, resolve=True),
        "infer_devices": OmegaConf.to_container(cfg.devices, resolve=True).get("infer"),
    }
    return BaselineCache(node.get("dir"), int(node.get("max_entries", 32))), parts
