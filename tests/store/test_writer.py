"""GroupCommitWriter and SampleStore.insert_many: grouped durable commits, per-caller errors and ids, flush on close."""

from __future__ import annotations

import asyncio
import threading

import pytest

from metaclaw.store import GroupCommitWriter, Sample, SampleStore, SampleValidationError
from tests.store.conftest import make


def test_insert_many_is_one_all_or_nothing_transaction(store):
    ids = store.insert_many([make(), make(status="ready"), make()])
    assert ids == sorted(ids) and len(set(ids)) == 3 and store.count() == 3
    with pytest.raises(SampleValidationError, match="response_ids is empty"):
        store.insert_many([make(), make(n_resp=0)])
    assert store.count() == 3  # validated before the transaction: nothing of the refused batch was written


def test_concurrent_inserts_from_many_threads_are_all_durable(store):
    writer = GroupCommitWriter(store)
    ids: list[int] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        mine = [writer.insert(make(session_id=f"t{k}", turn_index=i)) for i in range(25)]
        assert mine == sorted(mine)  # a caller's ids come back in its submission order
        with lock:
            ids.extend(mine)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    assert len(set(ids)) == 200 and writer.stats["writes"] == 200
    reopened = SampleStore(store.path)
    assert reopened.count() == 200 and {s.id for s in reopened.select()} == set(ids)
    reopened.close()


def test_waiting_writes_share_one_commit(store):
    writer = GroupCommitWriter(store)
    with store._lock:  # hold the write lock: whatever is submitted meanwhile queues up
        futures = [writer.submit(make(turn_index=i)) for i in range(20)]
    ids = [f.result(timeout=10) for f in futures]
    writer.close()
    assert ids == sorted(ids) and writer.stats["commits"] <= 2 and writer.stats["largest_batch"] >= 19


def test_a_bad_sample_fails_only_its_caller(store):
    writer = GroupCommitWriter(store)
    with store._lock:
        good = writer.submit(make(turn_index=0))
        with pytest.raises(SampleValidationError, match="behaviour_logprobs has 1 entries but response_ids has 2"):
            # refused on the caller's thread, never queued
            writer.submit(Sample(prompt_ids=[1], response_ids=[5, 6], behaviour_logprobs=[-0.1]))
        unserialisable = writer.submit(make(turn_index=1, meta={"x": object()}))  # fails inside the batch
        also_good = writer.submit(make(turn_index=2))
    assert good.result(timeout=10) < also_good.result(timeout=10)
    with pytest.raises(TypeError):
        unserialisable.result(timeout=10)
    writer.close()
    assert [s.turn_index for s in store.select()] == [0, 2]


def test_close_flushes_everything_submitted_and_refuses_more(store):
    writer = GroupCommitWriter(store)
    futures = [writer.submit(make(turn_index=i)) for i in range(50)]
    writer.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(make())
    reopened = SampleStore(store.path)
    assert reopened.count() == 50
    reopened.close()


def test_next_states_and_async_callers(store):
    first = store.insert(make())

    async def main() -> list[int]:
        with GroupCommitWriter(store) as writer:
            ids = await asyncio.gather(*(writer.ainsert(make(turn_index=i)) for i in range(10)))
            await asyncio.wrap_future(writer.submit_next_state(first, "thanks"))
            return list(ids)

    ids = asyncio.run(main())
    assert len(set(ids)) == 10 and store.get(first).text.next_state == "thanks" and store.count() == 11
