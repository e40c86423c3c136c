"""The live loop's parts, each built by `hydra.utils.instantiate` from its own config node.

The policy server the parts talk to is resolved once, by the live loop, into an `Endpoint` (`metaclaw.wire.client`:
URL and key) and passed in here. One rule for every node that talks to a model server (`judge` and the judges inside
`judge=auto`, `teacher`, `skills.evolver`): `base_url: null` means our policy server, with our server's key;
a node with its own `base_url` keeps its own `api_key`.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from metaclaw.agents import AgentProfiles
from metaclaw.privacy import PrivacyPolicy
from metaclaw.privacy.outbound import RedactingEvolver, RedactingJudge, teacher_renderer
from metaclaw.rollout.proxy_app import ProxyService
from metaclaw.scoring.distill import ContextDistiller
from metaclaw.scoring.judges import Judge
from metaclaw.scoring.teacher import TeacherClient, hinted_prompt_ids
from metaclaw.scoring.worker import ScoringWorker
from metaclaw.skills.hooks import FailSafeInjector, SkillEvolverLike
from metaclaw.store import SampleStore
from metaclaw.wire.client import Endpoint

log = logging.getLogger(__name__)


def with_server(node: DictConfig, server: Endpoint | None, name: str, suffix: str = "") -> DictConfig:
    """A copy of `node` in which every `base_url: null` (its own or a nested node's) is `server.url + suffix`,
    with `server.api_key` beside it.

    Raises:
        ValueError: a `base_url` is null and there is no policy server (names the field).
    """
    node = OmegaConf.create(OmegaConf.to_container(node, resolve=True))

    def fill(n: DictConfig, path: str) -> None:
        if "base_url" in n and n.base_url is None:
            if server is None:
                raise ValueError(f"{path}.base_url is null and there is no policy server: set the base URL")
            with open_dict(n):
                n.base_url, n.api_key = f"{server.url.rstrip('/')}{suffix}", server.api_key
        for key in n:
            if isinstance(n[key], DictConfig):
                fill(n[key], f"{path}.{key}")

    fill(node, name)
    return node


def build_injector(cfg: DictConfig) -> FailSafeInjector | None:
    """The proxy's skill injector when `skills.enabled` (wrapped so a skills failure never fails a request)."""
    skills = cfg.get("skills")
    if not skills or not skills.enabled or not skills.get("injector"):
        return None
    injector = instantiate(skills.injector)
    log.info("Skills: injecting from %s (_shared/ + one folder per X-Agent-Id)", getattr(injector, "root", "?"))
    return FailSafeInjector(injector)


def build_evolver(cfg: DictConfig, server: Endpoint | None) -> SkillEvolverLike | None:
    """The skill evolver (`skills.evolver`) when skills are on; it speaks OpenAI's `.../v1`."""
    skills = cfg.get("skills")
    if not skills or not skills.enabled or not skills.get("evolver"):
        return None
    evolver = instantiate(with_server(skills.evolver, server, "skills.evolver", suffix="/v1"))
    every = skills.get("evolve_every_n_turns")
    log.info(
        "Skills: evolving with %s at %s when a session ends%s",
        getattr(evolver, "model", "?"),
        getattr(evolver, "endpoint", "?"),
        f" and every {every} main turns of an agent" if every else "",
    )
    return evolver


def build_judge(cfg: DictConfig, server: Endpoint | None) -> Judge:
    """The judge (`judge`; `judge=auto` picks the rule or the LLM judge by model)."""
    return instantiate(with_server(cfg.judge, server, "judge"))


def build_teacher(cfg: DictConfig, server: Endpoint | None) -> TeacherClient | None:
    """The teacher client (`teacher`) when the method needs teacher logprobs."""
    if not cfg.method.needs_teacher:
        return None
    return instantiate(with_server(cfg.teacher, server, "teacher"))


def heldout_share(cfg: DictConfig) -> float:
    """The share of sessions the scoring worker holds out for the judge fallback (0 with a verifier or eval off)."""
    ev = cfg.get("eval") or {}
    if not ev.get("enabled") or has_verifier(cfg):
        return 0.0
    return float((ev.get("judge_fallback") or {}).get("heldout_share", 0.0))


def has_verifier(cfg: DictConfig) -> bool:
    """Whether a simulated user with a preference verifies replies (else evaluation judges held-out turns)."""
    return bool(cfg.rollout.get("simulated_user") and cfg.get("preference"))


def build_distiller(cfg: DictConfig, server: Endpoint | None, privacy: PrivacyPolicy | None) -> ContextDistiller | None:
    """Learning from the words (`distill.distiller`) when `distill.enabled`; a teacher off this machine reads
    redacted turns (`privacy.outbound`: anything but this run's own server with its key)."""
    node = cfg.get("distill")
    if not node or not node.enabled:
        return None
    if server is None and node.distiller.get("base_url") is None:
        log.warning(
            "Learning from the words is OFF: distill.distiller.base_url is null and there is no policy "
            "server to ask (set distill.distiller.base_url, or distill.enabled=false to silence this)"
        )
        return None
    distiller = instantiate(with_server(node.distiller, server, "distill.distiller"))
    if distiller.own_reply and int(node.get("top_k", 0)) <= 0:  # the corrected reply is never trained as it is
        raise ValueError(
            "distill.distiller.own_reply needs distill.top_k > 0: without the teacher's tokens the "
            "corrected reply would be trained as it was written (set distill.distiller.own_reply=false)"
        )
    if privacy is not None and privacy.redacts_for(distiller.endpoint):
        distiller.redact = privacy.view
    log.info("Learning from the words: stated preferences are distilled with %s at %s (context: %s)",
             distiller.model, distiller.endpoint, distiller.form)  # fmt: skip
    return distiller


def build_worker(cfg: DictConfig, store: SampleStore, tokenizer: Any, server: Endpoint | None) -> ScoringWorker:
    """The scoring worker (`rollout.scoring`) for `cfg.method`, with its judge, teacher and skill evolver."""
    judge, teacher, evolver = build_judge(cfg, server), build_teacher(cfg, server), build_evolver(cfg, server)
    render = lambda sample, hint: hinted_prompt_ids(tokenizer, sample, hint)  # noqa: E731
    privacy = getattr(store, "screen", None)
    if isinstance(privacy, PrivacyPolicy):  # calls anywhere but our own server get redacted text (privacy.outbound)
        if server is not None:  # this run's policy server: its address and its key (docs/privacy.md "Outbound")
            privacy.bind_own_server(server)
        judge = RedactingJudge(judge, privacy)
        evolver = RedactingEvolver(evolver, privacy) if evolver is not None else None
        render = teacher_renderer(render, teacher, privacy)
    return instantiate(
        cfg.rollout.scoring,
        store=store,
        judge=judge,
        needs_reward=cfg.method.needs_reward,
        needs_teacher=cfg.method.needs_teacher,
        teacher=teacher,
        render_teacher_prompt=render,
        evolver=evolver,
        evolve_every_n_turns=cfg.skills.evolve_every_n_turns if cfg.get("skills") else None,
        heldout_share=heldout_share(cfg),
        distiller=build_distiller(cfg, server, privacy if isinstance(privacy, PrivacyPolicy) else None),
    )


def build_privacy(cfg: DictConfig) -> PrivacyPolicy | None:
    """The run's privacy policy (`privacy`, docs/privacy.md); the store applies it to every sample it writes."""
    node = cfg.get("privacy")
    return instantiate(node) if node else None


def build_proxy(cfg: DictConfig, store: SampleStore, tokenizer: Any, server: Endpoint) -> ProxyService:
    """The proxy and its HTTP app (`rollout.proxy`), forwarding to `server`; it captures only when training."""
    node = OmegaConf.create(OmegaConf.to_container(cfg.rollout.proxy, resolve=True))
    node.pop("agent_keys", None)  # the live loop's concern (privacy.access), not the proxy's
    return instantiate(
        node,
        store=store,
        upstream_url=server.url,
        upstream_api_key=server.api_key,
        tokenizer=tokenizer,
        capture=bool(cfg.mode.train),
        skills=build_injector(cfg),
        agents=AgentProfiles.from_config(cfg),  # each agent's mode and adapter (docs/agents.md)
        _recursive_=False,
    )
