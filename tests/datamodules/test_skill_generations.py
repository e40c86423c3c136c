"""Support/query separation: once evolution bumped an agent's skill generation, samples gathered under the older
generation are kept out of training batches (dropped with the reason recorded), per agent; configurable."""

from __future__ import annotations

import pytest

from metaclaw.datamodules.rollout import StreamingSampleDataset
from metaclaw.store import Sample, SampleStore


def sample(agent: str, generation: int | None, status: str = "ready") -> Sample:
    meta = {} if generation is None else {"skill_generation": generation}
    return Sample(prompt_ids=[1, 2], response_ids=[3], behaviour_logprobs=[-0.5], reward=1.0, agent_id=agent,
                  status=status, meta=meta)  # fmt: skip


@pytest.fixture
def store(tmp_path):
    s = SampleStore(tmp_path / "samples.sqlite")
    yield s
    s.close()


def test_older_generation_samples_are_dropped_per_agent(store):
    ids = store.insert_many([
        sample("a", 0), sample("a", 0), sample("a", 1),  # agent a evolved once
        sample("b", 0),  # agent b never evolved: generation 0 is its newest
        sample("c", None),  # skills off: never filtered
        sample("a", 2, status="pending"),  # a captured sample under generation 2, not scored yet
    ])  # fmt: skip
    batch = store.claim_batch(0, 10, latest_skill_generation_only=True)
    assert [s.id for s in batch] == [ids[4], ids[3]]  # newest first
    dropped = store.select("dropped")
    assert [s.id for s in dropped] == ids[:3]
    assert dropped[0].meta["dropped"] == "old_skill_generation:0<2"


def test_filter_off_keeps_every_generation(store):
    store.insert_many([sample("a", 0), sample("a", 1)])
    assert len(store.claim_batch(0, 10)) == 2 and store.counts()["dropped"] == 0


def test_the_datamodule_passes_the_setting_on(store):
    store.insert_many([sample("a", 0), sample("a", 1), sample("a", 1)])

    def claim(flag: bool, step: int) -> list[int]:
        ds = StreamingSampleDataset(store.path, lambda: step, 0, 8, None, None, 1.0, latest_skill_generation_only=flag)
        return [int(i) for i in next(iter(ds))["sample_ids"]]

    assert claim(True, 0) == [3, 2]
    assert store.get(1).status == "dropped"
