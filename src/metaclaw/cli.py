"""The `metaclaw` command: `metaclaw train|serve [Hydra overrides]` and the control commands of a running service.

`train` and `serve` compose the config tree shipped in the package (`pkg://metaclaw.conf`), so they run the same
from a clone, a wheel or a sweep; the repository's `train.py` and `serve.py` call `train_main` / `serve_main` here.
Every other subcommand is `metaclaw.control.cli` (status, pause, ..., forget, dashboard, skills) or
`metaclaw.export.cli` (export, import). `python -m metaclaw ...` is the same command.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from metaclaw.config import CONFIG_DIR, CONFIG_PATH, ConfigError, register_resolvers
from metaclaw.ops.logs import configure_logging
from metaclaw.runfiles import private_umask

HYDRA_COMMANDS = ("train", "serve")
CONTROL_COMMANDS = ("status", "pause", "resume", "train-now", "rollback", "dashboard", "forget", "skills")
EXPORT_COMMANDS = ("export", "import")
OBJECTIVE = "heldout/final_compliance"  # train()'s metric a sweep maximises
_ARGV: list[str] | None = None  # the command line as typed, given back to sys.argv once Hydra has parsed it


def hydra_setup(config_name: str | None = None) -> None:
    """Resolvers and a private umask; with `config_name` (`train`, `serve`), the command line's overrides are
    checked first: a mistyped key, an unknown option, a wrong type or a busy port is one line (exit 2), before
    Hydra runs and before any model loads (`metaclaw.ops.precheck`)."""
    register_resolvers()
    if config_name and os.environ.get("LOCAL_RANK", "0") == "0":  # a DDP rank re-runs the command: checked once
        from metaclaw.ops.precheck import check_command_line

        check_command_line(config_name, sys.argv[1:], config_groups())
    private_umask()  # the run dir Hydra is about to create, and all in it, is the user's alone (0700 / 0600)


def _restore_argv() -> None:
    """Lightning's DDP launcher re-runs `sys.argv`: it must hold `metaclaw train ...`, not Hydra's view of it."""
    if _ARGV is not None:
        sys.argv[:] = _ARGV


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def train_main(cfg: DictConfig) -> float | None:
    """`metaclaw train` / `python train.py`: `train(cfg)`; the held-out objective is what a sweeper optimises."""
    from metaclaw.devices import DevicePlanError
    from metaclaw.lifecycle import die_with_parent
    from metaclaw.profiling import start_from_env
    from metaclaw.stopping import RunFailed
    from metaclaw.training import train

    _restore_argv()
    configure_logging(cfg.get("log"))  # Lightning once, no adverts, log=json (metaclaw.ops.logs)
    if os.environ.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ:
        die_with_parent()  # a DDP rank Lightning started: it goes when rank 0 goes
    start_from_env("train")
    try:
        metrics, _ = train(cfg)
    except RunFailed as err:
        logging.getLogger("metaclaw").error("Run stopped: %s", err)
        sys.exit(1)
    except (ConfigError, DevicePlanError) as err:  # rules between fields, the device plan: one line, no traceback
        logging.getLogger("metaclaw").error("Config: %s", err)
        sys.exit(2)
    return objective(metrics)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="serve")
def serve_main(cfg: DictConfig) -> None:
    """`metaclaw serve` / `python serve.py`: the policy server, or `app=training_server`."""
    from hydra.utils import get_method

    from metaclaw.devices import DevicePlanError, resolve_devices
    from metaclaw.lifecycle import bind_children, bind_to_launcher
    from metaclaw.profiling import start_from_env
    from metaclaw.runfiles import protect_run

    _restore_argv()
    configure_logging(cfg.get("log"))
    bind_to_launcher()  # started by `metaclaw train`: die with it
    bind_children()  # LitServe's forked children die with this process (its spawned worker binds in setup())
    start_from_env("server")  # bench/perf/cycle_profile.py
    try:
        resolve_devices(cfg)
    except DevicePlanError as err:
        logging.getLogger("metaclaw").error("Config: %s", err)
        sys.exit(2)
    protect_run(cfg)  # keys given as overrides leave the .hydra/ dumps
    get_method(cfg.app.entry)(cfg)


def objective(metrics: dict) -> float | None:
    """What a Hydra sweeper optimises (maximise): held-out compliance of the final adapter (the judge's held-out
    score when the preference is judged), `heldout/final_compliance`; None when the run measured none (eval=off)."""
    value = metrics.get(OBJECTIVE)
    if value is None:
        logging.getLogger("metaclaw").warning("No held-out evaluation finished: the run has no objective (%s)",
                                              OBJECTIVE)  # fmt: skip
    return value


def config_groups(root: Path = CONFIG_DIR) -> dict[str, list[str]]:
    """`{group: [option, ...]}` of the shipped config tree (what `group=option` accepts)."""
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(root.iterdir())
        if d.is_dir() and any(d.glob("*.yaml"))
    }


def usage() -> str:
    groups = "\n".join(f"  {name:<12} {', '.join(options)}" for name, options in config_groups().items())
    return f"""usage: metaclaw COMMAND [ARGS]

Self-hosted online learning for LLM agents.

Run:
  train        train the LoRA adapter (the demo by default; `rollout=proxy` is the live service)
  serve        the policy server (`app=training_server`: the remote training / Tinker API)
  models       the embedded models (`models install`: the one explicit step after `pip install metaclaw`)
  Both take Hydra overrides (`metaclaw train model=tiny trainer.max_steps=2`, `-m` for a sweep, `--cfg job`
  to print the composed config, `--help` for Hydra's help).

Control a running service (`metaclaw COMMAND --help`):
  status       window, samples waiting, steps, adapter, evaluation (`--watch`)
  pause        stop training (survives restarts)
  resume       let the scheduler's windows decide again
  train-now    open a training window now
  rollback     serve an earlier step's adapter again
  skills       review skills (list, pending, approve, reject)
  forget       remove a user's or agent's data
  dashboard    serve a finished run's dashboard
  export       write an agent's adapter (peft, merged, gguf-lora, ollama)
  import       make an external PEFT LoRA an agent's adapter

Config groups (GROUP=OPTION; the files are in {CONFIG_DIR}):
{groups}
"""


def main(argv: list[str] | None = None) -> int:
    """The console script."""
    global _ARGV
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    if command in (None, "-h", "--help", "help"):
        print(usage())
        return 0
    if command in ("-V", "--version"):
        from metaclaw import __version__

        print(f"metaclaw {__version__}")
        return 0
    if command in HYDRA_COMMANDS:
        _ARGV = [sys.argv[0], *argv]
        sys.argv[:] = [sys.argv[0], *argv[1:]]  # Hydra parses the overrides from sys.argv
        try:
            hydra_setup(command)
            (train_main if command == "train" else serve_main)()
        finally:
            _restore_argv()
            _ARGV = None
        return 0
    if command.startswith("-"):  # options first (`metaclaw --run-dir DIR status`): the command is a later word
        command = next((a for a in argv if a in CONTROL_COMMANDS or a in EXPORT_COMMANDS), command)
    if command in EXPORT_COMMANDS or command in CONTROL_COMMANDS:
        private_umask()  # what import / export / forget write (adapters, records, logs) is the user's alone
    if command == "models":
        from metaclaw.ops.embedded import main as models_main

        return models_main(argv)
    if command in EXPORT_COMMANDS:
        from metaclaw.export.cli import main as export_main

        return export_main(argv)
    if command in CONTROL_COMMANDS:
        from metaclaw.control.cli import main as control_main

        return control_main(argv)
    print(f"metaclaw: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
    return 2
