"""Every conf/method option composes, instantiates its advantage estimator and runs on a tiny batch."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from metaclaw.config import CONFIG_DIR, register_resolvers

register_resolvers()

CONF = CONFIG_DIR
OPTIONS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
NEEDS = {"rl": (True, False), "opd": (False, True), "combine": (True, True)}


def test_expected_options_exist() -> None:
    assert set(NEEDS) <= set(OPTIONS)


@pytest.mark.parametrize("option", OPTIONS)
def test_compose_and_run(option: str) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(overrides=[f"+method={option}"])
    assert cfg.method.name == option
    assert isinstance(cfg.method.needs_reward, bool) and isinstance(cfg.method.needs_teacher, bool)
    if option in NEEDS:
        assert (cfg.method.needs_reward, cfg.method.needs_teacher) == NEEDS[option]
    estimator = instantiate(cfg.method.advantage)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    batch = {  # every sample carries both signals, so any method can read what it needs
        "mask": mask,
        "behaviour_logprobs": torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -0.3, -0.4]]),
        "teacher_logprobs": torch.tensor([[-0.5, -0.5, -1.0], [-0.4, -0.1, -0.4]]),
        "reward": torch.tensor([1.0, -1.0]),
        "has_reward": torch.tensor([True, True]),
        "has_teacher": torch.tensor([True, True]),
    }
    adv, metrics = estimator(batch)
    assert adv.shape == mask.shape and torch.isfinite(adv).all()
    assert torch.equal(adv[mask == 0], torch.zeros(1))
    assert all(v.dim() == 0 for v in metrics.values())
