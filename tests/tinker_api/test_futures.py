"""Tinker futures without a server: seq_id order, resent requests, refused seq_ids, gaps, bounds."""

from __future__ import annotations

import asyncio

import pytest

from metaclaw.training_server.errors import ApiError
from metaclaw.training_server.tinker_api.futures import FutureStore, ModelQueue


def run(coro):
    return asyncio.run(coro)


def test_requests_run_in_seq_id_order_whatever_order_they_arrive() -> None:
    async def main() -> list[int]:
        store, ran = FutureStore(100, 60, 60), []
        queue = ModelQueue(store, max_pending=10, gap_timeout_s=5)

        def job(i: int):
            async def go() -> dict:
                ran.append(i)
                return {"i": i}

            return go

        ids = {seq: queue.submit(seq, job(seq)) for seq in (3, 1, 4, 2)}
        assert queue.submit(3, job(99)) == ids[3]  # a resent seq_id answers the request id it already has
        for rid in ids.values():
            await asyncio.wait_for(store.get(rid).done.wait(), 5)
        with pytest.raises(ApiError, match="already run"):
            queue.submit(0, job(0))  # never seen, below next_seq
        return ran

    assert run(main()) == [1, 2, 3, 4]


def test_a_refused_seq_id_does_not_hold_later_requests_and_a_gap_fails_them() -> None:
    async def main() -> None:
        store = FutureStore(100, 60, 60)
        queue = ModelQueue(store, max_pending=10, gap_timeout_s=0.2)

        async def ok() -> dict:
            return {}

        rid = queue.submit(2, ok)
        queue.skip(1)  # seq 1 was answered with a 4xx at submission
        await asyncio.wait_for(store.get(rid).done.wait(), 2)
        assert store.get(rid).error is None
        late = queue.submit(5, ok)  # 3 and 4 never come
        await asyncio.wait_for(store.get(late).done.wait(), 2)
        assert "seq_id 3 never arrived" in store.get(late).error and store.get(late).category == "user"
        assert queue.next_seq == 6

    run(main())


def test_errors_keep_their_category_and_the_store_is_bounded() -> None:
    async def main() -> None:
        store = FutureStore(max_futures=2, result_ttl_s=60, retrieved_grace_s=0)

        async def user_error() -> dict:
            raise ApiError(400, "bad datum", "data.0")

        async def crash() -> dict:
            raise RuntimeError("/secret/path exploded")

        a, b = store.start(user_error), store.start(crash)
        await asyncio.wait_for(asyncio.gather(a.done.wait(), b.done.wait()), 2)
        assert (a.error, a.category) == ("bad datum (data.0)", "user")
        assert b.category == "server" and "secret" not in b.error  # no server detail leaks
        c = store.new()  # full: the oldest finished one makes room
        assert store.get(a.request_id) is None and len(store) == 2
        with pytest.raises(ApiError) as full:
            store.new(), store.new()  # only pending ones left: 429, the SDK backs off
        assert full.value.status == 429 and c.request_id

    run(main())
