"""Every option of every config group composes, and what it names can be instantiated."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from metaclaw.config import CONFIG_DIR, ConfigError, register_resolvers, trainer_device_kwargs, validate_train_config
from metaclaw.tracking import build_loggers, logger_nodes

CONF = CONFIG_DIR
register_resolvers()


def _compose(config_name: str, overrides: list[str], tmp_path: Path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name,
            overrides=[*overrides, f"hydra.run.dir={tmp_path}", f"run_dir={tmp_path}"],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def _options():
    serve_only = {"app"}
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for option in sorted(o for o in group.glob("*.yaml") if not o.stem.startswith("_")):  # _spec: a base
            yield pytest.param(
                "serve" if group.name in serve_only else "train",
                group.name,
                option.stem,
                id=f"{group.name}={option.stem}",
            )


# Groups whose node sits inside another (their `# @package` line).
PACKAGES = {"proxy": "rollout.proxy", "scoring": "rollout.scoring"}


@pytest.mark.parametrize(("config_name", "group", "option"), list(_options()))
def test_every_option_composes_and_instantiates(config_name, group, option, tmp_path):
    if group == "experiment":  # experiments are opt-in (`+experiment=NAME`) and rewrite the whole config
        cfg = _compose(config_name, [f"+experiment={option}"], tmp_path)
        validate_train_config(cfg)
        return
    cfg = _compose(config_name, [f"{group}={option}"], tmp_path)
    node = OmegaConf.select(cfg, PACKAGES.get(group, group))
    assert node is not None, f"{group}={option} composed to nothing"
    if group == "devices":
        kwargs = trainer_device_kwargs(node)
        assert kwargs["accelerator"] in {"cpu", "gpu"}
    elif group == "model":
        spec = instantiate(node)  # config only: weights that need a download are not loaded here
        assert spec.name and spec.max_seq_len > 0
    elif group == "logger":  # one logger, or several by name (logger=csv_wandb): metaclaw.tracking
        loggers = build_loggers(cfg)
        assert len(loggers) == (0 if option == "none" else len(logger_nodes(cfg))) and all(loggers)
    elif group == "loss":
        assert callable(instantiate(node))
    elif group == "method":
        assert callable(instantiate(node.advantage))
    elif group == "scheduler":
        assert instantiate(node).state_path.parent == tmp_path
    elif group == "judge" and option == "rule":
        assert instantiate(node) is not None
    assert_every_target_takes_its_settings(cfg)
    if config_name == "train":
        validate_train_config(cfg)


# Settings that sit beside a `_target_` but belong to another part, which reads them there.
READ_ELSEWHERE = {
    "publish.gate": "metaclaw.loop.eval_wiring.build_evaluator builds the release that gates",
    "rollout.proxy.agent_keys": "metaclaw.loop.live wraps the proxy's app in privacy.access.AgentKeyMiddleware",
}


def targets(node, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """Every node with a `_target_` under `node` (the path `a.b` of each)."""
    if isinstance(node, DictConfig):
        if node.get("_target_"):
            yield path, node
        for key in node:
            if not OmegaConf.is_missing(node, key):
                yield from targets(node._get_node(key), f"{path}.{key}".lstrip("."))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from targets(item, f"{path}[{i}]")


def assert_every_target_takes_its_settings(cfg: DictConfig) -> None:
    """Each `_target_` of the composed config is instantiated (as a partial: some need a model, a server or a GPU
    to run) and takes every setting written beside it: an option its target does not accept does nothing."""
    for path, node in targets(cfg):
        resolved = OmegaConf.to_container(node, resolve=True)
        settings = {k: v for k, v in resolved.items() if not k.startswith("_") and f"{path}.{k}" not in READ_ELSEWHERE}
        made = instantiate({"_target_": node._target_, **settings}, _partial_=True, _recursive_=False)
        try:
            inspect.signature(made.func).bind_partial(*made.args, **made.keywords)
        except TypeError as e:
            raise AssertionError(f"{path} ({node._target_}): {e}") from e


def test_every_target_of_the_default_configs_takes_its_settings(tmp_path):
    """The defaults' own nodes (`data`, `publish`, `kl`, `optimizer`, `teacher`, `health`, ...), beside the groups."""
    for name in ("train", "serve"):
        cfg = _compose(name, [], tmp_path)
        assert len(list(targets(cfg))) >= (8 if name == "train" else 1)
        assert_every_target_takes_its_settings(cfg)
    assert callable(instantiate(_compose("train", [], tmp_path).kl))


