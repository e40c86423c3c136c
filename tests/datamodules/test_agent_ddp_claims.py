"""Several agents under DDP: the partition rule that makes every rank train the same adapter in a step.

Every rank claims step N from the store; the first claim of a step picks the adapter whose oldest ready sample
is oldest and claims only its samples (its newest first), later claims of that step (the other ranks) get the
same rows, whatever arrived in between. Each rank keeps its slice. An adapter with fewer ready samples than
ranks does not hold up the others."""

from __future__ import annotations

import pytest

from metaclaw.agents import AgentProfiles
from metaclaw.datamodules.rollout import StreamingSampleDataset
from metaclaw.modules.agent_state import same_adapter
from metaclaw.store import Sample, SampleStore

AGENTS = AgentProfiles({"alice": {"mode": "rl"}, "bob": {"mode": "rl"}})


def _add(store: SampleStore, *agents: str) -> None:
    for a in agents:
        store.insert(Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], behaviour_logprobs=[-1.0] * 3, agent_id=a,
                            reward=1.0, status="ready"))  # fmt: skip


def _ranks(path, world_size: int = 2, batch_size: int = 4):
    return [iter(StreamingSampleDataset(path, lambda: 0, pad_id=0, batch_size=batch_size, max_tokens=None,
                                        max_sample_tokens=None, wait_timeout_s=0.3, rank=r, world_size=world_size,
                                        partition=AGENTS.adapter_of)) for r in range(world_size)]  # fmt: skip


def _ids(batch) -> list[int]:
    return batch["sample_ids"].tolist()


def test_agent_ranks_train_the_same_adapter_whichever_rank_claims_first(tmp_path):
    store = SampleStore(tmp_path / "samples.sqlite")
    _add(store, "alice", "carol", "alice", "bob", "carol", "alice", "bob")  # ids 1..7; carol: the default adapter
    rank0, rank1 = _ranks(store.path)
    steps = []
    for first in (1, 0, 1):  # which rank reaches the store first changes from step to step
        one = next(rank1 if first else rank0)
        _add(store, "bob")  # arrives between the two ranks' claims of the step: it cannot change the step
        other = next(rank0 if first else rank1)
        b0, b1 = (other, one) if first else (one, other)
        assert b0["adapter"] == b1["adapter"] and b0["group_tokens"] == b1["group_tokens"]
        steps.append((b0["adapter"], _ids(b0), _ids(b1)))
    # the adapter with the oldest ready sample first: alice (id 1), then carol (2), then bob (4); each batch is
    # that adapter's newest samples first; rank r keeps samples r, r+2, ...
    assert steps == [("alice", [6, 1], [3]), ("default", [5], [2]), ("bob", [9, 7], [8, 4])]
    store.close()


def test_agent_with_fewer_samples_than_ranks_does_not_hold_up_the_others(tmp_path):
    store = SampleStore(tmp_path / "samples.sqlite")
    _add(store, "alice", "bob", "bob", "bob")  # alice's one sample cannot give each of 2 ranks one
    rank0, rank1 = _ranks(store.path)
    b1, b0 = next(rank1), next(rank0)
    assert (b0["adapter"], b1["adapter"], _ids(b0), _ids(b1)) == ("bob", "bob", [4, 2], [3])
    _add(store, "alice")  # now she has one per rank, and hers is still the oldest
    b0, b1 = next(rank0), next(rank1)
    assert (b0["adapter"], _ids(b0), _ids(b1)) == ("alice", [5], [1])
    store.close()


def test_agent_ranks_that_disagree_stop_the_step_naming_each_rank():
    names = ["default", "alice", "bob"]
    assert same_adapter(names, [1, 1]) == "alice"
    with pytest.raises(RuntimeError, match=r"rank 0: alice, rank 1: bob"):
        same_adapter(names, [1, 2])
    with pytest.raises(RuntimeError, match=r"rank 1: unknown"):
        same_adapter(names, [0, -1])
