"""`loss_fn_config`: a typed schema per loss; trusted defaults from the config, request values as plain kwargs."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from metaclaw.config import CONFIG_DIR, register_resolvers
from metaclaw.losses import CISPOLoss, ImportanceSamplingLoss, PPOLoss
from metaclaw.training_server.errors import ApiError
from metaclaw.training_server.loss_registry import LossRegistry

CONF = CONFIG_DIR


@pytest.fixture(scope="module")
def registry() -> LossRegistry:
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("serve", overrides=["app=training_server", "model=tiny"])
    return LossRegistry(cfg.app.losses)


def test_defaults_come_from_the_server_config(registry: LossRegistry) -> None:
    assert registry.names == ["importance_sampling", "ppo", "cispo", "cross_entropy"]
    assert registry.build("cross_entropy").aggregation == "sum"  # Tinker's cross_entropy: -Σ w·logp
    ppo = registry.build("ppo")
    assert isinstance(ppo, PPOLoss) and (ppo.clip_low, ppo.clip_high, ppo.aggregation) == (0.2, 0.2, "sum")
    assert isinstance(registry.build("importance_sampling"), ImportanceSamplingLoss)
    cispo = registry.build("cispo", {})
    assert isinstance(cispo, CISPOLoss) and (cispo.clip_low, cispo.clip_high) == (1.0, 3.0)


def test_tinker_thresholds_map_to_epsilons(registry: LossRegistry) -> None:
    ppo = registry.build("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    assert ppo.clip_low == pytest.approx(0.2) and ppo.clip_high == pytest.approx(0.28)
    cispo = registry.build("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 5, "aggregation": "token-mean"})
    assert (cispo.clip_low, cispo.clip_high, cispo.aggregation) == (1.0, 4.0, "token-mean")


@pytest.mark.parametrize(
    ("loss", "config", "field"),
    [
        ("ppo", {"_target_": "pathlib.Path"}, "loss_fn_config._target_"),
        ("ppo", {"aggregation": "${oc.env:HOME}"}, "loss_fn_config.aggregation"),
        ("ppo", {"clip_low": "${oc.env:HOME}"}, "loss_fn_config.clip_low"),
        ("ppo", {"clip_low": {"_target_": "os.getcwd"}}, "loss_fn_config.clip_low"),
        ("ppo", {"clip_high": True}, "loss_fn_config.clip_high"),
        ("ppo", {"clip_high_threshold": 0.5}, "loss_fn_config.clip_high_threshold"),
        ("cispo", {"clip_low": -0.1}, "loss_fn_config.clip_low"),
        ("importance_sampling", {"clip_high": 0.2}, "loss_fn_config.clip_high"),
        ("dpo", {}, "loss_fn"),
    ],
)
def test_anything_undeclared_is_400_naming_the_field(registry: LossRegistry, loss, config, field) -> None:
    with pytest.raises(ApiError) as err:
        registry.build(loss, config)
    assert err.value.status == 400 and err.value.param == field, err.value.message