def test_readme_composition_on_cpu(tmp_path):
    """`python train.py method=combine model=qwen3_8b devices.train=[0,1]` composes without a GPU (the plan for
    a GPU host: tests/test_device_plan.py)."""
    cfg = _compose("train", ["method=combine", "model=qwen3_8b", "devices.train=[0,1]"], tmp_path)
    validate_train_config(cfg)
    assert trainer_device_kwargs(cfg.devices) == {
        "accelerator": "gpu",
        "devices": [0, 1],
        "strategy": "ddp",
        "precision": "bf16-mixed",
        "num_nodes": 1,
    }
    assert cfg.model.path == "Qwen/Qwen3-8B" and cfg.method.advantage.w_opd == 1.0


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (["method=opd", "teacher=null"], "teacher"),
        (["trainer.accumulate_grad_batches=2"], "trainer.accumulate_grad_batches"),
        (["devices.cpu_processes=4", "data.batch_size=2"], "data.batch_size"),
        (["data.max_tokens=64"], "data.max_tokens"),
        (["model=tiny", "devices.cpu_processes=2", "data.max_tokens=1500"], "data.max_sample_tokens"),
    ],
)
def test_impossible_combinations_fail_naming_fields(overrides, fields, tmp_path):
    cfg = _compose("train", overrides, tmp_path)
    with pytest.raises(ConfigError, match=fields.replace(".", r"\.")):
        validate_train_config(cfg)


def test_the_default_rl_advantage_is_centred_over_the_batch(tmp_path):
    """Seed 002's GRPO advantage: the verdict minus the batch mean. A batch in which every reply was corrected
    (all −1) carries no direction; uncentred it pushes every sampled token down, which flattens the distribution
    (an 8-minute run at lr 3e-4 went from 1.83 to 3.17 nats/token in 5 steps, docs/learning.md)."""
    import torch

    cfg = _compose("train", [], tmp_path)
    assert cfg.method.name == "rl"
    advantage = instantiate(cfg.method.advantage)
    mask = torch.ones(4, 3)
    flat, _ = advantage({"mask": mask, "reward": torch.tensor([-1.0, -1.0, -1.0, -1.0])})
    assert torch.count_nonzero(flat) == 0
    mixed, _ = advantage({"mask": mask, "reward": torch.tensor([1.0, -1.0, -1.0, -1.0])})
    assert mixed[0, 0] > 0 > mixed[1, 0]
    assert torch.allclose(mixed.sum(dim=0), torch.zeros(3))


@pytest.mark.parametrize("rollout", ["proxy", "simulated_user"])
def test_a_live_rl_step_waits_for_a_batch_it_can_centre(tmp_path, rollout):
    """RL centres the verdict over the batch, so a step on one scored sample learns nothing from it: a live user's
    turns arrive one at a time, and with `rollout=proxy` every step trained on a lone turn (min_batch_size 1).
    Both live rollouts wait for several samples; `rollout=proxy` for a full batch, as seed 002's batch-size."""
    cfg = _compose("train", [f"rollout={rollout}"], tmp_path)
    assert cfg.method.advantage.normalize == "mean" and cfg.data.min_batch_size >= 2
    assert cfg.data.min_batch_size == cfg.data.batch_size == 4
    smaller = _compose("train", [f"rollout={rollout}", "data.batch_size=2"], tmp_path)
    assert rollout != "proxy" or smaller.data.min_batch_size == 2  # follows the batch size the user sets


SIGNAL_RULES = ("at_least_one", "no_next_state", "feedback", "max_attempts", "timeout_s")


def test_every_live_rollout_trains_on_the_same_signal_rules_and_freshness_policy(tmp_path):
    """Issue 24: the demo carried rules the service lacked (at_least_one off, closing turns dropped), so it learned
    where users do not. One default: `rollout=proxy` states them, simulated_user and replay inherit them, and the
    freshness bounds live in `data` for every rollout."""
    composed = {r: _compose("train", [f"rollout={r}"], tmp_path) for r in ("proxy", "simulated_user", "replay")}
    proxy = composed["proxy"]
    assert proxy.rollout.scoring.at_least_one is False  # holds rewards for a whole session; invents a +1
    assert proxy.rollout.scoring.no_next_state == "drop"  # a turn nothing reacted to is never a trained 0
    for name, cfg in composed.items():
        for rule in SIGNAL_RULES:
            assert cfg.rollout.scoring[rule] == proxy.rollout.scoring[rule], f"rollout={name} overrides {rule}"
        assert (cfg.data.max_staleness, cfg.data.max_age_s) == (8, 600.0), name
    for name in ("simulated_user", "replay"):  # inherited, not restated
        text = (CONF / "rollout" / f"{name}.yaml").read_text()
        assert not any(rule in text for rule in ("at_least_one", "no_next_state", "max_staleness", "max_age_s"))
    fixed = _compose("train", ["rollout=store"], tmp_path)  # a fixed store is the data set: never aged out
    assert (fixed.data.max_staleness, fixed.data.max_age_s) == (None, None)


