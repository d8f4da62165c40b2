"""Small asyncio helpers shared by the Controller and the roles."""

from __future__ import annotations

import asyncio


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
