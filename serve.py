"""Serve: `python serve.py` (policy server) or `python serve.py app=training_server` (seed 000's API)."""

import logging

import hydra
from hydra.utils import get_method
from omegaconf import DictConfig

from metaclaw.config import register_resolvers
from metaclaw.lifecycle import bind_children, bind_to_launcher, bind_to_spawning_parent
from metaclaw.profiling import start_from_env
from metaclaw.runfiles import private_umask, protect_run

register_resolvers()
private_umask()  # run dir, logs, adapters and checkpoints: 0700 / 0600

if __name__ == "__mp_main__":  # a LitServe worker (multiprocessing spawn re-imports this script): die with us
    bind_to_spawning_parent()


@hydra.main(version_base="1.3", config_path="conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    from metaclaw.devices import resolve_devices

    logging.getLogger("metaclaw").setLevel(logging.INFO)
    bind_to_launcher()  # started by train.py: die with it
    bind_children()  # LitServe's forked children die with this process
    start_from_env("server")  # bench/cycle_profile.py
    resolve_devices(cfg)
    protect_run(cfg)  # keys given as overrides leave the .hydra/ dumps
    get_method(cfg.app.entry)(cfg)


if __name__ == "__main__":
    main()
