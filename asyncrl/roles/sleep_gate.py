"""Sleep and wake of a generator's engine (colocated placement): who uses the engine, and waiting for them.

Place in the dataflow: with `cluster.placement = "colocated"` the step pipeline (asyncrl/pipeline.py) calls the
generator's `sleep()` before each train step and `wake()` after the weight sync. Every engine user — a group
being sampled, a `generate` call — enters through `use()` and leaves through `let_go()`. `sleep` closes the gate
(no new user), waits until the last user let go, then lets the engine release its K/V cache (`SleepableEngine`);
users arriving meanwhile wait in `use()` until `wake`, which gives the engine its memory back and opens the gate.
`use()` returns False when the generator stops while asleep, so a waiting user gives up instead of hanging.

No Ray and no buffer here; the generator's admission loop asks `awake` before admitting.
"""

from __future__ import annotations

import asyncio
import time

from asyncrl.aio import until_either
from asyncrl.telemetry.spans import SpanRecorder
from engines.base import RolloutEngine, SleepableEngine


class SleepGate:
    def __init__(self, engine: RolloutEngine, recorder: SpanRecorder, *, stopped: asyncio.Event,
                 name: str = "generator") -> None:
        self.engine = engine
        self.recorder = recorder
        self.stopped = stopped
        self.name = name
        self._awake = asyncio.Event()  # set while the engine may be used
        self._awake.set()
        self._users = 0  # engine users (group samplings, generate calls): sleep waits for the last to let go
        self._unused = asyncio.Event()
        self._unused.set()
        self._asleep_since = 0.0

    @property
    def awake(self) -> bool:
        return self._awake.is_set()

    async def sleep(self) -> None:
        """Close the gate, wait until no one uses the engine, then let it release its K/V cache. A no-op while
        asleep."""
        if not isinstance(self.engine, SleepableEngine):
            raise RuntimeError(f"{self.name}: its {type(self.engine).__name__} cannot sleep; "
                               f"cluster.placement = 'colocated' needs rollout.engine = 'torch'")
        if not self._awake.is_set():
            return
        self._awake.clear()  # from here no new engine user: they wait in use()
        while self._users:
            await self._unused.wait()
        t0 = self.recorder.begin("sleep")
        try:
            await self.engine.sleep()
        except BaseException:
            self._awake.set()
            raise
        self._asleep_since = time.time()
        self.recorder.record("sleep", t0, self._asleep_since, self.engine.version)
        self.recorder.begin("asleep")

    async def wake(self) -> None:
        """Let the engine take its memory back and open the gate. A no-op while awake."""
        if self._awake.is_set():
            return
        t0 = self.recorder.begin("wake")
        await self.engine.wake()
        t1 = time.time()
        self.recorder.record("asleep", self._asleep_since, t0, self.engine.version)
        self.recorder.record("wake", t0, t1, self.engine.version)
        self._awake.set()

    async def use(self) -> bool:
        """Become an engine user once awake (at once when awake); False if `stopped` while asleep. No await lies
        between the last check and the count, so `sleep` never misses a user."""
        while not self._awake.is_set():
            if self.stopped.is_set():
                return False
            await self.until_awake_or_stopped()
        self.hold(1)
        return True

    def hold(self, users: int) -> None:
        """Count `users` engine users at once, without waiting (the caller checked `awake` just before)."""
        self._users += users
        if self._users:
            self._unused.clear()

    def let_go(self) -> None:
        self._users -= 1
        if not self._users:
            self._unused.set()

    async def until_awake_or_stopped(self) -> None:
        await until_either(self._awake, self.stopped)
