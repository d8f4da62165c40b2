"""ReplayHub: the rollout queue, the staleness gate and the train store behind one async interface.

Place in the dataflow (the runtime hosts one hub inside one async actor; every role calls it):

| caller    | calls                                           | waits for                                 |
|-----------|-------------------------------------------------|-------------------------------------------|
| Generator | `admit` → ids, `put_rollouts`                   | gate capacity; room in the rollout queue  |
| Scorer    | `get_rollouts`, `accept_groups`/`release_groups`| rollouts; train-store room (never, below) |
| Trainer   | `take_step` → P groups, `publish`               | the P oldest live groups all accepted     |

The train store is keyed by group id because the gate, not arrival order, decides training order
(admission order): groups scored out of order wait here until the groups before them are in.

Train capacity and deadlock. The gate guarantees that admitted groups that are neither released nor
consumed never exceed (k + 1) * P (see buffers/gate.py). Stored groups are a subset of those, and a
group being accepted is still running, so with train_capacity >= (k + 1) * P the store always has room
when `accept_groups` runs: it never blocks, and in particular never while the group the trainer waits
for is still running behind a store full of later groups. A smaller train_capacity could deadlock
exactly that way, so the constructor raises it to (k + 1) * P with a logged warning (the memory bound
is then the gate's). Below prompts_per_step it is a config error (as the config schema documents).
"""

from __future__ import annotations

import asyncio
import logging

from asyncrl.messages import Group, Trajectory
from buffers.gate import AdmissionGate
from buffers.queue import BoundedQueue, QueueClosed, Signal, timed_wait

log = logging.getLogger(__name__)


