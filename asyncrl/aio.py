"""Small asyncio helpers shared by the Controller and the roles, and the event loop every run starts on
(`run_loop`: `asyncrl.local.run_local` in process, `asyncrl.launch.run_with_ray` on Ray)."""

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
