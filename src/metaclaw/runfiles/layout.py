"""The run directory's layout: the one module that names its folders and files.

```
<run_dir>/
  adapters/                  the default adapter (`AdapterFolder`)
    step-000042/             one published version: adapter_config.json, adapter_model.safetensors and
                             metaclaw_adapter.json ({"version": 42}: the version travels as data)
    imported-<UTC time>/     an adapter brought in by `python -m metaclaw import`
    import.json              that import's record, applied by the next run
    rewind.json              a rewind (forget --rollback): {"path", "done"}; applied again at start until done
    latest.json              the served pointer: {"version", "path", "name", ...} (what a restart serves)
    agents/<id>/             an agent's own adapter (docs/agents.md): the same layout
  checkpoints/last.ckpt      the resumable Lightning checkpoint (written to last.ckpt.tmp, then renamed)
  server/                    the policy server the live loop starts: serve_config.yaml, server.log, Hydra output
  eval-server/               live evaluation's own policy server (devices.eval_server): the same files
```

A version is read from the folder's `metaclaw_adapter.json`, never from its name. Run directories written before
that file existed still load: `adapter_version` falls back to the old layout's `step-NNNNNN` name, here and only
here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metaclaw.agents import DEFAULT_ADAPTER
from metaclaw.atomic import write_file_atomically

ADAPTERS = "adapters"
AGENTS = "agents"
CHECKPOINTS = "checkpoints"
CHECKPOINT = "last.ckpt"
SERVER = "server"
EVAL_SERVER = "eval-server"  # live evaluation's own policy server (`devices.eval_server`), same settings
SERVER_ROLES = {"policy": SERVER, "eval": EVAL_SERVER}
SERVER_CONFIG_NAME = "serve_config"  # <run_dir>/server/serve_config.yaml: the started serve.py's primary config
SERVER_LOG = "server.log"
LATEST = "latest.json"
IMPORT_RECORD = "import.json"  # an import waiting to be applied by the next run (`metaclaw.export.apply`)
REWIND_RECORD = "rewind.json"  # a rewind (`forget --rollback`) no checkpoint holds yet (`metaclaw.modules.rewind`)
ADAPTER_INFO = "metaclaw_adapter.json"  # inside a published adapter folder: {"version": N}
_VERSION_PREFIX = "step-"
_LEGACY_NAME = re.compile(r"^step[-_]?(?P<version>\d+)$")  # run dirs written before ADAPTER_INFO existed


def version_dir_name(version: int) -> str:
    """The folder name a published version gets (`step-000042`): a name for people, never parsed for a version."""
    return f"{_VERSION_PREFIX}{version:06d}"


def write_adapter_info(directory: str | Path, version: int) -> None:
    """Record `version` in the adapter folder being written (call it inside the atomic write's fill)."""
    write_file_atomically(Path(directory) / ADAPTER_INFO, json.dumps({"version": int(version)}))


def adapter_version(directory: str | Path) -> int | None:
    """The version of the published adapter in `directory` (its `metaclaw_adapter.json`; a folder of the old
    layout: its `step-NNNNNN` name), else None (an imported or foreign adapter)."""
    path = Path(directory)
    try:
        info = json.loads((path / ADAPTER_INFO).read_text())
    except (OSError, ValueError):
        info = None
    if isinstance(info, dict) and isinstance(info.get("version"), int) and not isinstance(info["version"], bool):
        return info["version"]
    legacy = _LEGACY_NAME.match(path.name)
    return int(legacy.group("version")) if legacy else None


@dataclass(frozen=True)
class AdapterFolder:
    """Where one adapter's published versions and its served pointer live (`adapters/` or `adapters/agents/<id>`)."""

    path: Path

    @property
    def latest_path(self) -> Path:
        return self.path / LATEST

    def version_dir(self, version: int) -> Path:
        """Where version `version` is published (it may not exist yet)."""
        return self.path / version_dir_name(version)

    def imported_dir(self, stamp: str) -> Path:
        return self.path / f"imported-{stamp}"

    @property
    def import_record(self) -> Path:
        return self.path / IMPORT_RECORD

    @property
    def rewind_record(self) -> Path:
        return self.path / REWIND_RECORD

    def versions(self) -> list[tuple[int, Path]]:
        """`(version, folder)` of every published version on disk, oldest first."""
        found = []
        for d in self.path.glob(f"{_VERSION_PREFIX}*"):
            version = adapter_version(d) if d.is_dir() else None
            if version is not None:
                found.append((version, d))
        return sorted(found)

    def find(self, version: int) -> Path | None:
        """The folder of published version `version`, or None."""
        return next((d for v, d in self.versions() if v == version), None)

    def newest_at_or_before(self, version: int) -> tuple[int, Path] | None:
        covered = [(v, d) for v, d in self.versions() if v <= version]
        return covered[-1] if covered else None

    def leftovers(self) -> list[Path]:
        """What a kill mid-write leaves: `.step-NNNNNN-xxxx` temp folders and `.step-NNNNNN.old` copies."""
        return list(self.path.glob(f".{_VERSION_PREFIX}*"))

    def read_latest(self) -> dict[str, Any] | None:
        """The served pointer (None when there is none or it cannot be read)."""
        try:
            info = json.loads(self.latest_path.read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def write_latest(self, version: int, path: str | Path, name: str, **extra: Any) -> None:
        """Point the served pointer at the adapter in `path`, served as `name` at `version` (`extra`: what else the
        writer records: `rank_fingerprints`, `rolled_back`, `imported`): temp file, fsync, rename."""
        info = {"version": version, "path": str(path), "name": name, **extra}
        write_file_atomically(self.latest_path, json.dumps(info))


@dataclass(frozen=True)
class RunLayout:
    """A run directory's folders and files (the module docstring draws them)."""

    run_dir: Path

    def __init__(self, run_dir: str | Path) -> None:
        object.__setattr__(self, "run_dir", Path(run_dir))

    @property
    def adapters_root(self) -> Path:
        return self.run_dir / ADAPTERS

    def adapters(self, adapter: str = DEFAULT_ADAPTER) -> AdapterFolder:
        """The folder of the trainer's adapter `adapter` (`default`: `adapters/`; an agent's own:
        `adapters/agents/<id>`)."""
        root = self.adapters_root
        return AdapterFolder(root if adapter == DEFAULT_ADAPTER else root / AGENTS / adapter)

    def agent_folders(self) -> dict[str, AdapterFolder]:
        """Every agent's own adapter folder on disk, by agent id (sorted)."""
        root = self.adapters_root / AGENTS
        if not root.is_dir():
            return {}
        return {d.name: AdapterFolder(d) for d in sorted(root.iterdir()) if d.is_dir()}

    def all_adapters(self) -> dict[str, AdapterFolder]:
        """`default` and every agent's own folder on disk."""
        return {DEFAULT_ADAPTER: self.adapters(), **self.agent_folders()}

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINTS / CHECKPOINT

    @property
    def checkpoint_tmp(self) -> Path:
        """Where the checkpoint is written before it is renamed into place."""
        return self.checkpoint_path.with_suffix(".ckpt.tmp")

    @property
    def server_dir(self) -> Path:
        """The policy server the live loop starts: its config and log."""
        return self.server_dir_of("policy")

    @property
    def server_config(self) -> Path:
        return self.server_dir / f"{SERVER_CONFIG_NAME}.yaml"

    @property
    def server_log(self) -> Path:
        return self.server_dir / SERVER_LOG

    def server_dir_of(self, role: str) -> Path:
        """The folder of a server the live loop starts: `policy` (the agent's) or `eval` (evaluation's own)."""
        return self.run_dir / SERVER_ROLES[role]

    def leftovers(self) -> list[Path]:
        """Temp files and folders a kill mid-write leaves (adapters of every agent, the checkpoint's)."""
        found = [p for folder in self.all_adapters().values() for p in folder.leftovers()]
        return found + list((self.run_dir / CHECKPOINTS).glob("*.tmp"))
