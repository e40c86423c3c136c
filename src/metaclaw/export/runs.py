"""Where a run keeps an agent's adapters, and which base model they were trained on.

A run directory holds `adapters/step-NNNNNN/` (the default adapter) and `adapters/agents/<id>/step-NNNNNN/` (an
agent with an adapter of its own, docs/agents.md), each with `latest.json`, and the composed config Hydra saved
in `.hydra/config.yaml`. Export and import read that config only for the `model`, `policy`, `agents` and
`publish.lora_name` nodes: the run's own file, never request data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from metaclaw.agents import AgentProfiles, check_agent_id
from metaclaw.atomic import write_file_atomically
from metaclaw.config import register_resolvers
from metaclaw.modules.loading import ModelSpec
from metaclaw.runfiles.layout import AdapterFolder, RunLayout
from metaclaw.wire import ADAPTER_CONFIG, ADAPTER_WEIGHTS

__all__ = ["ExportError", "RunAdapters", "file_sha256", "write_json_atomically"]


class ExportError(ValueError):
    """A request the command refuses: it names what does not fit (the CLI prints it and exits 2)."""


def write_json_atomically(path: Path, data: Any) -> None:
    """JSON through `atomic.write_file_atomically` (temp file, fsync, rename, fsync the directory; 0600)."""
    write_file_atomically(path, json.dumps(data, indent=1))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class RunAdapters:
    """A run directory's adapters for one agent, and the run's base model and LoRA settings."""

    run_dir: Path
    agent: str
    config: DictConfig

    @classmethod
    def open(cls, run_dir: str | Path, agent: str = "default") -> RunAdapters:
        run_dir = Path(run_dir).expanduser()
        if not run_dir.is_dir():
            raise ExportError(f"--run-dir {str(run_dir)!r} is not a directory")
        config_file = run_dir / ".hydra" / "config.yaml"
        if not config_file.is_file():
            raise ExportError(f"{config_file} is missing: --run-dir must be a directory written by train.py")
        try:
            check_agent_id(agent, "--agent")
        except ValueError as e:
            raise ExportError(str(e)) from e
        register_resolvers()  # the saved config keeps its `${metaclaw_...:}` interpolations
        return cls(run_dir, agent, OmegaConf.load(config_file))

    # ------------------------------------------------------------------ the run's settings

    def _node(self, key: str) -> Any:
        node = OmegaConf.select(self.config, key)
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node

    @property
    def profiles(self) -> AgentProfiles:
        return AgentProfiles(self._node("agents") or {}, self._node("publish.lora_name") or "policy")

    @property
    def adapter(self) -> str:
        """The trainer's adapter of this agent (`default` for every agent without one of its own)."""
        return self.profiles.adapter_of(self.agent)

    @property
    def served_name(self) -> str:
        return self.profiles.resolve(self.agent).lora_name

    @property
    def adapters_dir(self) -> Path:
        return self.folder.path

    @property
    def folder(self) -> AdapterFolder:
        """This agent's adapter folder (`metaclaw.runfiles.layout`)."""
        return RunLayout(self.run_dir).adapters(self.adapter)

    def model_spec(self) -> ModelSpec:
        node = dict(self._node("model") or {})
        if not node:
            raise ExportError(f"{self.run_dir}/.hydra/config.yaml has no `model` node")
        fields = {k: v for k, v in node.items() if k in ModelSpec.__dataclass_fields__}
        return ModelSpec(**fields)

    @property
    def lora(self) -> dict[str, Any]:
        """The run's LoRA settings (`policy` node): rank, alpha, target modules."""
        node = self._node("policy") or {}
        return {"rank": int(node.get("rank", 16)), "alpha": float(node.get("alpha", 32)),
                "target_modules": list(node.get("target_modules") or [])}  # fmt: skip

    # ------------------------------------------------------------------ published adapters

    def steps(self) -> list[int]:
        """The steps whose adapter directory is complete (config and safetensors), oldest first."""
        versions = self.folder.versions()
        return [v for v, d in versions if (d / ADAPTER_CONFIG).is_file() and (d / ADAPTER_WEIGHTS).is_file()]

    def latest(self) -> dict[str, Any] | None:
        return self.folder.read_latest()

    def resolve(self, step: str | int) -> tuple[int, Path]:
        """`latest` (what `latest.json` points at, else the newest step) or a step number → (step, directory)."""
        steps = self.steps()
        if str(step) == "latest":
            info = self.latest()
            if info and info.get("path") and Path(info["path"]).is_dir():
                return int(info.get("version", -1)), Path(info["path"])
            if not steps:
                raise ExportError(f"agent {self.agent!r} has no published adapter in {self.adapters_dir}")
            step = steps[-1]
        try:
            n = int(step)
        except ValueError as e:
            raise ExportError(f"STEP must be a step number or `latest`, got {step!r}") from e
        if n not in steps:
            shown = ", ".join(map(str, steps[-10:])) or "none"
            raise ExportError(f"agent {self.agent!r} has no adapter at step {n} in {self.adapters_dir} "
                              f"(published steps: {shown})")  # fmt: skip
        return n, self.folder.find(n) or self.folder.version_dir(n)

    def eval_at(self, step: int) -> dict[str, Any] | None:
        """The run's held-out evaluation of this agent's adapter at `step` (`eval.jsonl`), if one was made."""
        path = self.run_dir / "eval.jsonl"
        if not path.is_file():
            return None
        found = None
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("step") == step and record.get("agent_id", "default") in (self.agent, None):
                found = record
        return found

    def samples_trained_through(self, step: int) -> int | None:
        """How many samples the steps before `step` trained this adapter on (the store's consumed rows)."""
        import sqlite3

        path = self.run_dir / "samples.sqlite"
        if not path.is_file():
            return None
        own = [p.name for p in self.profiles.listed.values() if p.trains]
        if self.adapter != "default":
            where, args = "agent_id = ?", [self.agent]
        else:
            where, args = f"agent_id NOT IN ({','.join('?' * len(own))})" if own else "1", list(own)
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                sql = f"SELECT COUNT(*) FROM samples WHERE status='consumed' AND claimed_step < ? AND {where}"
                row = db.execute(sql, (step, *args)).fetchone()
                return int(row[0])
        except sqlite3.Error:
            return None
