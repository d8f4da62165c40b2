"""The step and weight-sync pipeline: prefetch → update → send → arm/receive → release → publish.

Place in the dataflow: between the train store (ReplayBuffer) and the generators. Its two halves share one
sequence and live in two processes: `UpdatePipeline` in the Trainer's (it holds the weights), `StepPipeline`
in the Controller's (it drives the trainer, the generators and the gate). Nothing else keeps pipeline state.

One train step s (version s → s + 1), in the order the events happen:

```
 Controller (StepPipeline)            Trainer (UpdatePipeline)                Generator
 ──────────────────────────────────── ─────────────────────────────────────── ─────────────────────────────
 train_step(s) asked; train_step(s+1) wait until step s−1's send released
   asked right behind it (no round      take step s's groups (prefetched)
   trip between two updates)            prefetch step s+1's groups
                                        update on a worker thread               receive(armed) waits for the send
                                        send(version s+1) starts, unasked ───►  joins it, stages, swaps
                                          released(): weights packed
 send_weights() claims that send       train_step(s+1) may update now
 every receive returned ◄───────────────────────────────────────────────────── holds s+1 (swap landed)
 arm the receives of s+2
 buffer.publish(s+1): the gate admits at s+1
```

An evaluation reads the trainer's weights, so after an evaluation step the Controller asks for step s+1 only
after it (`pause_after`, then `ask_next`); before a checkpoint the pipeline also drains: step s does not
prefetch step s+1's groups, so they are still in the buffer's state (`drain_after`). A generator whose
receiver cannot wait for a send (an engine whose own workers receive: vLLM, SGLang) is asked to receive
once the send has begun. The staleness bound holds as before:
the gate admitted every prefetched group at the version its generator held.

Colocated placement (`cluster.placement = "colocated"`: trainer and generators share one device) runs each
step in series, so that generation and training never hold device memory at the same time, and so never
overlap in time either:

```
 Controller (StepPipeline)                     Trainer                          Generators
 ───────────────────────────────────────────── ──────────────────────────────── ──────────────────────────────
 buffer.wait_step(s): step s's groups accepted                                  generate (awake)
 sleep() every generator ─────────────────────────────────────────────────────► finish the groups being sampled,
                                                                                 release the K/V cache
 train_step(s) (no prefetch, nothing asked     take, update, send ────────────► receive, swap (asleep)
   ahead), claim the send, every receive
 (evaluation, when due: while they sleep)
 wake() every generator ──────────────────────────────────────────────────────► take the cache back, admit
 buffer.publish(s+1)
```

The sequence, run with fakes in one process (`log` records what each side did; threads and the event
loop interleave, so the example checks the order that the pipeline guarantees):

>>> import asyncio
>>> from asyncrl.pipeline import StepPipeline, UpdatePipeline
>>> log, sent = [], []
>>> class Learner:
...     version = 0
...     def update(self, groups):
...         self.version += 1; return {}
...     def state_dict_for_sync(self):
...         return {}
>>> class Store:
...     async def take_step(self, step, timeout=None):
...         log.append(f"take {step}"); return []
>>> class Sender:  # a broadcast: each version once, in order
...     def send(self, tensors, version, *, released=None):
...         released(); sent.append(version); log.append(f"send {version}"); return {}
>>> class Generator:
...     held = 0
...     async def can_arm_receive(self):
...         return True
...     async def receive_weights(self, *, armed=False):
...         while len(sent) <= self.held:  # armed: waits for the next send
...             await asyncio.sleep(0.001)
...         self.held = sent[self.held]; log.append(f"holds {self.held}"); return {}
>>> class Gate:
...     async def publish(self, version):
...         log.append(f"publish {version}")
>>> trainer = UpdatePipeline(learner=Learner(), source=Store())
>>> trainer.sender = Sender()
>>> steps = StepPipeline(trainer=trainer, generators=[Generator()], buffer=Gate(), total_steps=2)
>>> async def run():
...     await steps.start()
...     for s in range(2):
...         await steps.step(s)
...     steps.close()
>>> asyncio.run(run())
>>> [e for e in log if e.startswith(("take", "publish"))]
['take 0', 'take 1', 'publish 1', 'publish 2']
>>> log.index("take 1") < log.index("send 1")  # step 1's groups were taken while step 0 trained
True
>>> all(log.index(f"send {v}") < log.index(f"holds {v}") < log.index(f"publish {v}") for v in (1, 2))
True
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from asyncrl.aio import discard, retrieve
from asyncrl.messages import Group
from asyncrl.telemetry.metrics import REPORT_KEY, RoleStats
from asyncrl.telemetry.spans import SpanRecorder
from transports.base import WeightSender

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

T = TypeVar("T")

# The key under which a train step's metrics carry what it trained ([[group id, prompt], ...]); the Controller
# takes it out of the metrics row and appends it to RUN_DIR/ledger.jsonl.
LEDGER_KEY = "ledger/groups"


# -- the trainer's half ----------------------------------------------------------------------------
class Updater(Protocol):
    """The learner, as far as the pipeline uses it."""

    @property
    def version(self) -> int: ...
    def update(self, groups: list[Group]) -> dict[str, float]:
        """One train step over `groups` (on a worker thread); the version goes up by 1."""
        ...
    def state_dict_for_sync(self) -> Mapping[str, Tensor]: ...


class StepSource(Protocol):
    """The train store (ReplayBuffer), as far as the pipeline uses it."""

    async def take_step(self, step: int, timeout: float | None = None) -> list[Group]: ...


class StepOutcome:
    """What one update did: its groups, the learner's metrics and its two phases' wall times."""

    __slots__ = ("groups", "metrics", "gate_wait_s", "train_s")

    def __init__(self, groups: list[Group], metrics: dict[str, float], gate_wait_s: float, train_s: float) -> None:
        self.groups, self.metrics, self.gate_wait_s, self.train_s = groups, metrics, gate_wait_s, train_s


class UpdatePipeline:
    """The trainer's half: one update at a time, in step order; each update waits only until the send
    before it released the weights, and starts its own send when it ends.

    Invariants: steps run in step order whatever order they are asked in (a Ray actor may start two calls
    in either order); an update never starts while a send still reads the weights it would change; every
    started send is claimed by exactly one `send_weights()`, oldest first; a failed step fails the steps
    asked for behind it instead of leaving them waiting.
    """

    def __init__(self, *, learner: Updater, source: StepSource, recorder: SpanRecorder | None = None) -> None:
        self.learner = learner
        self.source = source
        self.recorder = recorder or SpanRecorder("trainer")
        self._sender: WeightSender | None = None  # set when the weight-sync group forms
        self._has_sender = asyncio.Event()  # a send begun while the group is re-formed waits for the new one
        # supervision (a generator died, the group is re-formed): a failed send does not stop the next update;
        # the Controller sends the current weights again over the new group (StepPipeline's `recover`)
        self.supervised = False
        self._dropped = asyncio.Event()  # set (and replaced) by drop_sender: a claimed send of the old group ends
        self._updating = False  # an update changes the weights now (a fresh send waits for its end)
        self._prefetch: tuple[int, asyncio.Future] | None = None  # (step, its take_step), started early
        self._sending: asyncio.Future | None = None  # the send of the current weights, while it reads them
        self._released = asyncio.Event()  # set once that send no longer reads the weights (or ended)
        self._unclaimed: deque[asyncio.Future] = deque()  # sends started by train_step, for send_weights()
        self._turn = asyncio.Condition()  # whose update is next
        self._busy = False
        self._failed: BaseException | None = None  # the last step that raised (wakes the ones after it)

    @property
    def sender(self) -> WeightSender | None:
        return self._sender

    @sender.setter
    def sender(self, sender: WeightSender | None) -> None:
        self._sender = sender
        if sender is None:
            self._has_sender.clear()
        else:
            self._has_sender.set()

    def drop_sender(self) -> WeightSender | None:
        """The group is being re-formed (a generator died): forget the old sender and its sends (their
        receivers are gone; a send in flight on it fails when the caller closes it). Sends begun from now on
        wait for the new sender. Returns the old sender for the caller to close."""
        old, self.sender = self._sender, None
        self._unclaimed.clear()  # each has `retrieve`: their failures warn nobody
        self._sending = None
        self._released.set()  # an update waiting for the old send's release goes on
        self._dropped.set()  # a send_weights() claiming an old send raises
        self._dropped = asyncio.Event()
        return old

    async def train_step(self, step: int, *, prefetch: bool) -> StepOutcome:
        """Take step `step`'s groups, update (the learner holds version `step`, then `step + 1`) and start
        the send of the new weights; `send_weights()` returns its statistics. `prefetch`: the caller will
        ask for step + 1, so its groups are taken while this step trains."""
        async with self._turn:
            await self._turn.wait_for(lambda: self._failed is not None
                                      or (not self._busy and self.learner.version >= step))
            if self.learner.version < step:  # woken by a failure: the steps before this one will not come
                raise RuntimeError(f"train_step({step}): an earlier train step failed ({self._failed!r})")
            self._busy, self._failed = True, None
        try:
            return await self._update(step, prefetch)
        except Exception as exc:
            self._failed = exc
            raise
        finally:
            async with self._turn:
                self._busy = False
                self._turn.notify_all()

    async def _update(self, step: int, prefetch: bool) -> StepOutcome:
        await self._wait_released()
        if step != self.learner.version:
            raise RuntimeError(f"train_step({step}) but the trainer holds version {self.learner.version}")
        if self.sender is None and not self.supervised:
            raise RuntimeError("trainer has no weight sender; set up the weight-sync group first")
        t0, c0 = self.recorder.begin("wait_gate"), time.process_time()
        groups = await self._take(step)
        t1, c1 = time.time(), time.process_time()
        # process CPU time beside the wall time: in process it is every role's, so the planner can tell
        # computing from waiting in the gate wait (generation + scoring) and in the update
        self.recorder.record("wait_gate", t0, t1, step, cpu_s=c1 - c0)
        if prefetch:
            task = asyncio.ensure_future(self._take_from_source(step + 1))
            task.add_done_callback(retrieve)  # a take never claimed (a failure elsewhere) warns nobody
            self._prefetch = (step + 1, task)
        self._updating = True
        try:
            self.recorder.begin("train")
            metrics = await asyncio.to_thread(self.learner.update, groups)
            t2, c2 = time.time(), time.process_time()
            self.recorder.record("train", t1, t2, step, cpu_s=c2 - c1)
            self._unclaimed.append(self._begin_send())
        finally:
            self._updating = False
            async with self._turn:
                self._turn.notify_all()
        return StepOutcome(groups, metrics, t1 - t0, t2 - t1)

    async def _take(self, step: int) -> list[Group]:
        """Step `step`'s groups: the prefetched ones if they are that step's, else take them now."""
        pending, self._prefetch = self._prefetch, None
        if pending is not None:
            if pending[0] == step:
                return await pending[1]
            discard(pending[1])  # not this step's (a caller that broke its promise): take afresh
        return await self._take_from_source(step)

    async def _take_from_source(self, step: int) -> list[Group]:
        return await self.source.take_step(step)

    async def send_weights(self) -> dict[str, float]:
        """The statistics of the oldest send no one claimed yet; with none, send the current weights now (once
        no update is running: it would change them under the send).

        Supervised, while the group is re-formed (`drop_sender`) it raises at once, and a claimed send of the
        old group raises when the group is dropped: one claim per broadcast of the new group, no stray one."""
        if self.supervised and self._sender is None:
            raise RuntimeError("weight send: the weight-sync group is being re-formed")
        if not self._unclaimed:
            async with self._turn:
                await self._turn.wait_for(lambda: not self._updating or bool(self._unclaimed))
        task = self._unclaimed.popleft() if self._unclaimed else None
        if task is None:
            await self._wait_released()
            task = self._begin_send()
        dropped = asyncio.ensure_future(self._dropped.wait())
        try:
            await asyncio.wait({task, dropped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dropped.cancel()
        if not task.done():
            raise RuntimeError("weight send: the weight-sync group was re-formed during the send")
        return task.result()

    def _begin_send(self) -> asyncio.Future:
        if self.sender is None and not self.supervised:
            raise RuntimeError("trainer has no weight sender; set up the weight-sync group first")
        version, tensors = self.learner.version, self.learner.state_dict_for_sync()
        loop, released = asyncio.get_running_loop(), asyncio.Event()

        def on_released() -> None:  # called on the sending thread
            loop.call_soon_threadsafe(released.set)

        async def send() -> dict[str, float]:
            await self._has_sender.wait()  # set at once, except while the group is re-formed
            sender = self.sender
            assert sender is not None
            t0 = self.recorder.begin("weights_send")
            try:
                stats = await asyncio.to_thread(sender.send, tensors, version, released=on_released)
            finally:
                released.set()  # the end of a send, returned or raised, releases the weights too
            self.recorder.record("weights_send", t0, time.time(), version)
            return stats

        task = asyncio.ensure_future(send())
        task.add_done_callback(retrieve)  # its claimer (send_weights) reports a failure
        self._sending, self._released = task, released
        return task

    async def _wait_released(self) -> None:
        """Wait until the send in flight no longer reads the weights the next update would change: its
        release (the collective sender: once its last bucket is packed), or its end."""
        task = self._sending
        if task is None:
            return
        released = asyncio.ensure_future(self._released.wait())
        try:
            await asyncio.wait({task, released}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            released.cancel()
        if not task.done():
            return  # released: it broadcasts its own copy (its outcome goes to send_weights' caller)
        if self._sending is task:
            self._sending = None
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if self.supervised:  # its claimer (the Controller) re-forms the group and sends these weights again
                log.warning("the weight send before this step failed (%s); the update goes on", exc)
                return
            raise RuntimeError(f"the weight send before this step failed: {exc}") from exc


# -- the controller's half -------------------------------------------------------------------------
class TrainerEndpoint(Protocol):
    """The Trainer role as the Controller calls it (in process, or a Ray actor behind a proxy)."""

    async def train_step(self, step: int, *, prefetch: bool) -> dict[str, float]: ...
    async def send_weights(self) -> dict[str, float]: ...  # (with_reports: also report=True)


class GeneratorEndpoint(Protocol):
    """A Generator role as the Controller calls it."""

    async def can_arm_receive(self) -> bool: ...
    async def receive_weights(self, *, armed: bool = False, group: str | None = None) -> dict[str, float]: ...
    async def sleep(self) -> None: ...  # colocated placement only, like `wake`
    async def wake(self) -> None: ...


class Publisher(Protocol):
    """The gate: a version every generator holds may be admitted at."""

    async def publish(self, version: int) -> None: ...
    async def wait_step(self, step: int, timeout: float | None = None) -> bool:
        """Colocated placement only: until step `step`'s groups could be taken."""
        ...


