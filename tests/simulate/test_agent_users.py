"""Several simulated users, each its own agent: settings inherit from the main user; a preference preset fits as
it is; one adapter is evaluated against one user's preference."""

from __future__ import annotations

import pytest

from metaclaw.loop.eval_wiring import build_evaluator, simulated_agents
from metaclaw.simulate.agents import SimulatedUsers, user_settings
from tests.entrypoints.test_train import compose_train

ALICE = ("+agents.alice.mode=rl", "+preference@rollout.simulated_user.agents.alice=opening")


def test_agent_users_inherit_the_main_users_settings_and_bring_their_preference(tmp_path):
    cfg = compose_train(tmp_path, "rollout=simulated_user", "preference=number", *ALICE,
                        "+rollout.simulated_user.agents.bob.concurrency=1")  # fmt: skip
    from omegaconf import OmegaConf

    main, alice, bob = user_settings(OmegaConf.to_container(cfg.rollout.simulated_user, resolve=True))
    assert main["agent_id"] == "simulated-user" and main["preferences"] == [{"kind": "gives_number"}]
    assert alice["agent_id"] == "alice" and alice["preferences"] == [{"kind": "starts_with", "text": "Sure thing:"}]
    assert alice["max_tokens"] == main["max_tokens"] and alice["seed"] != main["seed"]
    assert bob["preferences"] == main["preferences"] and (bob["concurrency"], main["concurrency"]) == (1, 2)
    users = SimulatedUsers("http://127.0.0.1:9/v1", OmegaConf.to_container(cfg.rollout.simulated_user, resolve=True))
    assert [u.agent_id for u in users.users] == ["simulated-user", "alice", "bob"]
    assert set(users.stats["agents"]) == {"simulated-user", "alice", "bob"} and users.stats["replies"] == 0
    # the evaluation: alice's adapter against alice's preference, the default one against the main user's;
    # bob trains the default adapter too, which is evaluated against one preference only: refused, naming both
    with pytest.raises(ValueError, match=r"'simulated-user' and 'bob' both train the adapter of agent 'default'"):
        simulated_agents(cfg)
    cfg = compose_train(tmp_path, "rollout=simulated_user", *ALICE)
    agents = simulated_agents(cfg)
    assert set(agents) == {"default", "alice"} and agents["alice"]["agent_id"] == "alice"
    assert build_evaluator(cfg) is not None


def test_agent_users_refuse_bad_entries_naming_them():
    with pytest.raises(ValueError, match=r"rollout\.simulated_user\.agents\.alice sets both"):
        user_settings({"agent_id": "u", "agents": {"alice": {"rules": [], "preferences": []}}})
    with pytest.raises(ValueError, match=r"rollout\.simulated_user\.agents\.alice must be a mapping"):
        user_settings({"agent_id": "u", "agents": {"alice": "opening"}})
    with pytest.raises(ValueError, match="its own agent id"):
        user_settings({"agent_id": "alice", "agents": {"alice": {}}})
