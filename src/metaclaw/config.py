"""Config helpers: OmegaConf resolvers used by `conf/`, and the checks that tie several fields together."""

from __future__ import annotations

import dataclasses
import inspect
import netrc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, Node, OmegaConf

from metaclaw.agents import AgentProfiles, check_agent_modes
from metaclaw.devices import train_gpu_ids, train_processes, trainer_kwargs

DATA_DIR = Path(__file__).parent / "data"
CONFIG_DIR = Path(__file__).parent / "conf"  # the config tree, shipped in the package
CONFIG_PATH = "pkg://metaclaw.conf"  # Hydra's name for it, from a clone or an installed wheel alike

LORA_MODULE_GROUPS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
"""The attention and MLP projections by group (the Tinker API's `train_attn` / `train_mlp`)."""

LORA_TARGET_MODULES = (*LORA_MODULE_GROUPS["attn"], *LORA_MODULE_GROUPS["mlp"])
"""The modules a LoRA adapts unless `policy.target_modules` says otherwise: every attention and MLP projection
(never `lm_head`: the trainer does not adapt it and vLLM's prompt logprobs break with an `lm_head` LoRA layer).
The one spelling: `conf/` reads it as `${metaclaw_lora_targets:}` (a group as `${metaclaw_lora_targets:attn}`),
the trainer, the engines and the training server import it."""


def _lora_targets(group: str = "all") -> list[str]:
    return list(LORA_TARGET_MODULES if group == "all" else LORA_MODULE_GROUPS[group])


class ConfigError(ValueError):
    """A combination of config fields that cannot work; the message names the fields."""


def _wandb_offline() -> bool:
    """W&B stays offline unless the user configured a key (env or `wandb login`'s netrc entry)."""
    if os.environ.get("WANDB_API_KEY"):
        return False
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is None
    except (OSError, netrc.NetrcParseError):
        return True


class NoDefault(LookupError):
    """A setting beside a `_target_` whose target gives it no default (a required argument, or not one it takes)."""


