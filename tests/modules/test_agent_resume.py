"""Per-agent publishing, checkpoints and resume through `train()` (rollout=store, tiny model, scripted server).

Each adapter is published to its own directory with its own `latest.json` and hot-loaded under its own name; a
resumed run serves each agent's newest adapter again (not only the default one), and so does the watchdog
after a policy server restart (`reload_latest_adapter`)."""

from __future__ import annotations

import json

from metaclaw.loop.live import reload_latest_adapter
from metaclaw.rollout.server import ThreadedServer
from metaclaw.rollout.testing import scripted_upstream
from metaclaw.store import Sample, SampleStore
from metaclaw.training import train
from metaclaw.wire.client import Endpoint
from tests.entrypoints.test_train import compose_train

AGENTS = ("+agents.alice.mode=rl", "data.batch_size=2", "rollout.wait_timeout_s=1")


def _fill(store: SampleStore, agents: list[str]) -> None:
    for i, agent in enumerate(agents):
        reward = 1.0 if i % 2 else -1.0
        store.insert(Sample([1, 2, 3], [4, 5, 6], [-1.0] * 3, agent_id=agent, reward=reward, status="ready"))


def test_agent_adapters_are_published_apart_and_served_again_on_resume(tmp_path):
    store = SampleStore(tmp_path / "samples.sqlite")
    _fill(store, ["alice", "alice", "carol", "default", "alice", "alice", "default", "carol"])
    with ThreadedServer(scripted_upstream()) as first:
        metrics, objs = train(compose_train(tmp_path, *AGENTS, "trainer.max_steps=2",
                                            f"publish.server_url={first.url}"))  # fmt: skip
        loaded = dict(first.server.config.app.state.scripted["adapters"])
    adapters = tmp_path / "adapters"
    assert metrics["train/global_step"] == 2
    assert sorted(p.name for p in (adapters / "agents" / "alice").glob("step-*")) == ["step-000001"]
    assert sorted(p.name for p in adapters.glob("step-*")) == ["step-000002"]
    assert loaded == {"policy:alice": str((adapters / "agents" / "alice" / "step-000001").resolve()),
                      "policy": str((adapters / "step-000002").resolve())}  # fmt: skip
    latest = json.loads((adapters / "agents" / "alice" / "latest.json").read_text())
    assert latest["name"] == "policy:alice" and latest["version"] == 1
    assert "agent/alice/train/samples" in metrics and "agent/default/train/samples" in metrics

    # a new server: the resumed run serves both agents' newest adapters again before it trains alice at step 3
    with ThreadedServer(scripted_upstream()) as second:
        metrics, objs = train(compose_train(tmp_path, *AGENTS, "trainer.max_steps=3",
                                            f"publish.server_url={second.url}"))  # fmt: skip
        loaded = dict(second.server.config.app.state.scripted["adapters"])
    assert metrics["train/global_step"] == 3
    assert loaded["policy"] == str((adapters / "step-000002").resolve())  # served again, not trained since
    assert loaded["policy:alice"] == str((adapters / "agents" / "alice" / "step-000003").resolve())
    assert objs["publisher"].agents.served_versions()["alice"] > 0

    # the watchdog, after a server restart, reloads every agent's latest adapter
    with ThreadedServer(scripted_upstream()) as restarted:
        reload_latest_adapter(tmp_path, Endpoint(restarted.url))
        assert set(restarted.server.config.app.state.scripted["adapters"]) == {"policy", "policy:alice"}
