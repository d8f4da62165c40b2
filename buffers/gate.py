"""The staleness gate: admission of groups for generation, and the order in which training takes them.

Place in the dataflow: a Generator asks `admit` for group ids before it starts a prompt; the Scorer
`accept`s a finished group (it goes to training) or `release`s it ("filtered", "failed"); the Trainer
`take_step`s the ids of the next P groups to train on and, after its update, `publish`es the new
version. With P = prompts_per_step and k = max_staleness:

Admission (AReaL's capacity rule, in groups). A generator whose engine holds version m may admit a
group only while ``accepted + running < (m + k + 1) * P``; `accepted` counts every group accepted since
the run began (consumed or not), `running` the admitted groups not yet accepted or released. A release
gives the slot back (running -= 1) and is counted per reason, so filtering never deadlocks admission.
The caller passes its OWN engine version, which may lag the published one: stricter, still correct.

Training order (a provable variant of "oldest first, wait for groups with min_version < s - k", which
can exceed the bound: docs/architecture.md): the trainer consumes the non-released groups strictly in ADMISSION order,
P per step. `take_step(s)` waits until the P oldest unconsumed, non-released groups are all accepted
(the wait is `trainer_wait_s`, reported as trainer idle time on the gate).

Why every consumed group has 0 <= staleness = s - min_version <= k:
  * Upper bound. When a group is admitted at version m, the non-released groups admitted so far
    (accepted + running, itself included) number <= (m + k + 1) * P, so its 0-based rank among
    non-released groups in admission order is < (m + k + 1) * P. Later releases of earlier groups
    only lower that rank, later admissions do not change it, and step s consumes ranks
    [s*P, (s+1)*P). So it is consumed at step s <= m + k.
  * Lower bound. `admit` refuses a version m greater than the steps taken (weights of version m
    only exist after m steps; a generator may hold them just before `publish(m)` arrives), so steps
    0..m-1 were already taken when the group was admitted: s >= m.
  `take_step` re-checks both bounds for every group it returns and raises if either were broken.
Corollary used by the buffer: admitted groups that are not released and not yet consumed never exceed
(k + 1) * P (at admission accepted + running <= (m + k + 1) * P and consumed = steps taken * P >= m * P).

Group events. The gate hands out every group id, so it also records what became of each: admitted (a fresh
id draws the prompt of that index from the prompt stream; a restored run's running groups are admitted
again), accepted, or released with its reason and why (`take_events`, drained by the buffer's `stats()`:
RUN_DIR/admissions.jsonl, which benchmarks/faults.py grades against the ledger).

All methods run on one event loop; sync methods wake waiters through `Signal` (no lock needed).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable

import msgspec

from asyncrl.telemetry.metrics import GroupEvents
from buffers.queue import Signal, timed_wait

log = logging.getLogger(__name__)

RELEASE_REASONS = ("filtered", "failed")
DETAIL_CHARS = 300  # of a release's `why` kept in its group event (an exception's message can be long)


@dataclass(slots=True)
class _Live:
    """An admitted group that is neither released nor consumed yet."""

    version: int            # the engine version it was admitted at: its min_version for the gate
    accepted: bool = False  # False while running (generation or scoring)


class GateState(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The gate's counts and live groups at a checkpoint (`AdmissionGate.state` / `restore`)."""

    steps_taken: int
    published: int
    next_id: int                 # the next fresh group id: with prompts indexed by group id, the data position
    accepted: int
    consumed: int
    released: dict[str, int]
    live: list[tuple[int, int, bool]]  # (group id, admitted version, accepted), in admission order


