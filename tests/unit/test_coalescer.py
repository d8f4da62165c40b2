"""asyncrl.aio.Coalescer: a burst of adds rides on few calls, in order; failures reach every caller."""

import asyncio

import pytest

from asyncrl.aio import Coalescer


def recording(delay: float):
    """A send that records each call's items and takes `delay` seconds; (send, the calls' items)."""
    sent: list[list[int]] = []

    async def send(items):
        sent.append(list(items))
        await asyncio.sleep(delay)

    return send, sent


def test_adds_while_a_call_is_in_flight_share_the_next_call_in_order():
    send, sent = recording(0.01)

    async def main():
        c = Coalescer(send)
        first = asyncio.ensure_future(c.add([0, 1]))
        await asyncio.sleep(0.001)  # its call is in flight now
        await asyncio.gather(first, *(c.add([2 * i, 2 * i + 1]) for i in range(1, 16)))
        together = c.calls
        await asyncio.gather(*(c.add([i]) for i in range(3)))  # added before any call began: one call
        return together, c.calls

    together, calls = asyncio.run(main())
    assert together == 2 and calls == 3  # the first add alone, the other 15 together; then 3 in one
    assert [x for s in sent[:2] for x in s] == list(range(32)) and sent[2] == [0, 1, 2]


def test_limit_caps_a_call_and_a_lone_large_add_still_goes():
    send, sent = recording(0)

    async def main():
        c = Coalescer(send, limit=4)
        await asyncio.gather(c.add([0]), c.add([1, 2]), c.add([3, 4]), c.add([5, 6, 7, 8, 9]), c.add([10]))

    asyncio.run(main())
    assert sent == [[0, 1, 2], [3, 4], [5, 6, 7, 8, 9], [10]]  # each call at most 4 unless one add is larger


def test_a_failed_call_fails_exactly_its_callers_and_the_next_call_goes_on():
    async def send(items):
        await asyncio.sleep(0.01)
        if 1 in items:
            raise ValueError("queue refused")

    async def main():
        c = Coalescer(send)
        first = asyncio.ensure_future(c.add([0]))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(c.add([1]))
        third = asyncio.ensure_future(c.add([2]))
        await first
        with pytest.raises(ValueError, match="queue refused"):
            await second
        with pytest.raises(ValueError, match="queue refused"):
            await third  # rode on the same call as [1]
        await c.add([3])  # a later call goes on

    asyncio.run(main())


def test_a_cancelled_caller_leaves_its_items_to_the_call():
    sent: list[int] = []

    async def send(items):
        await asyncio.sleep(0.01)
        sent.extend(items)

    async def main():
        c = Coalescer(send)
        task = asyncio.ensure_future(c.add([7]))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await c.add([8])

    asyncio.run(main())
    assert sent == [7, 8]
