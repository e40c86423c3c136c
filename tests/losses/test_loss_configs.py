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


def test_the_default_loss_stops_pushing_what_a_stale_batch_already_moved() -> None:
    """`train.py`'s default loss (every method, every rollout): on fresh samples (ratio 1) it is the plain
    importance-sampling gradient; on replies of an adapter the trainer has left behind, a token the trainer
    already pushed up under a positive advantage (ratio 3) or down under a negative one (ratio 0.3) gets no more
    gradient, where the unclipped loss would weigh it by the ratio (issue 24: samples 20-31 versions stale)."""
    from metaclaw.losses import ImportanceSamplingLoss

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="train")
    loss_fn = instantiate(cfg.loss)
    behaviour = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)

    def grad(fn, logprobs: torch.Tensor) -> torch.Tensor:
        lp = logprobs.clone().requires_grad_(True)
        fn(lp, behaviour, adv, mask).loss.backward()
        return lp.grad

    fresh = behaviour.clone()
    assert torch.allclose(grad(loss_fn, fresh), grad(ImportanceSamplingLoss(), fresh))
    moved = behaviour + torch.tensor([[1.0986, 0.0], [-1.204, 0.0]])  # ratios 3.0 (A > 0) and 0.3 (A < 0)
    g = grad(loss_fn, moved)
    assert g[0, 0] == 0 and g[1, 0] == 0  # already moved the way the advantage asks: no further push
    assert g[0, 1] != 0 and g[1, 1] != 0  # the unmoved tokens still learn
    assert grad(ImportanceSamplingLoss(), moved)[0, 0].abs() > 2.5 * g[0, 1].abs()  # unclipped: weighted by 3
