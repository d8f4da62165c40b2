"""Stopping the role loops at the end of a run (asyncrl/supervisor.py `Supervisor.stop`): the loops of roles whose
stop() went unanswered (a stalled process: its interpreter lock held, its event loop blocked) are cancelled at once
instead of being waited for, while the others are still waited for until they end."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl.supervisor import Supervisor


class Role:
    def __init__(self, hangs: bool) -> None:
        self.hangs, self.stopped, self.ended = hangs, asyncio.Event(), False

    async def run(self) -> None:
        await self.stopped.wait()
        if self.hangs:  # a loop that never sees its stop: it ends only when cancelled
            await asyncio.Event().wait()
        self.ended = True


class Deployment:
    def __init__(self) -> None:
        self.generators, self.scorers = [Role(hangs=False)], [Role(hangs=True)]


async def _stop(unresponsive: frozenset[str], timeout_s: float) -> tuple[float, Deployment]:
    d = Deployment()
    supervisor = Supervisor(d, max_restarts=0, run_dir=Path("."), save_every=0)
    supervisor.start_loops()
    await asyncio.sleep(0)
    for role in (*d.generators, *d.scorers):
        role.stopped.set()
    t0 = time.monotonic()
    await supervisor.stop(timeout_s=timeout_s, unresponsive=unresponsive)
    return time.monotonic() - t0, d


def test_an_unresponsive_roles_loop_is_cancelled_without_the_wait_the_others_get():
    elapsed, d = asyncio.run(_stop(frozenset({"scorer/0"}), timeout_s=5.0))
    assert elapsed < 1.0 and d.generators[0].ended  # the healthy loop was waited for, and ended
    elapsed, d = asyncio.run(_stop(frozenset(), timeout_s=0.5))
    assert elapsed >= 0.5 and d.generators[0].ended  # not named: the hung loop is waited for, up to the bound