async def _plain(aw: Awaitable[T]) -> T:
    return await aw


def _never(version: int) -> bool:
    return False


def _intolerable(exc: BaseException) -> bool:
    return False


class StepPipeline:
    """The Controller's half: asks for each train step ahead of time, arms the generators' receives while
    it trains, collects the send, waits until every generator holds the new version, then publishes it.

    `watch` wraps every await (the Controller's: it fails fast when a role loop died meanwhile).

    Supervision (`recover`, asyncrl/control/supervisor.py): a weight sync (one claimed send, one receive per
    generator) runs under `sync_lock`, and the supervisor re-forms the group under the same lock, so the two
    never interleave on a group. Receives carry the name of the group they were made for (`group`); the
    generator refuses a receive made for another group, so no receive ever counts a broadcast of a group it
    was not made for. When a step's sync fails, `recover(error)` is awaited (outside the lock): it returns once
    the group is re-formed (a dead generator restarted, every generator holding the current weights) or
    raises; the step then syncs again on the new group, and publishes as usual.

    `colocated`: each step runs in series around the generators' sleep (module docstring): nothing is asked
    ahead (`ask_next` does nothing), nothing prefetched. A generator whose death `tolerated(exc)` says
    supervision takes care of is left out of a sleep or wake (its fresh actor holds no cache yet).

    `with_reports`: the replies the step awaits anyway carry the roles' window reports (`stats()`, under
    REPORT_KEY): the trainer's send, each generator's receive and the buffer's publish are asked with
    `report=True`; `take_reports()` hands them to the Controller, which then calls `stats()` only on the roles
    that sent none (scorers in actors of their own; the scorers the buffer's actor hosts report with its
    publish, as {role: report}): four actor calls a step fewer with one generator.
    """

    def __init__(self, *, trainer: TrainerEndpoint, generators: Sequence[GeneratorEndpoint], buffer: Publisher,
                 total_steps: int, watch: Callable[[Awaitable[Any]], Awaitable[Any]] = _plain,
                 pause_after: Callable[[int], bool] = _never, drain_after: Callable[[int], bool] = _never,
                 recover: Callable[[BaseException], Awaitable[None]] | None = None, colocated: bool = False,
                 tolerated: Callable[[BaseException], bool] = _intolerable, with_reports: bool = False) -> None:
        self.trainer = trainer
        self.generators = list(generators)
        self.buffer = buffer
        self.total_steps = total_steps
        self.watch = watch
        # pause_after(v): after publishing v, step v is asked for only by `ask_next(v)` (an evaluation reads
        # the weights first). drain_after(v): the same, and step v - 1 does not prefetch step v's groups, so
        # the trainer and the buffer hold everything not yet trained (a checkpoint of both).
        self.pause_after = pause_after
        self.drain_after = drain_after
        self.recover = recover
        self.colocated = colocated
        self.tolerated = tolerated
        self.with_reports = with_reports
        # the window reports that came with the replies, with their role ("trainer", "buffer", "generator/<i>");
        # a role may send two in one step (a receive that returned before a failed sync, then the retry's)
        self.reports: list[tuple[str, RoleStats]] = []
        self.sync_lock = asyncio.Lock()  # a step's weight sync, or the supervisor re-forming the group
        self.group = "weights"  # the weight-sync group's name now (the supervisor renames it when it re-forms)
        self._arm = False  # every generator's receive may wait for the send (set by start())
        self._next: tuple[int, asyncio.Future] | None = None  # a train step asked for ahead of time
        self._prefetching: dict[int, bool] = {}  # step -> whether it was asked to prefetch the next one
        self._armed: tuple[str, list[asyncio.Future]] | None = None  # receives of the next version (group, futures)

    async def start(self) -> None:
        """Ask the generators once whether their receives can wait for a send (arm early)."""
        self._arm = bool(self.generators) and all(
            await self.watch(asyncio.gather(*[g.can_arm_receive() for g in self.generators])))

    def ask_next(self, step: int) -> None:
        """Ask for train step `step` now (it waits in the trainer behind the one before), unless it was
        asked for already or the run ends before it. Colocated: nothing (`step` asks for its own train step once
        the generators sleep)."""
        if step < self.total_steps and self._next is None and not self.colocated:
            prefetch = step + 1 < self.total_steps and not self.drain_after(step + 1)
            self._prefetching = {step: prefetch}
            self._next = (step, asyncio.ensure_future(self.trainer.train_step(step, prefetch=prefetch)))

    def drained(self, version: int) -> bool:
        """Whether, with version `version` published, nothing of step `version` left the buffer and no step
        is asked for: the trainer and the buffer then hold all that is not trained (a checkpoint may be
        written). False when step `version - 1` prefetched (`drain_after` was off when it was asked)."""
        return self._next is None and not self._prefetching.get(version - 1, False)

    async def step(self, step: int, *, while_asleep: Callable[[], Awaitable[None]] | None = None,
                   ) -> tuple[dict[str, float], dict[str, float]]:
        """Run train step `step` through publish(step + 1); returns (train metrics, send statistics). Step
        step + 1 is asked for at once, unless the run pauses (or drains) after version step + 1: then the
        caller calls `ask_next(step + 1)` once it is done with the weights. Colocated: the step in series
        (`_colocated_step`), `while_asleep` awaited after the sync while the generators still sleep."""
        if self.colocated:
            return await self._colocated_step(step, while_asleep)
        self.ask_next(step)
        assert self._next is not None and self._next[0] == step, "train steps are run in order"
        (_, train), self._next = self._next, None
        receives, self._armed = self._armed, None
        if receives is None and self._arm:  # the first step: arm now, while it trains
            receives = self._receive(armed=True)
        if not (self.pause_after(step + 1) or self.drain_after(step + 1)):
            self.ask_next(step + 1)
        try:
            metrics = await self.watch(train)
            sent, receives = await self._sync(receives)
        finally:
            for f in receives[1] if receives else []:  # a failure above: no stray receive left running
                discard(f)
        if step + 1 < self.total_steps and self._arm:  # the next version's receives wait while it trains
            self._armed = self._receive(armed=True)
        await self._publish(step + 1)
        return metrics, sent

    async def _colocated_step(self, step: int, while_asleep: Callable[[], Awaitable[None]] | None,
                              ) -> tuple[dict[str, float], dict[str, float]]:
        """Wait for step `step`'s groups, sleep the generators, train, sync (and `while_asleep`), wake them,
        publish. The metrics get `colocate/*` (the time to fall asleep, to wake, and asleep in between), and
        the wait for the groups is the trainer's gate wait."""
        t0 = time.time()
        await self.watch(self.buffer.wait_step(step))
        t1 = time.time()
        await self._tell_generators("sleep")
        t2 = time.time()
        train = asyncio.ensure_future(self.trainer.train_step(step, prefetch=False))
        receives, self._armed = self._armed, None
        if receives is None and self._arm:
            receives = self._receive(armed=True)
        try:
            metrics = dict(await self.watch(train))
            sent, receives = await self._sync(receives)
        finally:
            discard(train)  # a failure above: no train step left running unobserved
            for f in receives[1] if receives else []:
                discard(f)
        if while_asleep is not None:
            await while_asleep()
        t3 = time.time()
        await self._tell_generators("wake")
        t4 = time.time()
        if step + 1 < self.total_steps and self._arm:
            self._armed = self._receive(armed=True)
        await self._publish(step + 1)
        metrics["trainer/gate_wait_s"] = metrics.get("trainer/gate_wait_s", 0.0) + t1 - t0
        metrics.update({"colocate/sleep_s": t2 - t1, "colocate/asleep_s": t3 - t2, "colocate/wake_s": t4 - t3})
        return metrics, sent

    async def _tell_generators(self, method: str) -> None:
        """Every generator's `sleep` or `wake`, together; the death of one supervision restarts is let pass."""
        results = await self.watch(asyncio.gather(*[getattr(g, method)() for g in self.generators],
                                                  return_exceptions=True))
        for r in results:
            if isinstance(r, BaseException) and not (isinstance(r, Exception) and self.tolerated(r)):
                raise r

    async def _sync(self, receives: tuple[str, list[asyncio.Future]] | None,
                    ) -> tuple[dict[str, float], tuple[str, list[asyncio.Future]] | None]:
        """Claim the trainer's send and wait for every generator's receive; supervised, after a failure wait
        for the re-formed group (`recover`) and sync again there. Returns (send statistics, the receives)."""
        for attempt in range(8):
            async with self.sync_lock:
                if receives is not None and receives[0] != self.group:  # made for a group that is gone
                    for f in receives[1]:
                        discard(f)
                    receives = None
                if receives is None:  # receivers that cannot wait for a send: called now that it has begun
                    receives = self._receive(armed=False)
                assert receives is not None
                group = self.group
                try:
                    if self.with_reports:
                        sent = self._keep_report("trainer", await self.watch(self.trainer.send_weights(report=True)))
                    else:
                        sent = await self.watch(self.trainer.send_weights())
                    await self.watch(asyncio.gather(*receives[1]))
                    self._keep_receive_reports(receives[1])
                    return sent, receives
                except Exception as exc:
                    self._keep_receive_reports(receives[1])  # the receives that returned: their windows ended
                    if self.recover is None or attempt == 7:
                        raise
                    error = exc
                    for f in receives[1]:
                        discard(f)
                    receives = None
            if self.group == group:  # not re-formed yet: wait for it (or raise)
                await self.recover(error)
        raise AssertionError("unreachable")

    def _receive(self, *, armed: bool) -> tuple[str, list[asyncio.Future]] | None:
        """Every generator's receive, for the group as it is now; None while it is being re-formed."""
        extra: dict[str, Any] = {"report": True} if self.with_reports else {}
        if self.recover is None:
            return self.group, [asyncio.ensure_future(g.receive_weights(armed=armed, **extra))
                                for g in self.generators]
        if self.sync_lock.locked() and armed:
            return None  # the sync makes them, under the lock, once the group is re-formed
        return self.group, [asyncio.ensure_future(g.receive_weights(armed=armed, group=self.group, **extra))
                            for g in self.generators]

    async def _publish(self, version: int) -> None:
        if not self.with_reports:
            await self.watch(self.buffer.publish(version))
            return
        report = await self.watch(self.buffer.publish(version, report=True))
        if isinstance(report, dict):  # a buffer actor hosting the scorers: theirs too, by role
            self.reports.extend(report.items())
        elif report is not None:
            self.reports.append(("buffer", report))

    def _keep_report(self, role: str, reply: dict[str, Any]) -> dict[str, Any]:
        """`reply` without its window report (kept for `take_reports`)."""
        report = reply.pop(REPORT_KEY, None) if self.with_reports else None
        if report is not None:
            self.reports.append((role, report))
        return reply

    def _keep_receive_reports(self, receives: list[asyncio.Future]) -> None:
        for i, f in enumerate(receives):
            if f.done() and not f.cancelled() and f.exception() is None and isinstance(f.result(), dict):
                self._keep_report(f"generator/{i}", f.result())

    def take_reports(self) -> list[tuple[str, RoleStats]]:
        """The window reports that came with the replies since the last call, (role, report) (and forget them)."""
        out, self.reports = self.reports, []
        return out

    def close(self) -> None:
        """Drop what was asked for ahead of a failure (or of the end): their outcomes warn nobody. An armed
        receive ends when its transport is closed at shutdown."""
        if self._next is not None:
            discard(self._next[1])
            self._next = None
        for f in self._armed[1] if self._armed else []:
            discard(f)
        self._armed = None
