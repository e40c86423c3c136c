"""A run's files are private: the store holds every conversation, the logs and adapters are learned from them, and
the config may hold keys. `train.py` and `serve.py` set the umask to 077 before Hydra creates the run directory, and
`protect_run_dir` (called by `train()` and `serve.py`) makes what already exists 0700 (folders) / 0600 (files), so
a run started any other way is private too.

Keys belong in the environment (`METACLAW_API_KEY`, `METACLAW_PROXY_API_KEY`, ...): a key given as a Hydra
override is in `ps` for every user of the machine while the run lasts (that cannot be undone from inside the
process: it is logged as a warning), and is removed from the run's `.hydra/` dumps (`overrides.yaml`,
`config.yaml`, `hydra.yaml`), from the W&B run name (`hydra.job.config.override_dirname.exclude_keys`) and from
W&B's system metadata (which records the command line: turned off for such a run).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
REDACTED = "<redacted>"
# An override whose last key names a credential: serve.api_key=..., +judge.token=..., app.secret=...
_SECRET_KEY_RE = re.compile(r"^[+~]*(?P<key>[\w.@/-]*?(?:api_key|_key|token|secret|password))=(?P<value>.+)$", re.I)
HYDRA_DUMPS = ("overrides.yaml", "config.yaml", "hydra.yaml")


def private_umask() -> None:
    """Files and folders this process (and its children) create from now on: 0600 / 0700."""
    os.umask(PRIVATE_UMASK)


def protect_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """umask 077, then chmod `run_dir` and everything under it to 0700 folders / 0600 files (symlinks untouched)."""
    private_umask()
    root = Path(run_dir)
    if not root.is_dir():
        return
    for path in [root, *root.rglob("*")]:
        try:
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            wanted = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
            if stat.S_IMODE(st.st_mode) != wanted:
                path.chmod(wanted)
        except OSError:  # a file removed meanwhile (a temp file renamed away)
            continue


def secret_overrides(overrides: list[str]) -> dict[str, str]:
    """`{key: value}` for every override of `overrides` that sets a credential."""
    found = {}
    for item in overrides:
        match = _SECRET_KEY_RE.match(str(item).strip())
        if match and match.group("value").strip() not in ("", "null", "None"):
            found[match.group("key")] = match.group("value").strip().strip("'\"")
    return found


def redact_hydra_dumps(hydra_dir: str | os.PathLike[str], secrets: dict[str, str]) -> list[Path]:
    """Replace each secret value in the `.hydra/` dumps with `<redacted>`; returns the files changed."""
    changed = []
    values = sorted({v for v in secrets.values() if len(v) >= 4}, key=len, reverse=True)
    for name in HYDRA_DUMPS:
        path = Path(hydra_dir) / name
        try:
            text = path.read_text()
        except OSError:
            continue
        new = text
        for value in values:
            new = new.replace(value, REDACTED)
        if new != text:
            from metaclaw.atomic import write_file_atomically

            write_file_atomically(path, new)
            changed.append(path)
    return changed


def protect_run(cfg: Any) -> None:
    """What `train()` and `serve.py` call first: private modes for the run dir, keys out of its Hydra dumps."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import OmegaConfBaseException

    try:
        run_dir = cfg.get("run_dir") if hasattr(cfg, "get") else None
    except OmegaConfBaseException:
        run_dir = None
    hydra_dir, overrides = None, []
    try:
        if HydraConfig.initialized():
            hc = HydraConfig.get()
            overrides = list(hc.overrides.task)
            if hc.output_subdir:
                hydra_dir = Path(hc.runtime.output_dir) / str(hc.output_subdir)
    except (ValueError, AttributeError, OmegaConfBaseException):  # composed without a Hydra run (tests)
        pass
    secrets = secret_overrides(overrides)
    if secrets:
        log.warning(
            "%s given on the command line: every user of this machine sees it in `ps` while this process runs. "
            "Set it in the environment instead (METACLAW_API_KEY, METACLAW_PROXY_API_KEY, METACLAW_JUDGE_API_KEY, "
            "...). It is removed from the run's .hydra/ files and W&B run name; W&B's system metadata (which "
            "records the command line) is off for this run.", ", ".join(sorted(secrets))
        )  # fmt: skip
        if hydra_dir is not None:
            redact_hydra_dumps(hydra_dir, secrets)
        # W&B records the command line in its system metadata: off for a run whose command line holds a key.
        os.environ.setdefault("WANDB__DISABLE_META", "true")
    if run_dir:
        protect_run_dir(run_dir)
