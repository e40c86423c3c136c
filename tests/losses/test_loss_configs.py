"""Every conf/loss option composes, instantiates and runs on a tiny batch."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from metaclaw.config import CONFIG_DIR
from metaclaw.losses import LossOutput

CONF = CONFIG_DIR
OPTIONS = sorted(p.stem for p in (CONF / "loss").glob("*.yaml"))


def test_expected_options_exist() -> None:
    assert {"importance_sampling", "ppo", "cispo"} <= set(OPTIONS)


@pytest.mark.parametrize("option", OPTIONS)
def test_compose_and_run(option: str) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(overrides=[f"+loss={option}"])
    loss_fn = instantiate(cfg.loss)
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]], requires_grad=True)
    behaviour = torch.tensor([[-0.6, -0.9, -2.0], [-0.1, -0.3, -0.3]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = loss_fn(logprobs, behaviour, adv, mask)
    assert isinstance(out, LossOutput)
    out.loss.backward()
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad.abs().sum() > 0
    assert all(v.dim() == 0 and not v.requires_grad for v in out.metrics.values())