def test_the_live_path_drops_a_closing_turn_and_trains_only_fresh_samples(tmp_path):
    """`rollout=proxy` with its defaults, built as train.py builds them: the closing turn of a session (no next
    state) is settled `no_next_state`, never trained as 0; a stale sample is settled `stale`, kept and counted."""
    import asyncio
    import sqlite3
    import time

    from metaclaw.loop.wiring import build_worker
    from metaclaw.scoring.judges import RuleJudge
    from metaclaw.store import Sample, SampleStore, SampleText, SessionLog

    cfg = _compose("train", ["rollout=proxy", "model=tiny", "judge=rule"], tmp_path)
    store = SampleStore(cfg.store_path)
    for turn, next_state in enumerate(["thanks, that works", None]):
        store.insert(
            Sample(
                [1, 2, 3],
                [4, 5],
                [-0.5, -0.5],
                session_id="s",
                turn_index=turn,
                text=SampleText(messages=[{"role": "user", "content": "q"}], response_text="r", next_state=next_state),
            )
        )
    SessionLog(store.path).touch("default", "s", done=True)
    worker = build_worker(cfg, store, tokenizer=None, server=None)
    assert isinstance(worker.judge, RuleJudge)
    asyncio.run(worker.run_once())
    answered, closing = store.select()
    assert (answered.status, answered.reward) == ("ready", 1.0)
    assert (closing.status, closing.meta["dropped"], closing.reward) == ("dropped", "no_next_state", None)

    data = instantiate(cfg.data, pad_id=0)
    old = store.insert(Sample([1, 2, 3], [4, 5], [-0.5, -0.5], reward=-1.0, status="ready"))
    with sqlite3.connect(store.path) as c:
        c.execute("UPDATE samples SET created_at=? WHERE id=?", (time.time() - cfg.data.max_age_s - 60, old))
    assert data.bounds.max_age_s == 600.0 and data.bounds.max_staleness == 8
    from metaclaw.datamodules.rollout import StreamingSampleDataset

    stream = StreamingSampleDataset(store.path, lambda: 0, 0, data.batching.batch_size, None, None, 0.5,
                                    min_adapter_version=data._min_adapter_version,
                                    max_age_s=data.bounds.max_age_s)  # fmt: skip
    assert next(iter(stream))["sample_ids"].tolist() == [answered.id]
    assert store.get(old).meta["dropped"].startswith("stale:age") and store.dropped_reasons()["stale"] == 1
    store.close()


def test_eval_off_keeps_the_held_out_settings_the_gate_measures_with(tmp_path):
    """`eval=off` with the gate on stopped at start ("Key 'n_prompts' is not in struct"; scripts/check_wheel.sh's
    `metaclaw train eval=off`): no reports, but the gate still measures candidates on the held-out prompts."""
    cfg = _compose("train", ["eval=off"], tmp_path)
    assert cfg.eval.enabled is False and cfg.publish.gate.enabled is True
    assert cfg.eval.n_prompts > 0 and cfg.eval.samples_per_prompt >= 1 and cfg.eval.concurrency >= 1


@pytest.mark.parametrize("rollout", ["proxy", "simulated_user"])
def test_every_live_rollout_anchors_the_kl_term_on_the_served_adapter(tmp_path, rollout):
    """The KL term's reference is the served adapter on every rollout by default (what the user's path gets, not a
    setting of the demo); `kl.reference=base`, no KL term, or no gate (nothing checks what is served against the
    base model) start no anchor."""
    from metaclaw.modules.anchor import ServedAnchor
    from metaclaw.training import served_anchor

    cfg = _compose("train", [f"rollout={rollout}"], tmp_path)
    assert instantiate(cfg.kl).reference == "served"
    assert isinstance(served_anchor(cfg), ServedAnchor)
    assert served_anchor(_compose("train", [f"rollout={rollout}", "kl.reference=base"], tmp_path)) is None
    assert served_anchor(_compose("train", [f"rollout={rollout}", "kl.coef=0"], tmp_path)) is None
    assert served_anchor(_compose("train", [f"rollout={rollout}", "publish.gate.enabled=false"], tmp_path)) is None
    assert served_anchor(_compose("train", ["rollout=store"], tmp_path)) is None  # no gate measures anything there


@pytest.mark.parametrize("rollout", ["proxy", "simulated_user"])
def test_every_live_rollout_learns_from_the_words_by_default(tmp_path, rollout):
    """Learning from the words (`distill`) is on by default on every live rollout (session 27: the main job measured
    within its spread with it; identity cannot be learnt without it), built as train.py builds it: the distiller
    asks this run's policy server. `distill.enabled=false` builds none."""
    from metaclaw.loop.wiring import build_distiller
    from metaclaw.scoring.distill import ContextDistiller
    from metaclaw.wire.client import Endpoint

    server = Endpoint("http://127.0.0.1:9", "key")
    cfg = _compose("train", [f"rollout={rollout}", "model=tiny"], tmp_path)
    assert cfg.distill.enabled is True
    distiller = build_distiller(cfg, server, None)
    assert isinstance(distiller, ContextDistiller) and distiller.endpoint.url.startswith(server.url)
    off = _compose("train", [f"rollout={rollout}", "model=tiny", "distill.enabled=false"], tmp_path)
    assert build_distiller(off, server, None) is None
