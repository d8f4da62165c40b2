"""The run's watch: ends a run that cannot make progress with one clear error, instead of letting it hang.

Place in the dataflow: the Controller runs `RunWatch.run()` beside the generator and scorer loops for the
whole training loop; its `_guard` fails fast (one line) when the watch raises `RunStalled`. Every
`period_s` (`watch_period`: a twentieth of the shortest time bound below, at most 3 s) the watch asks each
process that hosts roles for a `Heartbeat` (its `LoopMonitor`), then the buffer for its `progress()`
(buffers/progress.py), and ends the run when

| bound                            | crossed when                                                       |
|----------------------------------|--------------------------------------------------------------------|
| `run.role_timeout_s`             | a role's event loop did not run for that long, or its process did  |
|                                  | not answer at all                                                  |
| `run.max_failed_groups_in_a_row` | that many groups in a row failed or were filtered, none trained on |
| `run.no_progress_timeout_s`      | no group was accepted and no step taken for that many seconds      |

Why. A failed or filtered group gives its slot back and the gate admits a fresh prompt in its place, so a
run in which every group fails (a reward that always raises, rows without the answer field, a row the
generator cannot encode) would refill and fail forever without writing a metrics row; the error quotes
the last distinct reasons the generators and scorers gave when they released the groups. And a role's
event loop that is blocked — a synchronous call inside an env's `async step`, a reward function holding
the interpreter lock in one long C call — stops that role for good, and `asyncio` timeouts cannot fire
on a blocked loop; the error says which role, where its loop is blocked and what it began last.

How a stall is seen. A `LoopMonitor` lives in each process that hosts roles (a Ray actor; the driver,
in process). Its loop runs a beat every `tick_s`; a thread of its own measures how late the beat is and,
while it is late, notes the loop thread's innermost frames and the roles' last activities
(`SpanRecorder.begin`). `heartbeat()` reports the longest stall since the previous heartbeat. Under Ray
the actor answers it from a thread of its own (its "watch" concurrency group), so the answer comes while
the role's loop is blocked; in process the watch runs on the blocked loop itself, so it reads the stall
once the loop runs again (the monitor's thread logs it at once meanwhile). A process in which nothing
runs (the interpreter lock held) does not answer at all: the probe's own timeout says so.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import threading
import time
import traceback
from typing import Any, Awaitable, Callable, Protocol

import msgspec

from asyncrl.telemetry.spans import SpanRecorder
from buffers.progress import Progress

log = logging.getLogger(__name__)

Probe = Callable[[], Awaitable["Heartbeat"]]


class RunStalled(RuntimeError):
    """The run cannot make progress; the message is one line naming the cause. `process`: the probe name of the
    process that stalled (it did not answer, or its event loop was blocked); "" when no progress was the cause."""

    def __init__(self, message: str, process: str = "") -> None:
        super().__init__(message)
        self.process = process


class ProgressSource(Protocol):
    """The ReplayBuffer, as far as the watch reads it."""

    async def progress(self) -> Progress: ...


class Heartbeat(msgspec.Struct, kw_only=True):
    """A process's answer to the watch (crosses the actor boundary)."""

    stalled_s: float              # the longest its event loop did not run since the previous heartbeat
    where: str = ""               # the loop thread's innermost frames during that stall, innermost first
    activities: list[str] = []    # each role of the process: what it began last, and how long before


PERIOD_MAX_S = 3.0  # the watch looks at least this often, however long the bounds


def watch_period(role_timeout_s: float, no_progress_timeout_s: float = 0.0) -> float:
    """How often the watch probes and reads the progress: a twentieth of its shortest time bound, at most
    PERIOD_MAX_S (3 s with the default 60 s `run.role_timeout_s`: a bound is seen crossed within 5% of it, late).
    Each look is an actor call to every process hosting roles and one to the buffer, on the driver's loop and
    on the roles' cores: no more often than the bounds need."""
    bounds = [b for b in (role_timeout_s, no_progress_timeout_s) if b > 0]
    return min(PERIOD_MAX_S, min(bounds) / 20) if bounds else PERIOD_MAX_S