class AdmissionGate:
    """Capacity rule for admission + admission-order consumption; see the module docstring."""

    def __init__(self, *, prompts_per_step: int, max_staleness: int) -> None:
        if prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {prompts_per_step}")
        if max_staleness < 0:
            raise ValueError(f"staleness.max_staleness must be >= 0, got {max_staleness}")
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self._signal = Signal()
        self._closed = False
        self._published = 0
        self._held = 0  # the newest version a generator reported holding (note_held): wakes older admits
        self._held_notes = 0  # note_held calls that raised _held: an admit waiting across one returns []
        self._steps_taken = 0
        self._next_id = 0
        # Ids grow with admission and dicts keep insertion order, so iteration is admission order.
        self._live: dict[int, _Live] = {}
        self._running = 0
        self._accepted = 0
        self._consumed = 0
        self._released = {reason: 0 for reason in RELEASE_REASONS}
        self._regenerate: deque[int] = deque()  # running groups of a restored run, handed out again first
        self._events = GroupEvents()  # since the last take_events(): admitted, accepted, released ids
        self.admit_wait_s = 0.0    # generators blocked on the capacity rule (summed)
        self.trainer_wait_s = 0.0  # trainer blocked in take_step: its idle time on the gate

    # -- state -------------------------------------------------------------------------------
    @property
    def published_version(self) -> int:
        return self._published

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def steps_taken(self) -> int:
        return self._steps_taken

    def capacity(self, version: int) -> int:
        """Groups that may be accepted + running for an engine at `version`."""
        return (version + self.max_staleness + 1) * self.prompts_per_step

    def is_running(self, group_id: int) -> bool:
        entry = self._live.get(group_id)
        return entry is not None and not entry.accepted

    def admitted_version(self, group_id: int) -> int:
        """The version a live (not consumed, not released) group was admitted at."""
        if group_id not in self._live:
            raise ValueError(f"group {group_id} is not admitted, or was already consumed or released")
        return self._live[group_id].version

    # -- generators ----------------------------------------------------------------------------
    async def admit(self, max_groups: int, version: int, timeout: float | None = None,
                    share: Callable[[int], int] | None = None, held: Callable[[], int] | None = None) -> list[int]:
        """Fresh group ids (<= max_groups) admitted at `version`, waiting until at least one fits.

        Returns [] without admitting on timeout, on close, or once the published version (or one a
        generator already holds, `note_held`) is newer than `version` while no group fits (load the
        newer weights, then ask again). `share(room)`: how many of the `room` groups that fit now this
        caller may take (buffers/dispatch.py, several generators waiting); it waits while that is 0.
        `held()`: the version the caller's own generator holds; once it is newer than `version` the wait
        ends too (its note may raise no version the gate had not heard of: another generator noted it
        first; whoever notes it then `nudge`s).
        """
        if max_groups < 1:
            raise ValueError(f"admit: max_groups must be >= 1, got {max_groups}")
        # Weights of version m exist once m steps were taken. A generator may load them before the
        # controller's publish(m) reaches the gate (publish follows the broadcast), so the check is
        # against steps taken, which is all the lower bound of the staleness proof needs.
        if version > self._steps_taken:
            raise ValueError(f"admit: version {version} needs {version} steps taken, only {self._steps_taken} were")

        def room() -> int:
            return self.capacity(version) - (self._accepted + self._running)

        def mine() -> int:
            # a restored run's running groups first (their slots are held), else fresh slots
            free = len(self._regenerate) if self._regenerate else room()
            return min(max_groups, free if share is None or free <= 0 else share(free))

        # A newer held version wakes only admits that were already waiting when it was noted: another
        # generator, still on the older weights, asks again and waits (instead of returning [] at once,
        # forever, until its own swap lands).
        notes = self._held_notes

        def newer() -> bool:
            return (self._published > version or (self._held_notes != notes and self._held > version)
                    or (held is not None and held() > version))

        _, waited = await timed_wait(self._signal, lambda: self._closed or newer() or mine() > 0, timeout)
        self.admit_wait_s += waited
        n = mine()
        if self._closed or n <= 0:
            return []
        if self._regenerate:
            return self._readmit(n, version)
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for gid in ids:
            self._live[gid] = _Live(version)
        self._running += n
        self._events.admitted.extend(ids)
        return ids

    # -- scorers ------------------------------------------------------------------------------
    def _readmit(self, max_groups: int, version: int) -> list[int]:
        """Groups that were running when the restored checkpoint was taken, in admission order: they keep
        their ids (so their prompts) and their slots, and are admitted again at `version`. The bound holds:
        a group's rank in admission order is what it was, and `version` is no older than its first one."""
        ids = [self._regenerate.popleft() for _ in range(min(max_groups, len(self._regenerate)))]
        for gid in ids:
            self._live[gid].version = version
        self._events.admitted.extend(ids)
        return ids

    def state(self) -> GateState:
        """A checkpoint of the gate; running groups are listed with the rest (a restore regenerates them)."""
        return GateState(steps_taken=self._steps_taken, published=self._published, next_id=self._next_id,
                         accepted=self._accepted, consumed=self._consumed, released=dict(self._released),
                         live=[(gid, g.version, g.accepted) for gid, g in self._live.items()])

    def restore(self, state: GateState) -> None:
        """Continue from `state` (a fresh gate, before any admit): accepted groups wait for training as they
        were; running ones are handed out again, first and in admission order, by the next `admit`s."""
        if self._next_id or self._steps_taken:
            raise RuntimeError("restore: the gate has already been used")
        self._steps_taken, self._published, self._held = state.steps_taken, state.published, state.published
        self._next_id, self._accepted, self._consumed = state.next_id, state.accepted, state.consumed
        self._released = {reason: state.released.get(reason, 0) for reason in RELEASE_REASONS}
        self._live = {gid: _Live(version, accepted) for gid, version, accepted in state.live}
        self._running = sum(not accepted for _, _, accepted in state.live)
        self._regenerate = deque(gid for gid, _, accepted in state.live if not accepted)
        self._signal.notify_all()

    def accept(self, group_id: int) -> None:
        """A running group finished scoring and goes to training."""
        if not self.is_running(group_id):
            raise ValueError(f"accept: group {group_id} is not running (unknown, accepted or released)")
        self._live[group_id].accepted = True
        self._running -= 1
        self._accepted += 1
        self._events.accepted.append(group_id)
        self._signal.notify_all()

    def release(self, group_id: int, reason: str, detail: str = "") -> None:
        """A running group will not be trained ("filtered" or "failed"): its slot is returned. `detail` says why
        (its group event keeps it)."""
        if reason not in RELEASE_REASONS:
            raise ValueError(f"release: reason must be one of {RELEASE_REASONS}, got {reason!r}")
        if not self.is_running(group_id):
            raise ValueError(f"release: group {group_id} is not running (unknown, accepted or released)")
        del self._live[group_id]
        self._running -= 1
        self._released[reason] += 1
        self._events.released.append((group_id, reason, detail[:DETAIL_CHARS]))
        self._signal.notify_all()

    # -- trainer ------------------------------------------------------------------------------
    async def take_step(self, step: int, timeout: float | None = None) -> list[int]:
        """Ids of the P oldest live groups, in admission order, once all of them are accepted.

        `step` must be the number of steps taken so far. Returns [] on timeout or close.
        """
        if step != self._steps_taken:
            raise ValueError(f"take_step: expected step {self._steps_taken}, got {step}")
        p = self.prompts_per_step
        ok, waited = await timed_wait(self._signal, lambda: self._closed or self._head_ready(), timeout)
        self.trainer_wait_s += waited
        if self._closed or not ok:
            return []
        ids = list(islice(self._live, p))
        for gid in ids:
            staleness = step - self._live.pop(gid).version
            if not 0 <= staleness <= self.max_staleness:  # the module docstring proves this holds
                raise RuntimeError(f"group {gid} has staleness {staleness} at step {step}: gate invariant broken")
        self._consumed += p
        self._steps_taken += 1
        return ids

    async def wait_step(self, step: int, timeout: float | None = None) -> bool:
        """Wait until `take_step(step)` would return at once, without taking anything (colocated placement: the
        generators sleep between this and the take). Once true it stays true until the take: the P oldest live
        groups are accepted, and accepted groups are never released. The wait is the trainer's
        (`trainer_wait_s`). False on timeout or close."""
        if step != self._steps_taken:
            raise ValueError(f"wait_step: expected step {self._steps_taken}, got {step}")
        ok, waited = await timed_wait(self._signal, lambda: self._closed or self._head_ready(), timeout)
        self.trainer_wait_s += waited
        return ok and not self._closed

    def _head_ready(self) -> bool:
        """The P oldest live groups (admission order) are all accepted."""
        head = list(islice(self._live.values(), self.prompts_per_step))
        return len(head) == self.prompts_per_step and all(g.accepted for g in head)

    def publish(self, version: int) -> None:
        """The trainer published weights `version`; wakes waiters. Re-publishing a version is a no-op."""
        if version < self._published:
            raise ValueError(f"publish: version {version} is older than the published {self._published}")
        if version > self._steps_taken:
            # The lower staleness bound needs steps 0..version-1 taken before version is published.
            raise ValueError(f"publish: version {version} needs {version} steps taken, only {self._steps_taken} were")
        if version > self._published:
            self._published = version
            self._signal.notify_all()

    def nudge(self) -> None:
        """Wake the waiting admits to ask their `share` again (who waits, or what each holds, changed)."""
        self._signal.notify_all()

    def note_held(self, version: int) -> None:
        """A generator holds weights `version` (its swap landed): wake admits waiting at older versions now,
        instead of at `publish`, which follows every generator's swap. Admission rules are unchanged."""
        if version > self._steps_taken:
            raise ValueError(f"note_held: version {version} needs {version} steps taken, only {self._steps_taken} were")
        if version > self._held:
            self._held = version
            self._held_notes += 1
            self._signal.notify_all()

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wake every waiter: admit and take_step return []; accept/release still account."""
        self._closed = True
        self._signal.notify_all()

    def take_events(self) -> GroupEvents:
        """The group events since the previous call (and forget them)."""
        out, self._events = self._events, GroupEvents()
        return out

    def stats(self) -> dict[str, float]:
        return {
            "admitted": float(self._next_id),
            "accepted": float(self._accepted),
            "consumed": float(self._consumed),
            "running": float(self._running),
            "filtered": float(self._released["filtered"]),
            "failed": float(self._released["failed"]),
            "published_version": float(self._published),
            "steps_taken": float(self._steps_taken),
            "admit_wait_s": self.admit_wait_s,
            "trainer_wait_s": self.trainer_wait_s,
        }
