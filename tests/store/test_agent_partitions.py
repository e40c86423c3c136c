"""Many agents in the store: a claimed batch holds one adapter's samples; staleness counts per adapter."""

from __future__ import annotations

import threading

from metaclaw.agents import AgentProfiles, check_agent_modes
from metaclaw.datamodules.rollout import StreamingSampleDataset
from tests.store.conftest import make

AGENTS = AgentProfiles({"alice": {"mode": "rl"}, "bob": {"mode": "rl"}})


def _fill(store, agents: list[str], version: int = 0) -> None:
    for a in agents:
        store.insert(make(agent_id=a, status="ready", adapter_version=version))


def test_agent_batches_hold_one_adapter_each_longest_waiting_adapter_first(store):
    _fill(store, ["alice", "carol", "alice", "bob", "default", "alice"])
    claim = lambda step: store.claim_batch(step, 8, partition=AGENTS.adapter_of)  # noqa: E731
    first, second, third = claim(0), claim(1), claim(2)
    # the adapter whose oldest sample waited longest goes first; a batch is its newest samples first
    assert [s.agent_id for s in first] == ["alice", "alice", "alice"]
    assert [s.id for s in first] == [6, 3, 1]
    assert [s.agent_id for s in second] == ["default", "carol"]  # not listed: both train the default adapter
    assert [s.agent_id for s in third] == ["bob"]
    assert claim(3) == [] and [s.id for s in claim(1)] == [s.id for s in second]  # idempotent per step


def test_without_partition_a_batch_mixes_agents_as_before(store):
    _fill(store, ["alice", "bob", "carol"])
    assert [s.agent_id for s in store.claim_batch(0, 8)] == ["carol", "bob", "alice"]  # newest first


def test_agent_staleness_counts_against_each_adapters_own_served_version(store):
    _fill(store, ["alice"], version=3)  # alice's adapter is served at v3: fresh
    _fill(store, ["default"], version=3)  # the default adapter is served at v9: stale with max_staleness 2
    floors = {"alice": 3 - 2, "default": 9 - 2}
    batch = store.claim_batch(0, 8, min_adapter_version=floors, partition=AGENTS.adapter_of)
    assert [s.agent_id for s in batch] == ["alice"]
    assert store.claim_batch(1, 8, min_adapter_version=floors, partition=AGENTS.adapter_of) == []
    assert store.dropped_reasons() == {"stale": 1}


def test_agent_windows_outside_a_window_only_rl_agents_adapters_step(store):
    """mode=auto with `bob: rl`: while the window is closed bob's adapter steps, alice's (auto) waits for it."""
    _fill(store, ["alice", "bob", "alice"])
    window = {"open": False, "checked_closed": 0}

    def ungated():
        window["checked_closed"] += not window["open"]
        return window["open"], {"bob"}

    ds = StreamingSampleDataset(store.path, lambda: 0, pad_id=0, batch_size=8, max_tokens=None,
                                max_sample_tokens=None, wait_timeout_s=0.5, gate=lambda: True,
                                partition=AGENTS.adapter_of, ungated=ungated)  # fmt: skip
    batches = iter(ds)
    first = next(batches)
    assert first["adapter"] == "bob" and first["sample_ids"].tolist() == [2]  # alice is older but outside a window
    opener = threading.Timer(1.5, lambda: window.update(open=True))  # longer than wait_timeout_s: closed time
    opener.start()  # does not count as "no samples"
    second = next(batches)
    assert second["adapter"] == "alice" and second["sample_ids"].tolist() == [3, 1]  # newest first
    assert window["checked_closed"] >= 2


def test_agent_modes_mix_rl_and_auto_under_a_scheduler():
    mixed = AgentProfiles({"default": {"mode": "auto"}, "alice": {"mode": "auto"}, "bob": {"mode": "rl"}})
    check_agent_modes(mixed, "auto")
    assert mixed.ungated_adapters("auto") == {"bob"} and mixed.needs_scheduler("auto")
    # mode=rl with an `auto` agent: the run gets a scheduler, and its `rl` agents (the default one too) never wait
    in_rl = AgentProfiles({"default": {"mode": "rl"}, "alice": {"mode": "auto"}, "bob": {"mode": "rl"}})
    check_agent_modes(in_rl, "rl")
    assert in_rl.needs_scheduler("rl") and in_rl.ungated_adapters("rl") == {"default", "bob"}
    plain = AgentProfiles({"default": {"mode": "rl"}, "bob": {"mode": "rl"}})
    assert not plain.needs_scheduler("rl") and plain.ungated_adapters("rl") == set()


def test_agent_auto_in_a_mode_rl_run_trains_only_inside_windows(tmp_path):
    """`mode=rl +agents.alice.mode=auto`: train() builds the `scheduler` node; with every window closed the
    default agent (rl) trains and alice's samples wait, ready, for a window."""
    from metaclaw.store import SampleStore
    from metaclaw.training import train
    from tests.entrypoints.test_train import compose_train

    store = SampleStore(tmp_path / "samples.sqlite")
    for i, agent in enumerate(["alice", "default", "alice", "default", "default", "default", "default", "default"]):
        store.insert(make(agent_id=agent, status="ready", reward=1.0 if i % 2 else -1.0))
    # closed: no sleep hours, and the user (the proxy's last request: at start) active for 30 minutes yet
    closed = ("scheduler.sleep_start=null", "scheduler.sleep_end=null", "scheduler.idle_source=proxy",
              "scheduler.poll_s=0.1")  # fmt: skip
    cfg = compose_train(tmp_path, "mode=rl", "+agents.alice.mode=auto", "data.batch_size=2",
                        "rollout.wait_timeout_s=1", "trainer.max_steps=2", *closed)  # fmt: skip
    metrics, objs = train(cfg)
    assert metrics["train/global_step"] == 2
    assert objs["scheduler"] is not None and objs["scheduler"].ungated == {"default"}
    assert not objs["scheduler"].refresh().open
    trained = {s.agent_id for s in store.select() if s.status == "consumed"}
    assert trained == {"default"}
    assert all(s.status == "ready" for s in store.select(agent_id="alice"))
    assert not (tmp_path / "adapters" / "agents" / "alice").exists()