class RunWatch:
    """Probes the roles and reads the run's progress every `period_s`; raises RunStalled when a bound is
    crossed. `max_failed_in_a_row` and `no_progress_timeout_s`: 0 turns that bound off. Every call the
    watch makes is bounded by `role_timeout_s`. `probes`: one per process hosting roles, by its name
    (`Deployment.probes()`); set before `run()`."""

    def __init__(self, *, buffer: ProgressSource | Any, max_failed_in_a_row: int, no_progress_timeout_s: float,
                 role_timeout_s: float = 60.0, probes: dict[str, Probe] | None = None,
                 period_s: float | None = None) -> None:
        self.buffer = buffer
        self.max_failed_in_a_row = max_failed_in_a_row
        self.no_progress_timeout_s = no_progress_timeout_s
        self.role_timeout_s = role_timeout_s
        self.probes = dict(probes or {})
        self.period_s = watch_period(role_timeout_s, no_progress_timeout_s) if period_s is None else period_s
        self._answers: dict[str, tuple[float, Heartbeat]] = {}  # name -> (monotonic time, its last answer)

    async def run(self) -> None:
        """Check until a bound is crossed (raises RunStalled); cancelled when the run ends."""
        while True:
            await asyncio.sleep(self.period_s)
            await asyncio.gather(*[self._probe(name, probe) for name, probe in self.probes.items()])
            try:
                progress = await asyncio.wait_for(self.buffer.progress(), self.role_timeout_s)
            except asyncio.TimeoutError:
                raise RunStalled(f"the replay buffer has not answered for {self.role_timeout_s:g} s "
                                 f"(run.role_timeout_s)") from None
            self.check_progress(progress)

    async def _probe(self, name: str, probe: Probe) -> None:
        try:
            beat = await asyncio.wait_for(probe(), self.role_timeout_s)
        except asyncio.TimeoutError:
            raise RunStalled(self._silent(name), process=name) from None
        except Exception as exc:  # a dead actor: the Controller's _guard reports it where it awaits the role
            log.debug("heartbeat of %s failed: %r", name, exc)
            return
        self._answers[name] = (time.monotonic(), beat)
        self.check_heartbeat(name, beat)

    def check_heartbeat(self, name: str, beat: Heartbeat) -> None:
        """Raise RunStalled when `name`'s event loop stalled for `role_timeout_s` or longer."""
        if beat.stalled_s >= self.role_timeout_s:
            raise RunStalled(f"the event loop of {name} did not run for {beat.stalled_s:.1f} s (run.role_timeout_s "
                             f"= {self.role_timeout_s:g}): blocked in {beat.where or 'unknown code'}; last activity: "
                             f"{'; '.join(beat.activities) or 'none yet'}", process=name)

    def _silent(self, name: str) -> str:
        """The error for a process that did not answer the probe at all."""
        text = (f"{name} has not answered for {self.role_timeout_s:g} s (run.role_timeout_s): nothing in its "
                f"process runs, so something there holds the interpreter lock (e.g. a reward or env function in "
                f"one long C call; the process's stderr has the stacks of its threads)")
        if name in self._answers:
            when, beat = self._answers[name]
            text += (f"; last activity it reported, {time.monotonic() - when:.0f} s ago: "
                     f"{'; '.join(beat.activities) or 'none yet'}")
        return text

    def check_progress(self, p: Progress) -> None:
        """Raise RunStalled when `p` crosses a bound."""
        reasons = "; ".join(reversed(p.reasons))  # newest first: a cut-off line keeps the latest
        limit, timeout = self.max_failed_in_a_row, self.no_progress_timeout_s
        if limit and p.released_in_a_row >= limit:
            raise RunStalled(f"no progress: the last {p.released_in_a_row} groups all failed or were filtered and "
                             f"none was trained on (run.max_failed_groups_in_a_row = {limit}); last reasons: "
                             f"{reasons}")
        if timeout and p.idle_s >= timeout:
            released = (f"; {p.released_in_a_row} groups failed or were filtered meanwhile, last reasons: {reasons}"
                        if p.released_in_a_row else "")
            raise RunStalled(f"no progress: no group was accepted for training and no step taken for "
                             f"{p.idle_s:.0f} s (run.no_progress_timeout_s = {timeout:g}){released}")


