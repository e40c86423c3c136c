"""Train the LoRA adapter: `python train.py [method=rl|opd|combine] [model=...] ['devices.train=[0,1]']`."""

import logging

import hydra
from omegaconf import DictConfig

from metaclaw.config import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from metaclaw.training import train

    logging.getLogger("metaclaw").setLevel(logging.INFO)
    metrics, _ = train(cfg)
    return metrics.get("loss/total")


if __name__ == "__main__":
    main()
