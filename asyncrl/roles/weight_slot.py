"""A generator's weights between the trainer's broadcast and its engine: receive, stage, swap.

Place in the dataflow: the step pipeline (asyncrl/pipeline.py) calls the generator's `receive_weights`, which
is `WeightSlot.receive`. The receiver (a transport's receiving half, set by the deployment when the generator
joins the weight-sync group) fills a staging copy off the event loop while generation goes on; `apply_pending`
hands it to the engine, which swaps it in at a decode-step boundary. With `weight_update = "in_flight"` the
receive swaps at once and returns once the engine holds the version (the Controller publishes a version only
when every generator holds it); with "between_requests" the staged copy waits until the admission loop has let
the groups in flight finish. An engine whose own workers receive (vLLM, SGLang: `CollectiveWeightEngine`)
needs no receiver here: the slot asks the engine to receive and swap.

No Ray and no buffer here: the slot reports each version it is about to hold through `on_held` (the generator
tells the buffer), and stops waiting when `stopped` is set.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Callable

import torch

from asyncrl.aio import until_either
from asyncrl.telemetry.spans import SpanRecorder
from engines.base import CollectiveWeightEngine, RolloutEngine
from transports.base import STAT_SECONDS, WeightReceiver

WEIGHT_UPDATES = ("in_flight", "between_requests")


class WeightSlot:
    def __init__(self, engine: RolloutEngine, recorder: SpanRecorder, *, on_held: Callable[[int], None],
                 stopped: asyncio.Event, weight_update: str = "in_flight", name: str = "generator") -> None:
        if weight_update not in WEIGHT_UPDATES:
            raise ValueError(f"weight_update must be 'in_flight' or 'between_requests', got {weight_update!r}")
        self.engine = engine
        self.recorder = recorder
        self.on_held = on_held
        self.stopped = stopped
        self.weight_update = weight_update
        self.name = name
        self.receiver: WeightReceiver | None = None
        self.group = "weights"  # the name of the weight-sync group `receiver` belongs to (supervision)
        self.pending: tuple[dict[str, torch.Tensor], int] | None = None  # received, not yet handed to the engine
        self.swap_s_total = 0.0  # time `load_weights` took, since the start
        self._swapped = asyncio.Event()  # set whenever a swap ends (landed or failed)
        self._swap_error: BaseException | None = None

    def can_arm(self) -> bool:
        """Whether `receive(armed=True)` may be called before the trainer sends: it then waits, without the
        group's timeout and without blocking generation, and joins the broadcast the moment it starts (a
        receiver that `arms_early`; not an engine whose own workers receive)."""
        return self.receiver is not None and self.receiver.arms_early

    async def receive(self, armed: bool = False, group: str | None = None) -> dict[str, float]:
        """Take part in one broadcast. `group`: the group the caller made this receive for; refused if this
        slot is in another one (a group re-formed meanwhile must not count it)."""
        if group is not None and group != self.group:
            raise RuntimeError(f"receive_weights for group {group!r}: this {self.name} is in {self.group!r}")
        if self.receiver is None and isinstance(self.engine, CollectiveWeightEngine):
            t0 = self.recorder.begin("weights_recv")  # the engine's own workers receive and swap (vLLM / SGLang)
            version, stats = await self.engine.receive_weights()
            self.recorder.record("weights_recv", t0, time.time(), version)
            self.on_held(version)
            return stats
        if self.receiver is None:
            raise RuntimeError(f"{self.name} has no weight receiver; join the weight-sync group first")
        if armed and not self.can_arm():
            raise RuntimeError("receive_weights(armed=True): this generator's receiver cannot wait for the send")
        self.recorder.begin("weights_recv", "armed" if armed else "")
        tensors, version, stats = await asyncio.to_thread(functools.partial(self.receiver.receive, armed=armed))
        t1 = time.time()
        # the transfer only: an armed receive (can_arm) waited for the send before it
        self.recorder.record("weights_recv", t1 - stats.get(STAT_SECONDS, 0.0), t1, version)
        self.pending = (tensors, version)
        if self.weight_update == "in_flight":
            # The holder hears of the version now, so that an admit waiting at the older one comes back while
            # the swap lands (the admission loop samples what it admits only once the engine holds it). The
            # engine swaps at its next decode-step boundary; this returns once the swap landed.
            self.on_held(version)
            await self.apply_pending()
            await self.until_holding(version)  # (the admission loop may have begun this swap itself)
        return stats

    async def apply_pending(self) -> None:
        """Hand the staged weights (if any) to the engine and wait for the swap."""
        if self.pending is None:
            return
        tensors, version = self.pending
        self.pending = None
        t0 = self.recorder.begin("weights_swap")
        try:
            # Off the loop: load_weights takes the engine lock and may wait for a batch in flight.
            await asyncio.to_thread(self.engine.load_weights, tensors, version)
        except BaseException as exc:
            self._swap_error = exc
            raise
        finally:
            self._swapped.set()
        t1 = time.time()
        self.swap_s_total += t1 - t0
        self.recorder.record("weights_swap", t0, t1, version)

    async def until_holding(self, version: int) -> None:
        """Until the engine holds `version` (a swap under way lands) or `stopped`; raises the error of a swap
        that failed meanwhile."""
        while self.engine.version < version and not self.stopped.is_set():
            if self._swap_error is not None:
                raise RuntimeError(f"{self.name}: the swap to version {version} failed") from self._swap_error
            self._swapped.clear()
            await until_either(self._swapped, self.stopped)
