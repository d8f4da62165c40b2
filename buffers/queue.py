"""Bounded async FIFO with backpressure: the rollout queue between generators and scorers.

Place in the dataflow: Generators `put_many` finished groups → scorers `get_many` them. Each item has a
size (a group: its trajectories) and the capacity bounds the summed size: a full queue blocks the producer
(memory never grows past `capacity`); an empty one blocks the consumer. Items are never split, so a group
goes in and comes out whole. Both waits are accumulated (`put_wait_s`, `get_wait_s`) so the runtime can
report idle time.

Concurrency model: every method runs on ONE event loop (the hosting async actor's). There is no lock:
between two `await`s nothing else runs, so "check the state, then wait for a change" cannot race.
`Signal` is the wake-up primitive shared by the buffers: a lock-free `Condition.notify_all`, which
lets synchronous methods (`close`, the gate's `accept`/`release`/`publish`) wake waiters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class QueueClosed(Exception):
    """Raised by a put on a closed queue (and by `get` once a closed queue is drained)."""


class Signal:
    """Wakes every coroutine waiting on it (like `asyncio.Condition.notify_all`, without a lock).

    Waiters re-check their predicate after each wake-up, so a spurious wake is harmless and a
    notification can never be lost: the predicate is checked before each wait with no `await` between.
    """

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None  # created lazily, inside the running loop

    def notify_all(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until `predicate()` is true; False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            if self._event is None:
                self._event = asyncio.Event()
            event = self._event
            if deadline is None:
                await event.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                pass  # the loop re-checks the predicate once more, then the deadline
        return True


async def timed_wait(signal: Signal, predicate: Callable[[], bool], timeout: float | None) -> tuple[bool, float]:
    """`signal.wait_until` that also returns the seconds spent waiting (0.0 if no wait was needed)."""
    if predicate():
        return True, 0.0
    start = time.monotonic()
    ok = await signal.wait_until(predicate, timeout)
    return ok, time.monotonic() - start


class BoundedQueue(Generic[T]):
    """Async bounded FIFO of sized items. `put_many` blocks while an item does not fit, `get_many` while
    empty; `close` wakes all.

    `size(item)` (1 by default) counts against `capacity`. An item goes in whole once it fits, so the
    queue never holds more than `capacity` — except that an item larger than the capacity goes into an
    empty queue alone, so it cannot deadlock. Items of one batch keep their order; batches of concurrent
    producers may interleave item by item.
    """

    def __init__(self, capacity: int, *, name: str = "queue", size: Callable[[T], int] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"{name}: capacity must be >= 1, got {capacity}")
        self.name = name
        self._capacity = capacity
        self._size = size or (lambda _: 1)
        self._items: deque[tuple[T, int]] = deque()  # (item, its size)
        self._fill = 0  # summed size of the items held
        self._closed = False
        self._not_full = Signal()
        self._not_empty = Signal()
        self.total_put = 0  # in size units, like capacity
        self.total_got = 0
        self.put_wait_s = 0.0  # producers blocked on a full queue (summed over producers)
        self.get_wait_s = 0.0  # consumers blocked on an empty queue (summed over consumers)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def closed(self) -> bool:
        return self._closed

    def qsize(self) -> int:
        """The summed size of the items held (their number when every item has size 1)."""
        return self._fill

    async def put_many(self, items: Iterable[T]) -> None:
        """Append `items` in order, each once it fits; raises QueueClosed if the queue is (or gets) closed.

        If the queue is closed mid-batch, the items already put stay in the queue.
        """
        if self._closed:
            raise QueueClosed(f"{self.name} is closed")
        for item in items:
            n = self._size(item)
            _, waited = await timed_wait(
                self._not_full, lambda: self._closed or not self._items or self._fill + n <= self._capacity, None
            )
            self.put_wait_s += waited
            if self._closed:
                raise QueueClosed(f"{self.name} is closed")
            self._items.append((item, n))
            self._fill += n
            self.total_put += n
            self._not_empty.notify_all()

    async def put(self, item: T) -> None:
        await self.put_many([item])

    async def get_many(self, max_size: int, timeout: float | None = None) -> list[T]:
        """Items in FIFO order whose summed size is at most `max_size`, waiting for the first one; the
        first item is returned even when it alone is larger (an item is never split).

        Returns [] on timeout, or when the queue is closed and drained.
        """
        if max_size < 1:
            raise ValueError(f"{self.name}: max_size must be >= 1, got {max_size}")
        _, waited = await timed_wait(self._not_empty, lambda: self._closed or bool(self._items), timeout)
        self.get_wait_s += waited
        out: list[T] = []
        taken = 0
        while self._items and (not out or taken + self._items[0][1] <= max_size):
            item, n = self._items.popleft()
            out.append(item)
            taken += n
        if out:
            self._fill -= taken
            self.total_got += taken
            self._not_full.notify_all()
        return out

    async def get(self, timeout: float | None = None) -> T:
        """One item; raises asyncio.TimeoutError on timeout, QueueClosed when closed and drained."""
        items = await self.get_many(1, timeout)
        if items:
            return items[0]
        if self._closed:
            raise QueueClosed(f"{self.name} is closed and drained")
        raise asyncio.TimeoutError(f"{self.name}: no item within {timeout}s")

    def close(self) -> None:
        """Refuse further puts and wake every waiter; getters still drain what is left."""
        if not self._closed:
            log.debug("%s closed with %d items left", self.name, len(self._items))
        self._closed = True
        self._not_full.notify_all()
        self._not_empty.notify_all()
