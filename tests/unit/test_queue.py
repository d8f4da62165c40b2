"""BoundedQueue: backpressure, FIFO order, timeouts and close (plain asyncio, no plugin)."""

from __future__ import annotations

import asyncio

import pytest

from buffers.queue import BoundedQueue, QueueClosed

SHORT = 0.02  # seconds; every wait in these tests is this short or shorter


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=2.0))


def test_capacity_is_never_exceeded_by_concurrent_batches_larger_than_capacity():
    async def main():
        q: BoundedQueue[int] = BoundedQueue(3)
        seen_max = 0

        async def consumer():
            nonlocal seen_max
            got = []
            while len(got) < 20:
                seen_max = max(seen_max, q.qsize())
                got += await q.get_many(2)
                await asyncio.sleep(0)
            return got

        task = asyncio.create_task(consumer())
        await asyncio.gather(q.put_many(list(range(10))), q.put_many(list(range(10, 20))))
        got = await task
        return seen_max, got

    seen_max, got = run(main())
    assert seen_max <= 3
    assert sorted(got) == list(range(20))
    # each producer's batch keeps its own order even when chunks interleave
    assert [x for x in got if x < 10] == list(range(10))
    assert [x for x in got if x >= 10] == list(range(10, 20))


def test_put_on_full_queue_waits_until_a_get_frees_room():
    async def main():
        q: BoundedQueue[str] = BoundedQueue(2)
        await q.put_many(["a", "b"])
        put = asyncio.create_task(q.put("c"))
        await asyncio.sleep(SHORT)
        blocked = not put.done()
        depth_while_blocked = q.qsize()
        first = await q.get()
        await asyncio.wait_for(put, SHORT * 5)
        return blocked, depth_while_blocked, first, await q.get_many(5), q

    blocked, depth, first, rest, q = run(main())
    assert blocked and depth == 2
    assert first == "a" and rest == ["b", "c"]
    assert q.put_wait_s >= SHORT * 0.5
    assert q.total_put == 3 and q.total_got == 3


def test_batched_put_and_get_keep_fifo_order():
    async def main():
        q: BoundedQueue[int] = BoundedQueue(10)
        await q.put_many([1, 2, 3])
        await q.put_many([4, 5])
        await q.put(6)
        return [await q.get_many(4), await q.get_many(4)]

    assert run(main()) == [[1, 2, 3, 4], [5, 6]]


def test_get_many_returns_empty_list_on_timeout_and_counts_the_wait():
    async def main():
        q: BoundedQueue[int] = BoundedQueue(1)
        return await q.get_many(3, timeout=SHORT), q

    got, q = run(main())
    assert got == []
    assert q.get_wait_s >= SHORT * 0.5


def test_get_raises_timeout_when_nothing_arrives():
    async def main():
        q: BoundedQueue[int] = BoundedQueue(1)
        with pytest.raises(asyncio.TimeoutError):
            await q.get(timeout=SHORT)

    run(main())


def test_close_wakes_a_blocked_getter_and_a_blocked_putter():
    async def main():
        empty: BoundedQueue[int] = BoundedQueue(1)
        full: BoundedQueue[int] = BoundedQueue(1)
        await full.put(0)
        getter = asyncio.create_task(empty.get_many(1))
        putter = asyncio.create_task(full.put(1))
        await asyncio.sleep(SHORT)
        assert not getter.done() and not putter.done()
        empty.close()
        full.close()
        got = await asyncio.wait_for(getter, SHORT * 5)
        with pytest.raises(QueueClosed):
            await asyncio.wait_for(putter, SHORT * 5)
        return got, full

    got, full = run(main())
    assert got == []
    assert full.qsize() == 1  # the blocked item was not put


def test_closed_queue_refuses_puts_but_drains_to_getters():
    async def main():
        q: BoundedQueue[int] = BoundedQueue(4)
        await q.put_many([7, 8])
        q.close()
        with pytest.raises(QueueClosed):
            await q.put(9)
        drained = await q.get_many(10)
        after = await q.get_many(10)
        with pytest.raises(QueueClosed):
            await q.get()
        return drained, after

    assert run(main()) == ([7, 8], [])


def test_invalid_capacity_and_max_size_are_rejected():
    with pytest.raises(ValueError, match="capacity"):
        BoundedQueue(0)

    async def main():
        with pytest.raises(ValueError, match="max_size"):
            await BoundedQueue(1).get_many(0)

    run(main())


def test_a_sized_item_waits_until_it_fits_whole_and_comes_out_whole():
    async def main():
        q: BoundedQueue[str] = BoundedQueue(5, size=len)
        await q.put("aaa")
        put = asyncio.create_task(q.put("bbb"))  # 3 + 3 > 5: it waits, no part of it goes in
        await asyncio.sleep(SHORT)
        blocked, depth = not put.done(), q.qsize()
        first = await q.get_many(2)  # the oldest item is handed out whole even though it is larger than 2
        await asyncio.wait_for(put, SHORT * 5)
        return blocked, depth, first, await q.get_many(5)

    assert run(main()) == (True, 3, ["aaa"], ["bbb"])


def test_an_item_larger_than_the_capacity_goes_into_an_empty_queue_alone():
    async def main():
        q: BoundedQueue[str] = BoundedQueue(2, size=len)
        await q.put("x")
        put = asyncio.create_task(q.put("yyy"))
        await asyncio.sleep(SHORT)
        waited_for_empty = not put.done()
        got = await q.get_many(2)
        await asyncio.wait_for(put, SHORT * 5)
        return waited_for_empty, got, q.qsize(), await q.get_many(2)

    assert run(main()) == (True, ["x"], 3, ["yyy"])
