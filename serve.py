"""Serve: `python serve.py` (policy server) or `python serve.py app=training_server` (seed 000's API)."""

import logging

import hydra
from hydra.utils import get_method
from omegaconf import DictConfig

from metaclaw.config import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    logging.getLogger("metaclaw").setLevel(logging.INFO)
    get_method(cfg.app.entry)(cfg)


if __name__ == "__main__":
    main()
