"""Many agents in one installation (seed 001): who an agent is, its mode, and which adapter is its own.

An agent is named by `X-Agent-Id` (or the body field `agent_id`); ids are validated (`check_agent_id`:
letters, digits, `-`, `_`, at most 64 characters, so no path tricks; the skill library uses the same rule).
A ground-floor unit: it imports nothing of metaclaw. The `agents` config node lists profiles:

```yaml
agents:
  default: {mode: ${mode.name}}   # the default agent and every agent not listed
  alice: {mode: rl}               # her own adapter `policy:alice`, trained only on her turns
  bob: {mode: skills_only}        # skills injected, answered by the base model, never trained on
```

An agent listed with a training mode gets its own LoRA adapter (a named adapter in the one PEFT model),
published under `adapters/agents/<id>/step-NNNNNN/` and served as `<lora_name>:<id>`. Every other agent gets the
default profile: the default adapter (`adapters/step-NNNNNN/`, served as `<lora_name>`, today's names) and the
default mode. The number of adapters is bounded by the config, never by what clients send.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

AGENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MODES = ("skills_only", "rl", "auto")
DEFAULT_PROFILE = "default"  # the profile key of the default agent and of every agent not listed
DEFAULT_ADAPTER = "default"  # PEFT's name of the first adapter: the default profile's


def check_agent_id(agent_id: object, field_name: str = "X-Agent-Id") -> str:
    """`agent_id` when it is a safe id (and directory name): letters, digits, `-`, `_`, at most 64 characters.

    Raises:
        ValueError: naming `field_name` for anything else, e.g. `../x`, `a/b`, `_shared` or an empty string
            (the proxy answers 400; the skill library refuses the folder).
    """
    if not isinstance(agent_id, str) or not AGENT_ID_RE.match(agent_id):
        raise ValueError(
            f"{field_name} must match [A-Za-z0-9][A-Za-z0-9_-]{{0,63}} (got {agent_id!r}); "
            "path separators, dots and a leading underscore are not allowed"
        )
    return agent_id


@dataclass(frozen=True)
class AgentProfile:
    """What one agent gets: its mode and (when it trains) the adapter that is its own.

    `adapter` is the PEFT adapter name and the key its samples are batched by (`default` for the default
    profile); `lora_name` is the name the policy server serves it under.
    """

    name: str
    mode: str
    adapter: str
    lora_name: str

    @property
    def trains(self) -> bool:
        return self.mode != "skills_only"


class AgentProfiles:
    """The configured agents; `resolve(agent_id)` gives an agent's profile (the default one when not listed).

    Args:
        profiles: `agents` config node: `{id: {mode: ...}}`, with `default` for everyone not listed.
        lora_name: the default adapter's served name (`publish.lora_name`); agent `x` is served as `<lora_name>:x`.
    """

    def __init__(self, profiles: Mapping[str, Mapping[str, Any]] | None = None, lora_name: str = "policy") -> None:
        profiles = dict(profiles or {})
        default = dict(profiles.pop(DEFAULT_PROFILE, None) or {})
        self.lora_name = lora_name
        self.default = AgentProfile(DEFAULT_PROFILE, _mode(default, DEFAULT_PROFILE), DEFAULT_ADAPTER, lora_name)
        self.listed: dict[str, AgentProfile] = {}
        for agent_id, spec in profiles.items():
            check_agent_id(agent_id, f"agents.{agent_id}")
            mode = _mode(dict(spec or {}), agent_id)
            self.listed[agent_id] = AgentProfile(agent_id, mode, agent_id, f"{lora_name}:{agent_id}")

    @classmethod
    def from_config(cls, cfg: Any) -> AgentProfiles:
        """From a composed config: `cfg.agents` and `cfg.publish.lora_name` (no `agents`: the default only)."""
        from omegaconf import OmegaConf

        node = cfg.get("agents") if hasattr(cfg, "get") else None
        profiles = OmegaConf.to_container(node, resolve=True) if node is not None else {}
        publish = cfg.get("publish") if hasattr(cfg, "get") else None
        return cls(profiles, (publish or {}).get("lora_name", "policy") or "policy")

    def resolve(self, agent_id: str) -> AgentProfile:
        """The agent's own profile when it is listed, else the default profile."""
        return self.listed.get(agent_id, self.default)

    def adapter_of(self, agent_id: str) -> str:
        """The adapter an agent's samples train (its batch partition)."""
        return self.resolve(agent_id).adapter

    @property
    def own_adapters(self) -> list[str]:
        """Adapters besides the default one: the listed agents that train, in config order."""
        return [p.adapter for p in self.listed.values() if p.trains]

    @property
    def adapters(self) -> list[str]:
        """Every adapter the trainer holds: the default one first."""
        return [DEFAULT_ADAPTER, *self.own_adapters]

    @property
    def many(self) -> bool:
        """Whether any agent has an adapter of its own (else everything is exactly the single-agent path)."""
        return bool(self.own_adapters)

    def needs_scheduler(self, run_mode: str) -> bool:
        """Whether the run has training windows: `mode=auto`, or an `auto` agent in a `mode=rl` run."""
        return run_mode == "auto" or (run_mode == "rl" and any(p.mode == "auto" for p in self.profiles))

    def ungated_adapters(self, run_mode: str) -> set[str]:
        """In a run with a scheduler: the adapters of `rl` agents, which step outside training windows too."""
        if not self.needs_scheduler(run_mode):
            return set()
        return {p.adapter for p in self.profiles if p.mode == "rl"}

    @property
    def profiles(self) -> list[AgentProfile]:
        """The default profile, then the listed ones."""
        return [self.default, *self.listed.values()]

    def by_adapter(self, adapter: str) -> AgentProfile:
        return self.default if adapter == DEFAULT_ADAPTER else self.listed[adapter]


def _mode(spec: dict[str, Any], agent_id: str) -> str:
    unknown = set(spec) - {"mode"}
    if unknown:
        raise ValueError(f"agents.{agent_id} has unknown keys {sorted(unknown)}; a profile has `mode`")
    mode = spec.get("mode", "rl")
    if mode not in MODES:
        raise ValueError(f"agents.{agent_id}.mode must be one of {MODES}, got {mode!r}")
    return mode


def check_agent_modes(profiles: AgentProfiles, run_mode: str) -> None:
    """Per-agent modes the run can honour.

    A run with `mode=skills_only` loads no policy, so no agent can train. `auto` agents step only inside the
    training windows of the run's scheduler (the `scheduler` config node); `rl` agents step whenever their
    samples are ready. A `mode=rl` run with an `auto` agent gets the scheduler for that agent's sake
    (`needs_scheduler`), and its `rl` agents, the default one included, never wait for a window.
    """
    for p in profiles.profiles:
        field = f"agents.{p.name}.mode"
        if run_mode == "skills_only" and p.trains:
            raise ValueError(f"{field}={p.mode} needs a training run, but mode=skills_only loads no policy")


def size_max_loras(cfg: Any, profiles: AgentProfiles) -> None:
    """Give vLLM room for every adapter the run serves (plus one for a swap in flight): `backend.max_loras`.

    Written back into the config, so the policy server `train.py` starts gets it (never raised above what is
    configured when that is larger already).
    """
    backend = cfg.get("backend") if hasattr(cfg, "get") else None
    if backend is None or backend.get("max_loras") is None:
        return
    needed = len(profiles.adapters) + 1
    if backend.max_loras < needed:
        backend.max_loras = needed