class ReplayHub:
    """All buffers of a run; every method is safe to call concurrently from one event loop."""

    def __init__(
        self,
        *,
        prompts_per_step: int,
        group_size: int,
        max_staleness: int,
        rollout_capacity: int,
        train_capacity: int,
    ) -> None:
        step_samples = prompts_per_step * group_size
        if rollout_capacity < step_samples:
            raise ValueError(
                f"buffer.rollout_capacity = {rollout_capacity} is below one step's samples "
                f"(prompts_per_step * group_size = {step_samples}); raise it"
            )
        if train_capacity < prompts_per_step:
            raise ValueError(
                f"buffer.train_capacity = {train_capacity} is below trainer.prompts_per_step = "
                f"{prompts_per_step}; raise it"
            )
        needed = (max_staleness + 1) * prompts_per_step
        if train_capacity < needed:
            log.warning(
                "buffer.train_capacity = %d raised to (max_staleness + 1) * prompts_per_step = %d: "
                "a smaller train store can deadlock the gate's admission-order training",
                train_capacity, needed,
            )
            train_capacity = needed
        self.gate = AdmissionGate(prompts_per_step=prompts_per_step, max_staleness=max_staleness)
        self.rollouts: BoundedQueue[Trajectory] = BoundedQueue(rollout_capacity, name="rollout queue")
        self.train_capacity = train_capacity
        self._train: dict[int, Group] = {}
        self._train_room = Signal()
        self._closed = False
        self.train_put_wait_s = 0.0
        self.env_counts = {"episodes": 0, "errors": 0, "turns": 0, "truncated": 0}  # env episodes seen (asyncrl/envs)
        # env_counts at the previous and at the latest publish: their difference is the latest step's window
        self._env_marks = (dict.fromkeys(self.env_counts, 0), dict.fromkeys(self.env_counts, 0))
        self._env_marked_version = 0
        self.submitted = {"groups": 0, "dropped_stale": 0}  # groups from asyncrl.Runtime.submit

    # -- generators ----------------------------------------------------------------------------
    async def admit(self, max_groups: int, version: int, timeout: float | None = None) -> list[int]:
        return await self.gate.admit(max_groups, version, timeout)

    async def put_rollouts(self, trajs: list[Trajectory]) -> None:
        self._count_env(trajs)
        await self.rollouts.put_many(trajs)

    def _count_env(self, trajs: list[Trajectory]) -> None:
        """Env episodes pass here on their way to scoring: count them (and their env faults) for metrics."""
        for t in trajs:
            if t.env_reward is not None or t.env_error:
                c = self.env_counts
                c["episodes"] += 1
                c["errors"] += bool(t.env_error)
                c["turns"] += t.turns
                c["truncated"] += t.truncated

    async def submit_group(self, trajs: list[Trajectory], timeout: float | None = None) -> int | None:
        """Admit a group generated outside the generators (`asyncrl.Runtime.submit`) and queue it for scoring.

        The group is admitted at its own min_version, so the gate's staleness bound covers it like any
        generated group: this waits while the capacity rule has no room (backpressure) and returns None
        — the group dropped and counted as `buffer/submitted_dropped_stale` — once the published version
        is newer and a group that old no longer fits. Sets group_id, seq_id (group_id * n + j) and
        group_size on the trajectories. Returns the group id; QueueClosed once the hub is closed;
        TimeoutError after `timeout` seconds without room.
        """
        if not trajs:
            raise ValueError("submit_group: a group needs at least one trajectory")
        version = min(t.min_version for t in trajs)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while True:
            ids = await self.gate.admit(1, version, timeout=0.5)
            if ids:
                break
            if self._closed or self.gate.closed:
                raise QueueClosed("replay hub is closed")
            if self.gate.published_version > version and self.gate.capacity(version) <= self._admitted_live():
                self.submitted["dropped_stale"] += 1
                return None
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"submit_group: no room at the gate within {timeout:g}s")
        gid, n = ids[0], len(trajs)
        for j, t in enumerate(trajs):
            t.group_id, t.seq_id, t.group_size = gid, gid * n + j, n
        self.submitted["groups"] += 1
        await self.put_rollouts(trajs)
        return gid

    def _admitted_live(self) -> int:
        st = self.gate.stats()
        return int(st["accepted"] + st["running"])

    # -- scorers ------------------------------------------------------------------------------
    async def get_rollouts(self, max_items: int, timeout: float | None = None) -> list[Trajectory]:
        return await self.rollouts.get_many(max_items, timeout)

    async def accept_groups(self, groups: list[Group]) -> None:
        """Store scored groups for training and accept them at the gate, in the given order.

        Raises ValueError for a group that is not running at the gate, or whose min_version is
        older than the version it was admitted at (the generator admitted with a newer version than
        its engine held, which would void the staleness bound); QueueClosed once the hub is closed.
        """
        for group in groups:
            self._check_acceptable(group)
            _, waited = await timed_wait(
                self._train_room, lambda: self._closed or len(self._train) < self.train_capacity, None
            )
            self.train_put_wait_s += waited
            if self._closed:
                raise QueueClosed("replay hub is closed")
            self._check_acceptable(group)  # another caller may have accepted it while we waited
            # No await between these two lines: take_step sees a group accepted iff it is stored.
            self.gate.accept(group.group_id)
            self._train[group.group_id] = group

    def _check_acceptable(self, group: Group) -> None:
        gid = group.group_id
        if not self.gate.is_running(gid):
            raise ValueError(f"accept_groups: group {gid} is not running (unknown, accepted or released)")
        admitted_at = self.gate.admitted_version(gid)
        if group.min_version < admitted_at:
            raise ValueError(
                f"accept_groups: group {gid} has min_version {group.min_version} but was admitted at "
                f"version {admitted_at}; a generator must admit with its engine's own version"
            )

    async def release_groups(self, group_ids: list[int], reason: str) -> None:
        """Give back the slots of running groups that will not be trained ("filtered" / "failed")."""
        for gid in group_ids:  # validate all first, so a bad id releases nothing
            if not self.gate.is_running(gid):
                raise ValueError(f"release_groups: group {gid} is not running (unknown, accepted or released)")
        for gid in group_ids:
            self.gate.release(gid, reason)

    # -- trainer ------------------------------------------------------------------------------
    async def take_step(self, step: int, timeout: float | None = None) -> list[Group]:
        """The P groups of train step `step` in admission order; [] on timeout or close."""
        ids = await self.gate.take_step(step, timeout)
        groups = [self._train.pop(gid) for gid in ids]
        if groups:
            self._train_room.notify_all()
        return groups

    async def note_held(self, version: int) -> None:
        """A generator's swap to `version` landed: its admits waiting at older versions return now."""
        self.gate.note_held(version)

    async def publish(self, version: int) -> None:
        self.gate.publish(version)
        if version > self._env_marked_version:  # re-publishing a version is a no-op, here too
            self._env_marked_version = version
            self._env_marks = (self._env_marks[1], dict(self.env_counts))

    # -- lifecycle ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Wake every waiter: gets drain then return [], admit/take_step return [], puts raise."""
        self._closed = True
        self.rollouts.close()
        self.gate.close()
        self._train_room.notify_all()

    async def stats(self) -> dict[str, float]:
        out = {f"buffer/{key}": value for key, value in self.gate.stats().items()}
        out.update({
            "buffer/rollout_depth": float(self.rollouts.qsize()),
            "buffer/rollout_capacity": float(self.rollouts.capacity),
            "buffer/rollouts_put": float(self.rollouts.total_put),
            "buffer/rollouts_got": float(self.rollouts.total_got),
            "buffer/rollout_put_wait_s": self.rollouts.put_wait_s,
            "buffer/rollout_get_wait_s": self.rollouts.get_wait_s,
            "buffer/train_depth": float(len(self._train)),
            "buffer/train_capacity": float(self.train_capacity),
            "buffer/train_put_wait_s": self.train_put_wait_s,
            "buffer/submitted_groups": float(self.submitted["groups"]),
            "buffer/submitted_dropped_stale": float(self.submitted["dropped_stale"]),
        })
        if self.env_counts["episodes"]:
            out.update(self._env_stats())
        return out

    def _env_stats(self) -> dict[str, float]:
        """Env episodes of the latest step — those queued between the previous and the latest `publish`,
        i.e. while the train step that produced the latest version ran (a fixed window: it does not depend
        on how often stats() is called) — and `*_total` since the start of the run."""
        prev, last = self._env_marks
        step = {k: last[k] - prev[k] for k in last}
        c = self.env_counts
        return {"env/episodes": float(step["episodes"]), "env/errors": float(step["errors"]),
                "env/truncated": float(step["truncated"]),
                "env/turns_mean": step["turns"] / step["episodes"] if step["episodes"] else 0.0,
                "env/episodes_total": float(c["episodes"]), "env/errors_total": float(c["errors"]),
                "env/truncated_total": float(c["truncated"])}
