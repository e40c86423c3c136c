"""Collation alignment and the streaming dataset's step-keyed, rank-sliced claims."""

from __future__ import annotations

import time

import torch

from metaclaw.datamodules.rollout import StreamingSampleDataset, collate_samples
from metaclaw.store import Sample, SampleStore


def test_collate_aligns_targets_and_logprobs():
    a = Sample(prompt_ids=[1, 2, 3], response_ids=[7, 8], behaviour_logprobs=[-0.7, -0.8], reward=1.0, id=1)
    b = Sample(
        prompt_ids=[4],
        response_ids=[9, 10, 11],
        behaviour_logprobs=[-0.9, -1.0, -1.1],
        teacher_logprobs=[-0.1, -0.2, -0.3],
        id=2,
    )
    batch = collate_samples([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7], [4, 9, 10, 0]]
    assert batch["target_ids"].tolist() == [[2, 3, 7, 8], [9, 10, 11, 0]]
    assert batch["mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    # behaviour logprob t belongs to target t: a's response tokens 7,8 sit at target positions 2,3
    assert torch.allclose(batch["behaviour_logprobs"][0], torch.tensor([0, 0, -0.7, -0.8]))
    assert torch.allclose(batch["teacher_logprobs"][1, :3], torch.tensor([-0.1, -0.2, -0.3]))
    assert torch.isnan(batch["teacher_logprobs"][0]).all() and torch.isnan(batch["reward"][1])
    assert batch["has_reward"].tolist() == [True, False] and batch["has_teacher"].tolist() == [False, True]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def _fill(path, n):
    store = SampleStore(path)
    for i in range(n):
        store.insert(
            Sample(
                prompt_ids=[1, 2],
                response_ids=[3, 4],
                behaviour_logprobs=[-1.0, -1.0],
                reward=float(i % 2),
                status="ready",
            )
        )
    return store


def test_ranks_split_each_step_without_overlap(tmp_path):
    path = tmp_path / "s.sqlite"
    store = _fill(path, 8)

    def stream(rank):
        ds = StreamingSampleDataset(
            path,
            lambda: 0,
            pad_id=0,
            batch_size=4,
            max_tokens=None,
            max_sample_tokens=None,
            wait_timeout_s=0.2,
            rank=rank,
            world_size=2,
        )
        return [b["sample_ids"].tolist() for b in ds]

    r0, r1 = stream(0), stream(1)
    assert len(r0) == len(r1) == 2  # two steps of 4 samples, two per rank
    seen = [i for batch in r0 + r1 for i in batch]
    assert sorted(seen) == list(range(1, 9))  # every sample once
    assert {s.claimed_step for s in store.select("claimed")} == {0, 1}


def test_stream_resumes_at_the_trainer_step_and_ends_when_idle(tmp_path):
    path = tmp_path / "s.sqlite"
    _fill(path, 3)
    ds = StreamingSampleDataset(
        path, lambda: 5, pad_id=0, batch_size=2, max_tokens=None, max_sample_tokens=None, wait_timeout_s=0.3
    )
    assert ds.end_reason is None
    batches = list(ds)
    assert [len(b["sample_ids"]) for b in batches] == [2, 1]
    assert sorted({s.claimed_step for s in SampleStore(path).select("claimed")}) == [5, 6]
    assert ds.end_reason == "no new sample for 0.3s (rollout.wait_timeout_s)"  # the summary says so


def test_every_rank_gets_the_global_batch_statistics(tmp_path):
    path = tmp_path / "s.sqlite"
    _fill(path, 4)  # rewards 0, 1, 0, 1; 2 response tokens each

    def first_batch(rank):
        ds = StreamingSampleDataset(
            path,
            lambda: 0,
            0,
            batch_size=4,
            max_tokens=None,
            max_sample_tokens=None,
            wait_timeout_s=0.2,
            rank=rank,
            world_size=2,
        )
        return next(iter(ds))

    for rank in (0, 1):
        b = first_batch(rank)
        assert b["group_reward"].tolist() == [1.0, 0.0, 1.0, 0.0]  # newest first
        assert int(b["group_tokens"]) == 8 and int(b["group_sequences"]) == 4
        assert len(b["sample_ids"]) == 2


def test_a_budget_that_cannot_hold_one_sample_per_rank_is_refused(tmp_path):
    import pytest

    with pytest.raises(
        ValueError, match=r"data\.max_tokens \(100\) must be >= .*\(2\) x data\.max_sample_tokens \(64\)"
    ):
        StreamingSampleDataset(
            tmp_path / "s.sqlite",
            lambda: 0,
            0,
            batch_size=4,
            max_tokens=100,
            max_sample_tokens=64,
            wait_timeout_s=0.2,
            rank=0,
            world_size=2,
        )


def test_without_a_sample_cap_each_rank_gets_a_sample_within_its_share(tmp_path):
    path = tmp_path / "s.sqlite"
    store = SampleStore(path)
    long_id = store.insert(Sample([1] * 8, [2] * 8, [-1.0] * 8, reward=1.0, status="ready"))  # 16 tokens
    for _ in range(2):
        store.insert(Sample([1, 2], [3, 4], [-1.0, -1.0], reward=1.0, status="ready"))  # 4 tokens
    ds = StreamingSampleDataset(
        path,
        lambda: 0,
        0,
        batch_size=2,
        max_tokens=20,
        max_sample_tokens=None,
        wait_timeout_s=0.3,
        rank=0,
        world_size=2,
    )
    batches = list(ds)  # before: the 16-token sample blocked every claim until the stream timed out
    assert len(batches) == 1 and store.get(long_id).meta["dropped"] == "too_long:16>10"


def test_backlog_settings_are_checked():
    import pytest

    from metaclaw.datamodules.rollout import RolloutDataModule

    with pytest.raises(ValueError, match="data.backlog_policy must be one of"):
        RolloutDataModule("s.sqlite", backlog_policy="drop_newest")
    with pytest.raises(ValueError, match=r"data.max_backlog \(2\) must be null or >= data.batch_size \(4\)"):
        RolloutDataModule("s.sqlite", batch_size=4, max_backlog=2)


def test_the_config_picks_the_backlog_policy(tmp_path):
    from metaclaw.training import prepare_store
    from tests.entrypoints.test_train import compose_train

    paused = compose_train(tmp_path, "rollout=proxy", "data.max_backlog=8", "data.backlog_policy=pause_capture")
    assert prepare_store(paused, None, None).capture_limit == 8
    dropping = compose_train(tmp_path, "rollout=proxy")
    assert prepare_store(dropping, None, None).capture_limit is None
    assert dropping.data.max_backlog == 512 and dropping.data.backlog_policy == "drop_oldest"
    assert compose_train(tmp_path).data.max_backlog is None  # rollout=store: the store is the data set


def test_a_step_waits_for_the_smallest_batch_that_carries_a_signal(tmp_path):
    """`min_batch_size`: RL's baseline is the batch mean, so the stream never steps on fewer samples."""
    path = tmp_path / "s.sqlite"
    _fill(path, 5)
    ds = StreamingSampleDataset(
        path, lambda: 0, pad_id=0, batch_size=3, max_tokens=None, max_sample_tokens=None, wait_timeout_s=0.3,
        min_batch_size=3,
    )  # fmt: skip
    assert [len(b["sample_ids"]) for b in ds] == [3]  # the last two wait for a third; the stream then ends
    assert SampleStore(path).counts()["ready"] == 2
    assert ds.end_reason == "no new sample for 0.3s (rollout.wait_timeout_s); 2 ready, fewer than the 3 a step needs"


def test_samples_that_keep_coming_slower_than_a_batch_do_not_end_the_stream(tmp_path):
    """`wait_timeout_s` ends the stream when no new sample came for that long, not when a whole batch did not:
    a slow agent (one sample every 0.4 s, batches of 4, timeout 1.2 s) is not taken for a stopped one. Before,
    the simulated user's skills run ended after 2 steps with 3 samples ready and a 4th 10 s away."""
    import threading

    path = tmp_path / "s.sqlite"
    SampleStore(path)

    def arrive():
        for _ in range(8):
            time.sleep(0.4)
            _fill(path, 1)

    feeder = threading.Thread(target=arrive)
    feeder.start()
    ds = StreamingSampleDataset(
        path, lambda: 0, pad_id=0, batch_size=4, max_tokens=None, max_sample_tokens=None, wait_timeout_s=1.2,
        min_batch_size=4,
    )  # fmt: skip
    sizes = [len(b["sample_ids"]) for b in ds]
    feeder.join()
    assert sizes == [4, 4] and ds.end_reason.startswith("no new sample for 1.2s")


def test_min_batch_size_is_checked():
    import pytest

    from metaclaw.datamodules.rollout import RolloutDataModule

    with pytest.raises(ValueError, match="data.min_batch_size"):
        RolloutDataModule("s.sqlite", batch_size=2, min_batch_size=3)


def test_ppo_epochs_reuse_each_claimed_batch(tmp_path):
    """Issue 29.5: `epochs=2` yields each claimed batch twice in a row; the claim is the first step's, so the
    store's step-keyed accounting (consumed through a checkpoint, released after a crash) is unchanged."""
    path = tmp_path / "s.sqlite"
    store = _fill(path, 8)
    ds = StreamingSampleDataset(path, lambda: 0, pad_id=0, batch_size=4, max_tokens=None, max_sample_tokens=None,
                                wait_timeout_s=0.2, epochs=2)  # fmt: skip
    batches = list(ds)
    assert [b["epoch"] for b in batches] == [0, 1, 0, 1]
    assert batches[0]["input_ids"].equal(batches[1]["input_ids"]) and batches[2]["reward"].equal(batches[3]["reward"])
    assert sorted({s.claimed_step for s in store.select("claimed")}) == [0, 2]
    assert store.counts()["claimed"] == 8


def test_ppo_epochs_need_a_clipped_loss(tmp_path):
    import pytest

    from metaclaw.config import ConfigError, validate_train_config
    from tests.entrypoints.test_train import compose_train

    with pytest.raises(ConfigError, match="data.epochs_per_batch=2 .* clipped loss"):
        validate_train_config(compose_train(tmp_path, "data.epochs_per_batch=2"))
    validate_train_config(compose_train(tmp_path, "data.epochs_per_batch=2", "loss=ppo"))
    validate_train_config(compose_train(tmp_path, "data.epochs_per_batch=2", "loss=cispo"))
