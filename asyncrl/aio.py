"""Small asyncio helpers shared by the Controller and the roles."""

from __future__ import annotations

import asyncio
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
