"""Train the LoRA adapter: `python train.py [method=rl|opd|combine] [model=...] ['devices.train=[0,1]']`."""

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from metaclaw.config import register_resolvers
from metaclaw.runfiles import private_umask

register_resolvers()
private_umask()  # the run dir Hydra is about to create, and all in it, is the user's alone (0700 / 0600)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from metaclaw.lifecycle import die_with_parent
    from metaclaw.profiling import start_from_env
    from metaclaw.stopping import RunFailed
    from metaclaw.training import train

    logging.getLogger("metaclaw").setLevel(logging.INFO)
    if os.environ.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ:
        die_with_parent()  # a DDP rank Lightning started: it goes when rank 0 goes
    start_from_env("train")
    try:
        metrics, _ = train(cfg)
    except RunFailed as err:
        logging.getLogger("metaclaw").error("Run stopped: %s", err)
        sys.exit(1)
    return metrics.get("loss/total")


if __name__ == "__main__":
    main()
