"""Small asyncio helpers shared by the Controller and the roles, and the event loop every run starts on
(`run_loop`: `asyncrl.deploy.local.run_local` in process, `asyncrl.deploy.launch.run_with_ray` on Ray)."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def retrieve(fut: asyncio.Future) -> None:
    """Mark a background future's outcome as seen (no "exception was never retrieved" warning); a done
    callback. Whoever needs the outcome reads it where it awaits the future."""
    if not fut.cancelled():
        fut.exception()


def discard(fut: asyncio.Future) -> None:
    """Cancel `fut` if still pending, and retrieve its outcome when it ends."""
    if not fut.done():
        fut.cancel()
    fut.add_done_callback(retrieve)


def on_daemon_thread(fn: Callable[..., T], *args: Any, name: str = "call") -> asyncio.Future[T]:
    """`fn(*args)` on a daemon thread of its own, as a future of the running loop. Not a pool thread: a call
    that hangs (a reward function, a blocked pipe read) holds only its own thread, never the next call, nor
    interpreter exit. Cancelling the future abandons the thread; its outcome is then dropped."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if fut.done():  # timed out (cancelled) meanwhile
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    def work() -> None:
        value, exc = None, None
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            exc = e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop closed meanwhile
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    return fut


async def until_either(event: asyncio.Event, stop: asyncio.Event) -> None:
    """Until `event` or `stop` is set (whichever first)."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class Coalescer:
    """Many callers' items, sent by one call at a time: `await add(items)` returns once a call carrying them
    (with whatever else arrived while the call before it ran) returned, or raises what that call raised.

    One caller alone gets its own call at once; callers arriving while a call is in flight share the next one.
    So a burst of N puts costs about two actor calls instead of N (each call costs more than its items on a
    small machine), and an idle producer waits no longer than before. Order is kept: a later call carries
    only items added after the earlier call's. `send(items)` must accept any concatenation of added lists;
    `limit` caps the items of one call (a list added alone may exceed it)."""

    def __init__(self, send: Callable[[list[Any]], Any], limit: int | None = None) -> None:
        self._send = send
        self._limit = limit
        self._waiting: list[tuple[list[Any], asyncio.Future]] = []
        self._flusher: asyncio.Future | None = None
        self.calls = 0  # calls made, for metrics and tests

    async def add(self, items: list[Any]) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((items, fut))
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())
        await asyncio.shield(fut)  # a cancelled caller leaves its items to the call that carries them

    async def _flush(self) -> None:
        try:
            while self._waiting:
                take, n = 0, 0
                while take < len(self._waiting) and (take == 0 or self._limit is None
                                                      or n + len(self._waiting[take][0]) <= self._limit):
                    n += len(self._waiting[take][0])
                    take += 1
                batch, self._waiting = self._waiting[:take], self._waiting[take:]
                self.calls += 1
                try:
                    await self._send([x for items, _ in batch for x in items])
                except BaseException as exc:  # noqa: BLE001 - every caller of this call gets it
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                            fut.add_done_callback(retrieve)
                    if not isinstance(exc, Exception):
                        raise
                else:
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_result(None)
        finally:
            self._flusher = None
            left, self._waiting = self._waiting, []
            for _, fut in left:  # only when the flusher itself was cancelled (shutdown)
                if not fut.done():
                    fut.set_exception(RuntimeError("coalesced call: its sender was cancelled"))
                    fut.add_done_callback(retrieve)


def run_loop(coro: Any) -> Any:
    """Run a coroutine on a fresh uvloop event loop (asyncio's own where uvloop is absent)."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux/macOS
        factory = None
    if threading.current_thread() is threading.main_thread():
        # asyncio.Runner installs its Ctrl-C handler (cancel the run, so every `finally` shuts the actors
        # down) only while SIGINT still has Python's default handler; an inherited SIG_IGN or a library's
        # handler, or a SIGINT blocked in the mask this process inherited from its parent's thread, would
        # make Ctrl-C do nothing. The CLI's contract is that the first Ctrl-C stops the run.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
