"""Least-loaded dispatch: which generator gets the next group the gate has room for.

Place in the dataflow: Generators ──admit──► **Dispatch** (inside the ReplayBuffer) ──► AdmissionGate.
Generators pull: each one's run loop asks `admit` for as many groups as it has free slots. When several
ask at once, the gate's room (a scarce resource: `(version + k + 1) * P` groups at a time) is shared by
`Dispatch.share`: group by group, each to the waiting generator with the least expected wait, as if the
room were handed out one group at a time (water-filling). Without it the first generator to wake took
all of it, whatever it already held and however slow it was.

Load. A generator's load is its groups in flight (admitted, not yet queued for scoring) weighted by how
long it takes per group: `cost = (in_flight + 1) * latency`, the shortest-expected-delay rule. `latency`
is the exponential mean of its groups' admit-to-queue seconds, or the age of its oldest group in flight
if that is longer (a generator whose group hangs looks slow at once). Generators of equal speed thus get
groups by fewest in flight; a generator slower per group than the others gets one only when theirs would
wait longer — so the groups of the next steps go to the fast ones, and a slow one holds few of them (the
trainer takes groups in admission order, so a slow group delays the step it belongs to). Ties are broken
deterministically: fewer in flight first, then the lower generator index. A generator with no finished
group yet counts as the mean of the known ones (all unknown: equal).

Between two asks. A generator's admit returns without its fill on a timeout or a newer version, and the
generator asks again at once — but over Ray that is a round trip, in which another generator, woken by the
same publish, would see it not asking and take its share. So an ask that ended short keeps its place for
`LEASE_S` seconds or until that generator asks again (a generator that stopped asking loses it then).

Startup. Before the run's first grant every admit waits until all `generators` are asking (at most
`STARTUP_S` seconds), so the first room is split too, not taken by the generator that asked first.

Which prompts a run uses does not change: group ids (and with them the dataset rows and the sampling
seeds of `rollout.seed_groups`) are handed out by the gate in admission order, whoever generates them;
the gate's capacity rule and admission-order training are untouched, so exactly-once accounting and the
staleness bound hold as before (buffers/gate.py). All methods run on the buffer's one event loop.
"""

from __future__ import annotations

import heapq
import re
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

STARTUP_S = 1.0  # the longest the run's first admission waits for every generator to ask
LEASE_S = 0.25  # how long an ask that ended short keeps its place (a round trip to ask again)
EWMA = 0.3  # weight of a finished group's latency in its generator's mean


def natural_key(target: Hashable) -> tuple[Any, ...]:
    """Order "generator/2" before "generator/10" (and ints as ints): the deterministic tie-break."""
    if isinstance(target, int):
        return ((0, target),)
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", str(target)))


def load_key(target: Hashable, in_flight: int, seconds: float) -> tuple[float, int, tuple[Any, ...]]:
    """Least loaded first: the expected wait for one more item, then fewer in flight, then the lower index."""
    return (in_flight + 1) * seconds, in_flight, natural_key(target)