class LoopMonitor:
    """Watches one process's event loop from a thread: how late its beat is, and while it is late, where
    the loop thread is and what the process's roles began last (`recorders`, by role name).

    `timeout_s`: a stall this long is logged once, as it happens (in process nothing else can say so
    while the loop is blocked). `dump_stacks`: also arm `faulthandler` to write every thread's stack to
    stderr after `timeout_s` without a beat — that works even while the interpreter lock is held (for a
    process of its own: faulthandler's timer is per process).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, recorders: dict[str, SpanRecorder], *, timeout_s: float,
                 tick_s: float = 0.25, dump_stacks: bool = False) -> None:
        self.loop = loop
        self.recorders = dict(recorders)
        self.timeout_s = timeout_s
        self.tick_s = tick_s
        self.dump_stacks = dump_stacks
        self._lock = threading.Lock()
        self._beat_at = time.monotonic()
        self._armed_at = float("-inf")  # when faulthandler was last armed
        self._loop_thread: int | None = None
        self._worst = Heartbeat(stalled_s=0.0)  # the longest stall since the previous heartbeat
        self._stall, self._stall_where = float("nan"), ""  # the stall noted last (its start) and where it was
        self._logged = False  # the current stall was logged
        self._stop = threading.Event()
        self._beating: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "LoopMonitor":
        """Start the beat on `loop` and the watching thread; call it from the loop's thread."""
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="loop-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._beating is not None:
            self._beating.cancel()
        if self.dump_stacks:
            faulthandler.cancel_dump_traceback_later()

    def _beat(self) -> None:
        now = time.monotonic()
        self._beat_at, self._logged = now, False
        self._loop_thread = threading.get_ident()
        if self.dump_stacks and now - self._armed_at >= self.timeout_s / 2:  # re-arming starts a C thread
            faulthandler.dump_traceback_later(self.timeout_s * 1.5, exit=False)
            self._armed_at = now
        if not self._stop.is_set():
            self._beating = self.loop.call_later(self.tick_s, self._beat)

    def late_s(self) -> float:
        """How much later than due the loop's beat is now (0.0 when the loop runs)."""
        return max(0.0, time.monotonic() - self._beat_at - self.tick_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            late = self.late_s()
            if late < self.tick_s:
                continue
            beat = self._note(late)
            if late >= self.timeout_s and not self._logged:
                self._logged = True
                log.error("event loop blocked for %.1f s (run.role_timeout_s = %g) in %s; last activity: %s",
                          late, self.timeout_s, beat.where, "; ".join(beat.activities))

    def _note(self, late: float) -> Heartbeat:
        """Record a stall of `late` seconds going on now (where the loop is, what the roles began). A sample
        taken as the loop leaves the blocking call finds no frame of its own: it keeps the one this stall had."""
        stall = self._beat_at  # the stall's start: the last beat before it
        beat = Heartbeat(stalled_s=late, where=self._where(), activities=self._activities())
        with self._lock:
            if not beat.where and stall == self._stall:
                beat.where = self._stall_where
            self._stall, self._stall_where = stall, beat.where
            if late > self._worst.stalled_s:
                self._worst = beat
        return beat

    def heartbeat(self) -> Heartbeat:
        """The longest stall since the previous heartbeat (also one going on now), or the roles' activities."""
        late = self.late_s()
        if late >= self.tick_s and threading.get_ident() != self._loop_thread:  # on the loop, the loop runs
            self._note(late)
        with self._lock:
            worst, self._worst = self._worst, Heartbeat(stalled_s=0.0)
        return worst if worst.stalled_s > 0 else Heartbeat(stalled_s=0.0, activities=self._activities())

    def _activities(self) -> list[str]:
        now = time.time()
        out = []
        for name, recorder in self.recorders.items():
            a = recorder.activity
            if a is not None:
                detail = f" ({a.detail})" if a.detail else ""
                out.append(f"{name}: {a.kind}{detail}, begun {max(0.0, now - a.since):.1f} s before")
        return out

    def _where(self) -> str:
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None
        return describe_stack(frame) if frame is not None else ""


_LOOP = ("/asyncio/events.py", "/asyncio/base_events.py", "/asyncio/runners.py")  # the loop runs a callback
_PLUMBING = ("/asyncio/", "/concurrent/", "/threading.py", "/contextlib.py")
_PACKAGES = ("asyncrl/", "buffers/", "engines/")


def describe_stack(frame: Any, depth: int = 3) -> str:
    """The innermost `depth` frames of the callback the event loop runs, innermost first, as 'file:line in
    function' (asyncrl's own files with their package path, others by file name); asyncio's own frames and
    whatever runs the loop are left out."""
    frames = []
    # walk_stack goes innermost first; lookup_lines=False: names and line numbers only, so no source file is
    # read into linecache (which keeps every file it reads: a long run stalling now and then would grow it)
    for f in traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False):
        if f.filename.endswith(_LOOP):
            break
        if not any(p in f.filename for p in _PLUMBING):
            frames.append(f)
    return " <- ".join(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in frames[:depth])


def _short(path: str) -> str:
    for package in _PACKAGES:
        at = path.rfind("/" + package)
        if at >= 0:
            return path[at + 1:]
    return path.rsplit("/", 1)[-1]