def _plain(value: Any) -> Any:
    """A code default as config data: tuples as lists, read-only mappings and dataclass instances as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def code_default(target: str, path: Sequence[str]) -> Any:
    """The default `target` (a `_target_` string) gives the setting at `path` (`["images", "mode"]`: the key `mode`
    of the `images` argument's default): the one source of every default the config shows as `${metaclaw_default:}`.

    Raises `NoDefault` when the argument is required or not in the signature, or the default has no such key.
    """
    obj = get_object(target)
    name, *inner = path
    is_dataclass = isinstance(obj, type) and dataclasses.is_dataclass(obj)
    fields = {f.name: f for f in dataclasses.fields(obj)} if is_dataclass else {}
    factory = fields[name].default_factory if name in fields else dataclasses.MISSING
    if callable(factory):
        value = factory()
    else:
        param = inspect.signature(obj).parameters.get(name)
        if param is None or param.default is inspect.Parameter.empty:
            raise NoDefault(f"{target} has no default for `{name}`")
        value = param.default
    for key in inner:
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif dataclasses.is_dataclass(value) and hasattr(value, key):
            value = getattr(value, key)
        else:
            raise NoDefault(f"{target}'s default for `{'.'.join(path[:-1])}` has no `{key}`")
    return _plain(value)


def _setting_path(node: Node) -> tuple[DictConfig, list[str]]:
    """The nearest node with a `_target_` above `node`, and the keys from it down to `node`."""
    path: list[str] = []
    while True:
        path.insert(0, str(node._key()))
        parent = node._get_parent()
        if parent is None or isinstance(parent, ListConfig):
            raise ConfigError(f"`{'.'.join(path)}: ${{metaclaw_default:}}` has no `_target_` above it")
        if isinstance(parent, DictConfig) and "_target_" in parent:
            return parent, path
        node = parent


def _metaclaw_default(*, _node_: Node) -> Any:
    target_node, path = _setting_path(_node_)
    try:
        value = code_default(str(target_node["_target_"]), path)
    except NoDefault as e:
        raise ConfigError(f"`{'.'.join(path)}: ${{metaclaw_default:}}`: {e}") from e
    # a container as a config node: `OmegaConf.resolve` (Hydra's instantiate) cannot put a plain list into a value node
    return OmegaConf.create(value) if isinstance(value, dict | list) else value


def register_resolvers() -> None:
    """Idempotently register `${metaclaw_data:NAME}`, `${metaclaw_wandb_offline:}`, `${metaclaw_lora_targets:}`
    and `${metaclaw_default:}` (the code default of the setting it stands for: `code_default`)."""
    if not OmegaConf.has_resolver("metaclaw_data"):
        OmegaConf.register_new_resolver("metaclaw_data", lambda name: str(DATA_DIR / name))
    if not OmegaConf.has_resolver("metaclaw_wandb_offline"):
        OmegaConf.register_new_resolver("metaclaw_wandb_offline", _wandb_offline)
    if not OmegaConf.has_resolver("metaclaw_lora_targets"):
        OmegaConf.register_new_resolver("metaclaw_lora_targets", _lora_targets)
    if not OmegaConf.has_resolver("metaclaw_default"):
        OmegaConf.register_new_resolver("metaclaw_default", _metaclaw_default)


def validate_train_config(cfg: DictConfig) -> None:
    """Fail early, naming the fields, on combinations `train()` cannot run."""
    method = cfg.method
    if method.get("needs_teacher") and not cfg.get("teacher"):
        raise ConfigError(f"method={method.name} needs a teacher, but `teacher` is null")
    if cfg.trainer.get("accumulate_grad_batches", 1) != 1:
        raise ConfigError("trainer.accumulate_grad_batches must be 1: each claimed batch is one optimizer step")
    procs = train_processes(cfg.devices)
    if cfg.data.batch_size < procs:
        raise ConfigError(
            f"data.batch_size ({cfg.data.batch_size}) must be >= the training processes ({procs}, "
            "from devices.train / devices.cpu_processes)"
        )
    max_tokens, max_sample_tokens = cfg.data.max_tokens, cfg.data.max_sample_tokens
    least = int(OmegaConf.select(cfg, "data.min_batch_size", default=1) or 1)
    if max_tokens is not None and max_sample_tokens is not None and max_tokens < least * max_sample_tokens:
        raise ConfigError(  # a step waits for `least` samples, which must fit the budget however long they are
            f"data.max_tokens ({max_tokens}) must be >= data.min_batch_size ({least}) x data.max_sample_tokens "
            f"({max_sample_tokens}) = {least * max_sample_tokens}: otherwise long samples (an agent's 6-8k-token "
            "prompts) never fill a step and wait until they go stale"
        )
    if max_tokens is not None and max_sample_tokens is not None and max_tokens < procs * max_sample_tokens:
        raise ConfigError(
            f"data.max_tokens ({max_tokens}) must be >= the training processes ({procs}, from devices.train / "
            f"devices.cpu_processes) x data.max_sample_tokens ({max_sample_tokens}) = {procs * max_sample_tokens}: "
            "otherwise a step may never hold one sample per process"
        )
    if cfg.data.get("epochs_per_batch", 1) > 1 and "clip_high" not in cfg.loss:
        raise ConfigError(
            f"data.epochs_per_batch={cfg.data.epochs_per_batch} trains a batch again after the policy moved: it needs "
            f"a clipped loss (loss=ppo or loss=cispo), not {cfg.loss._target_}"
        )
    if train_gpu_ids(cfg.devices) and cfg.devices.cpu_processes != 1:
        raise ConfigError("devices.cpu_processes applies only when devices.train is empty (CPU training)")
    check_agents(cfg)


def check_agents(cfg: DictConfig) -> AgentProfiles:
    """The `agents` profiles (ids, modes) the run can honour; several adapters train in one process or under DDP.

    FSDP with several adapters is refused: FSDP flattens each decoder layer's parameters once, when it wraps the
    model, and its gradient reduction and `summon_full_params` publishing were never checked with adapters that
    take turns (docs/agents.md, "Several training processes").
    """
    try:
        profiles = AgentProfiles.from_config(cfg)
        check_agent_modes(profiles, cfg.mode.name)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if profiles.many and str(cfg.devices.get("strategy", "auto")).lower() == "fsdp":
        raise ConfigError(
            f"agents {profiles.own_adapters} have adapters of their own, which train in one process or under DDP, "
            "not with devices.strategy=fsdp: use devices.strategy=ddp (or auto), or one adapter"
        )
    return profiles


# Lightning's DDP with `find_unused_parameters=True`: several adapters take turns, and the ones a step does not
# train are not in its graph (docs/agents.md, "Several training processes").
DDP_SEVERAL_ADAPTERS = "ddp_find_unused_parameters_true"


def trainer_device_kwargs(devices: DictConfig, several_adapters: bool = False) -> dict:
    """Accelerator/devices/strategy/precision/num_nodes for `lightning.Trainer` (see `metaclaw.devices`).

    With `several_adapters` (agents with adapters of their own) DDP finds the parameters a step did not use.
    """
    kwargs = trainer_kwargs(devices)
    if several_adapters and kwargs["strategy"] == "ddp":
        kwargs["strategy"] = DDP_SEVERAL_ADAPTERS
    return kwargs


# Registered on import: a config composed from CONFIG_DIR anywhere (a test, a bench script, a notebook) resolves.
register_resolvers()