class Loads:
    """Per-target work in flight and seconds per item: the cost model of the module docstring. A target is a
    generator (its holder name at the buffer, or its index); an item is a group, or one `generate` call."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._inflight: dict[Hashable, dict[Hashable, float]] = {}  # target -> item -> its start
        self._owner: dict[Hashable, Hashable] = {}  # item -> the target working on it
        self._latency: dict[Hashable, float] = {}  # target -> mean seconds per item (finished ones)

    def add(self, target: Hashable) -> None:
        self._inflight.setdefault(target, {})

    def started(self, target: Hashable, item: Hashable) -> None:
        self._inflight.setdefault(target, {})[item] = self.clock()
        self._owner[item] = target

    def finished(self, item: Hashable, ok: bool = True) -> None:
        """`item` is done: with `ok`, its seconds update its target's latency (a failure says nothing about
        speed). Unknown items are ignored."""
        target = self._owner.pop(item, None)
        if target is None:
            return
        started = self._inflight[target].pop(item)
        if ok:
            seconds = self.clock() - started
            known = self._latency.get(target)
            self._latency[target] = seconds if known is None else (1 - EWMA) * known + EWMA * seconds

    def forget(self, target: Hashable) -> None:
        """`target` is gone (its actor died): its items and its record leave the model."""
        for item in self._inflight.pop(target, {}):
            self._owner.pop(item, None)
        self._latency.pop(target, None)

    def known(self, target: Hashable) -> bool:
        return target in self._inflight

    def in_flight(self, target: Hashable) -> int:
        return len(self._inflight.get(target, {}))

    def latency(self, target: Hashable) -> float | None:
        """The mean seconds per finished item; None before the first."""
        return self._latency.get(target)

    def targets(self) -> list[Hashable]:
        return sorted(self._inflight, key=natural_key)

    def estimate(self, target: Hashable, now: float) -> float:
        """Expected seconds per item: its mean, or the mean of the known targets before its first finished
        item (1.0 when none is known: then only counts matter), or the age of its oldest item if longer."""
        known = self._latency.get(target)
        if known is None:
            known = sum(self._latency.values()) / len(self._latency) if self._latency else 1.0
        items = self._inflight.get(target)
        oldest = now - min(items.values()) if items else 0.0
        return max(known, oldest)

    def order(self, targets: Iterable[Hashable], now: float | None = None) -> list[Hashable]:
        """`targets`, least loaded first."""
        now = self.clock() if now is None else now
        return sorted(targets, key=lambda t: load_key(t, self.in_flight(t), self.estimate(t, now)))

    def pick(self, targets: Iterable[Hashable]) -> Hashable:
        """The least-loaded of `targets` (for one item given at once: `Runtime.generate`)."""
        return self.order(targets)[0]


class Dispatch:
    """Shares the gate's room among the generators waiting in `admit` (see the module docstring)."""

    def __init__(self, generators: int = 0, *, clock: Callable[[], float] = time.monotonic,
                 startup_s: float = STARTUP_S) -> None:
        self.loads = Loads(clock)
        self.generators = generators  # how many will ask (the startup wait); 0: do not wait
        self.startup_s = startup_s
        self._waiting: dict[str, list[int]] = {}  # holder -> the max_groups of each of its admits waiting
        self._leases: dict[str, tuple[int, float]] = {}  # holder -> (groups still wanted, until) after a short ask
        self._granted = False  # the run's first grant happened: no more startup wait
        self._first_ask: float | None = None

    def wait(self, holder: str, max_groups: int) -> None:
        """`holder` starts waiting in `admit` for up to `max_groups` groups."""
        self._waiting.setdefault(holder, []).append(max_groups)
        self._leases.pop(holder, None)
        self.loads.add(holder)
        if self._first_ask is None:
            self._first_ask = self.loads.clock()

    def leave(self, holder: str, max_groups: int, got: int = 0) -> None:
        """`holder`'s admit for `max_groups` returns with `got` groups; short of them, its place is kept a
        while (`LEASE_S`: it asks again at once)."""
        caps = self._waiting.get(holder, [])
        if max_groups in caps:
            caps.remove(max_groups)
        if not caps:
            self._waiting.pop(holder, None)
            if got < max_groups and self.loads.known(holder):  # (not once forgotten: a dead actor's)
                self._leases[holder] = (max_groups - got, self.loads.clock() + LEASE_S)

    def granted(self, holder: str, group_ids: list[int]) -> None:
        for gid in group_ids:
            self.loads.started(holder, gid)
            self._granted = True

    def finished(self, group_id: int, ok: bool = True) -> None:
        """The group left its generator: queued for scoring (`ok`), or released."""
        self.loads.finished(group_id, ok)

    def forget(self, holder: str) -> None:
        self._waiting.pop(holder, None)
        self._leases.pop(holder, None)
        self.loads.forget(holder)

    def starting(self) -> float | None:
        """Seconds the startup wait may still last (None once over: granted, everyone asked, or timed out)."""
        if self._granted or self.generators <= 1 or self._first_ask is None or len(self._waiting) >= self.generators:
            return None
        left = self._first_ask + self.startup_s - self.loads.clock()
        return left if left > 0 else None

    def share(self, holder: str, room: int) -> int:
        """How many of `room` groups `holder` takes now: its part when they are handed out one by one, each
        to the least-loaded generator asking (or holding its place) that still wants one. 0 while it is not
        waiting, or during the startup wait."""
        if holder not in self._waiting or room <= 0 or self.starting() is not None:
            return 0
        now = self.loads.clock()
        caps = {h: want for h, (want, until) in self._leases.items() if until > now}
        caps.update({h: max(c) for h, c in self._waiting.items()})
        seconds = {h: self.loads.estimate(h, now) for h in caps}
        counts = {h: self.loads.in_flight(h) for h in caps}  # in flight, then with the groups handed out here
        heap = [(load_key(h, counts[h], seconds[h]), h) for h in caps]
        heapq.heapify(heap)
        for _ in range(room):  # one group at a time to the least loaded that still wants one
            if not heap:
                break
            _, h = heapq.heappop(heap)
            counts[h] += 1
            caps[h] -= 1
            if h == holder and not caps[h]:
                break
            if caps[h]:
                heapq.heappush(heap, (load_key(h, counts[h], seconds[h]), h))
        return counts[holder] - self.loads.in_flight(holder)

    def report(self) -> dict[str, tuple[int, float | None]]:
        """(groups in flight, mean seconds per group or None) per generator holder, in index order."""
        return {str(h): (self.loads.in_flight(h), self.loads.latency(h)) for h in self.loads.targets()}
