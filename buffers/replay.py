"""ReplayBuffer: the rollout queue, the staleness gate and the train store behind one async interface.

Place in the dataflow (the runtime hosts one buffer inside one async actor; every role calls it):

| caller    | calls                                           | waits for                                 |
|-----------|-------------------------------------------------|-------------------------------------------|
| Generator | `admit` → ids, `put_rollouts`                   | gate capacity (its share); rollout room   |
| Scorer    | `get_rollouts`, `accept_groups`/`release_groups`| rollouts; train-store room (never, below) |
| Trainer   | `take_step` → P groups, `publish`               | the P oldest live groups all accepted     |
| Controller| `wait_step` (colocated placement), `publish`    | the same, without taking them             |

Whole groups. The rollout queue's unit is a group: `put_rollouts` takes whole groups only (a generator puts
a group's trajectories together) and queues each at once, when all of it fits; `get_rollouts` hands out
whole groups only. Each scorer assembles the groups it scores on its own, so a group split between two
scorers would complete in neither, and the trainer would wait for it forever. The queue's capacity is
still counted in trajectories (`buffer.rollout_capacity`); a group larger than all of it goes into an
empty queue alone.

The train store is keyed by group id because the gate, not arrival order, decides training order
(admission order): groups scored out of order wait here until the groups before them are in.

Train capacity and deadlock. The gate guarantees that admitted groups that are neither released nor
consumed never exceed (k + 1) * P (see buffers/gate.py). Stored groups are a subset of those, and a
group being accepted is still running, so with train_capacity >= (k + 1) * P the store always has room
when `accept_groups` runs: it never blocks, and in particular never while the group the trainer waits
for is still running behind a store full of later groups. A smaller train_capacity could deadlock
exactly that way, so the constructor raises it to (k + 1) * P with a logged warning (the memory bound
is then the gate's). Below prompts_per_step it is a config error (as the config schema documents).

Metrics. `stats()` reports the buffer's window (since its previous call): the gate's and the queues' counts
and waits of the window as `Total`s (the Controller adds them up: `buffer/*` are counts since the start),
the depths now, and the env episodes that reached the rollout queue in the window. The buffer holds the one
count of failed groups (`buffer/failed`: released as failed by a generator or a scorer), of filtered
groups (`buffer/filtered`, also `dapo/groups_filtered` under dynamic sampling) and of env episodes. The
report also carries the gate's group events of the window (ids admitted, accepted, released and why:
RUN_DIR/admissions.jsonl).

Holders (supervision). Each running group is held by the roles that have a part of it: the generator that
admitted it (`admit(..., holder=)`) until its rollouts are queued, then the queue, then every scorer that took
one of its trajectories (`get_rollouts(..., holder=)`). When a generator or scorer actor dies, the Controller
calls `release_holder` with its name (one per actor incarnation: a restarted actor gets a fresh one): every
running group it held is released as "failed" (its slot returns,
the gate admits a fresh prompt in its place) and remembered as abandoned, so a late accept or release of one
of them (a trajectory of it still queued, a put that was in flight) is dropped and counted
(`buffer/abandoned`) instead of failing the scorer. An admit of the dead actor (still waiting, or arriving
late) gets nothing; a get of it that returns later releases what it got at once. Accepted groups are never
released.

Several generators. They pull: each asks `admit` for its free slots. When several wait at once, the gate's
room goes to them least loaded first (buffers/dispatch.py: fewest groups in flight, weighted by each one's
seconds per group), so a slow generator is given few groups and the fast ones most; `stats()` reports each
one's groups in flight and seconds per group (`generator/<i>/in_flight`, `generator/<i>/group_s`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from asyncrl.messages import Group, Trajectory
from asyncrl.telemetry.memory import peak_memory_metrics
from asyncrl.telemetry.metrics import (
    GroupEvents,
    Last,
    Max,
    Mean,
    ProcessCpu,
    RoleStats,
    Sum,
    Total,
    Window,
    process_cpu_metrics,
    rss_mb,
)
from buffers.dispatch import Dispatch
from buffers.gate import AdmissionGate, GateState
from buffers.progress import Progress, ProgressTracker
from buffers.queue import BoundedQueue, QueueClosed, Signal, timed_wait

log = logging.getLogger(__name__)


class BufferState(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a checkpoint keeps of the buffer: the gate, the groups accepted and not yet trained (whole,
    in admission order), and the counters behind its metrics. Trajectories still queued for scoring belong
    to running groups, which a restored run regenerates."""

    gate: GateState
    train: list[Group]
    env_counts: dict[str, int]
    submitted: dict[str, int]
    window: dict[str, float]


class ReplayBuffer:
    """All buffers of a run; every method is safe to call concurrently from one event loop."""

    # this role's process's CPU for its window (`<role>/cpu_cores`): given by the Ray actor built for it (RoleActor)
    process_cpu: ProcessCpu | None = None

    def __init__(
        self,
        *,
        prompts_per_step: int,
        group_size: int,
        max_staleness: int,
        rollout_capacity: int,
        train_capacity: int,
        report_filtered: bool = False,
        generators: int = 0,
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
        # one item per group, sized by its trajectories: buffer.rollout_capacity counts trajectories
        self.rollouts: BoundedQueue[list[Trajectory]] = BoundedQueue(rollout_capacity, name="rollout queue", size=len)
        self.train_capacity = train_capacity
        self._train: dict[int, Group] = {}
        self._train_room = Signal()
        self._closed = False
        self.train_put_wait_s = 0.0
        self.env_counts = {"episodes": 0, "errors": 0, "turns": 0, "truncated": 0,
                           "tool_calls": 0, "tool_errors": 0}  # env episodes seen (asyncrl/envs)
        self.report_filtered = report_filtered  # DAPO dynamic sampling: filtered groups are refilled, report them
        self._window = Window()  # what stats() reported so far: its next report is the increment
        self.submitted = {"groups": 0, "dropped_stale": 0}  # groups from asyncrl.Runtime.submit
        self.tracker = ProgressTracker()  # released groups in a row and why (the Controller's watch reads it)
        self._holders: dict[int, set[str]] = {}  # running group id -> the roles holding part of it
        self._abandoned: set[int] = set()  # released by release_holder: late accepts/releases are dropped
        self._gone: set[str] = set()  # holders released: what a late call of theirs admits or takes is released
        self._held_by: dict[str, int] = {}  # holder -> the newest version it reported holding (note_held)
        self.abandoned = {"groups": 0, "late": 0}  # released by release_holder; late accepts/releases dropped
        # the gate's room among the generators asking at once: least loaded first (buffers/dispatch.py)
        self.dispatch = Dispatch(generators)

    # -- generators ----------------------------------------------------------------------------
    async def admit(self, max_groups: int, version: int, timeout: float | None = None,
                    holder: str | None = None) -> list[int]:
        """Group ids admitted at `version` (see AdmissionGate.admit); `holder` (e.g. "generator/0") holds them
        until their rollouts are queued. Generators asking at once share the gate's room, least loaded first
        (`holder` names the generator: buffers/dispatch.py); without a holder the caller takes what fits."""
        if holder is None:
            return await self.gate.admit(max_groups, version, timeout)
        if holder in self._gone:  # a call of a dead actor that arrives late: nobody would generate these
            return []
        self.dispatch.wait(holder, max_groups)
        self.gate.nudge()  # the others' shares changed: one more asking
        startup = self.dispatch.starting()  # the first admission waits for every generator, not past this
        if startup is not None:
            timeout = startup if timeout is None else min(timeout, startup)
        ids: list[int] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                ids = await self.gate.admit(max_groups, version, timeout,
                                            share=lambda room: self.dispatch.share(holder, room),
                                            held=lambda: self._held_by.get(holder, -1))
                # this generator swapped to newer weights meanwhile (note_held): admit at them here instead of
                # returning [] for it to ask again (a round trip on the path from a weight swap to generation)
                held = self._held_by.get(holder, version)
                if ids or held <= version or self.gate.closed or holder in self._gone:
                    break
                version = held
                if deadline is not None:
                    timeout = deadline - time.monotonic()
                    if timeout <= 0:
                        break
            self.dispatch.granted(holder, ids)  # (no await since the grant: the next share sees it)
        finally:
            self.dispatch.leave(holder, max_groups, len(ids))
            self.gate.nudge()  # the others' shares changed: its load higher
        for gid in ids:
            self._holders[gid] = {holder}
        if holder in self._gone:  # a dead actor's admit that was waiting: nobody will generate these
            await self.release_holder(holder)
            return []
        return ids

    async def put_rollouts(self, trajs: list[Trajectory]) -> None:
        """Queue whole groups for scoring: `trajs` is one group's trajectories after another's (each group's
        `group_size` of them, one group_id). Each group goes in at once, when all of it fits. ValueError
        (nothing queued) when a group is not whole; QueueClosed once the buffer is closed."""
        if self._closed:
            raise QueueClosed("replay buffer is closed")
        groups = whole_groups(trajs)
        for group in groups:  # sampled: the generator's engine is done with them (its load and speed)
            self.dispatch.finished(group[0].group_id)
        self.gate.nudge()
        self._count_env(trajs)
        await self.rollouts.put_many(groups)
        for gid in {t.group_id for t in trajs}:  # queued: the generator no longer holds them
            if gid in self._holders:
                self._holders[gid] = {"queue"}

    def _count_env(self, trajs: list[Trajectory]) -> None:
        """Env episodes pass here on their way to scoring: count them (and their env faults) for metrics."""
        for t in trajs:
            if t.env_reward is not None or t.env_error:
                c = self.env_counts
                c["episodes"] += 1
                c["errors"] += bool(t.env_error)
                c["turns"] += t.turns
                c["truncated"] += t.truncated
                c["tool_calls"] += t.tool_calls
                c["tool_errors"] += t.tool_errors

    async def submit_group(self, trajs: list[Trajectory], timeout: float | None = None) -> int | None:
        """Admit a group generated outside the generators (`asyncrl.Runtime.submit`) and queue it for scoring.

        The group is admitted at its own min_version, so the gate's staleness bound covers it like any
        generated group: this waits while the capacity rule has no room (backpressure) and returns None
        — the group dropped and counted as `buffer/submitted_dropped_stale` — once the published version
        is newer and a group that old no longer fits. Sets group_id, seq_id (group_id * n + j), group_size
        and generator_id (-1: no generator loop's) on the trajectories. Returns the group id; QueueClosed
        once the buffer is closed; TimeoutError after `timeout` seconds without room.
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
                raise QueueClosed("replay buffer is closed")
            if self.gate.published_version > version and self.gate.capacity(version) <= self._admitted_live():
                self.submitted["dropped_stale"] += 1
                return None
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"submit_group: no room at the gate within {timeout:g}s")
        gid, n = ids[0], len(trajs)
        for j, t in enumerate(trajs):
            t.group_id, t.seq_id, t.group_size = gid, gid * n + j, n
            t.generator_id = -1  # sampled outside the generators' loops: counted for none of them
        self.submitted["groups"] += 1
        await self.put_rollouts(trajs)
        return gid

    def _admitted_live(self) -> int:
        st = self.gate.stats()
        return int(st["accepted"] + st["running"])

    # -- scorers ------------------------------------------------------------------------------
    async def get_rollouts(self, max_items: int, timeout: float | None = None,
                           holder: str | None = None) -> list[Trajectory]:
        """Whole groups, oldest first, at most `max_items` trajectories (but always the oldest group, however
        large); [] on timeout, or once the buffer is closed and the queue drained. `holder` (e.g. "scorer/0")
        then holds these groups too (supervision releases them if it dies)."""
        trajs = [t for group in await self.rollouts.get_many(max_items, timeout) for t in group]
        if holder is not None:
            for gid in {t.group_id for t in trajs}:
                if gid in self._holders:
                    self._holders[gid].add(holder)
            if holder in self._gone:  # a dead actor's get that was waiting: these trajectories are lost
                await self.release_holder(holder)
                return []
        return trajs

    async def release_holder(self, holder: str) -> list[int]:
        """`holder` died: release every running group it held as "failed" (a fresh prompt takes its slot);
        late accepts or releases of them are dropped. Returns their ids."""
        self._gone.add(holder)
        self._held_by.pop(holder, None)
        self.dispatch.forget(holder)
        self.gate.nudge()
        ids = [gid for gid, held in self._holders.items() if holder in held and self.gate.is_running(gid)]
        for gid in ids:
            self.gate.release(gid, "failed", f"{holder} died")
            del self._holders[gid]
            self._abandoned.add(gid)
        self.abandoned["groups"] += len(ids)
        self.tracker.released(len(ids), "failed", f"{holder} died")
        if ids:
            log.warning("%s died: %d running groups released as failed: %s", holder, len(ids), ids)
        return ids

    def _drop_abandoned(self, gids: list[int]) -> list[int]:
        """The ids of `gids` that were not abandoned; the others are counted and forgotten."""
        kept = [gid for gid in gids if gid not in self._abandoned]
        for gid in set(gids) - set(kept):
            self._abandoned.discard(gid)
            self.abandoned["late"] += 1
        return kept

    async def accept_groups(self, groups: list[Group]) -> None:
        """Store scored groups for training and accept them at the gate, in the given order.

        Raises ValueError for a group that is not running at the gate, or whose min_version is
        older than the version it was admitted at (the generator admitted with a newer version than
        its engine held, which would void the staleness bound); QueueClosed once the buffer is closed.
        A group released by `release_holder` (abandoned) is dropped.
        """
        kept = set(self._drop_abandoned([g.group_id for g in groups]))
        for group in [g for g in groups if g.group_id in kept]:
            self._check_acceptable(group)
            _, waited = await timed_wait(
                self._train_room, lambda: self._closed or len(self._train) < self.train_capacity, None
            )
            self.train_put_wait_s += waited
            if self._closed:
                raise QueueClosed("replay buffer is closed")
            self._check_acceptable(group)  # another caller may have accepted it while we waited
            # No await between these two lines: take_step sees a group accepted iff it is stored.
            self.gate.accept(group.group_id)
            self._train[group.group_id] = group
            self.tracker.accepted(1)
            self._holders.pop(group.group_id, None)

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

    async def release_groups(self, group_ids: list[int], reason: str, detail: str = "") -> None:
        """Give back the slots of running groups that will not be trained ("filtered" / "failed"); `detail`
        says why in a few words (the reward's error, "rewards all 0"), for the error of a run in which every
        group fails (`progress`). Abandoned groups (`release_holder`) were released already and are dropped."""
        group_ids = self._drop_abandoned(group_ids)
        for gid in group_ids:  # validate all first, so a bad id releases nothing
            if not self.gate.is_running(gid):
                raise ValueError(f"release_groups: group {gid} is not running (unknown, accepted or released)")
        for gid in group_ids:
            self.gate.release(gid, reason, detail)
            self._holders.pop(gid, None)
            self.dispatch.finished(gid, ok=False)  # a generator's failed group (a scorer's: no longer in flight)
        self.tracker.released(len(group_ids), reason, detail)

    async def group_events(self) -> GroupEvents:
        """The gate's group events not yet reported (`stats()` carries them each step): the Controller's last
        call, once the roles' loops have stopped, so that RUN_DIR/admissions.jsonl misses none."""
        return self.gate.take_events()

    async def progress(self) -> Progress:
        """Groups released in a row since the last accepted one, their last distinct reasons, and the
        seconds since a group was accepted or a step taken (buffers/progress.py)."""
        return self.tracker.report()

    # -- trainer ------------------------------------------------------------------------------
    async def take_step(self, step: int, timeout: float | None = None) -> list[Group]:
        """The P groups of train step `step` in admission order; [] on timeout or close."""
        ids = await self.gate.take_step(step, timeout)
        groups = [self._train.pop(gid) for gid in ids]
        if groups:
            self._train_room.notify_all()
            self.tracker.stepped()
        return groups

    async def wait_step(self, step: int, timeout: float | None = None) -> bool:
        """Wait until step `step`'s groups are all accepted (`take_step` would return at once), taking nothing:
        with colocated placement the Controller then puts the generators to sleep before the trainer takes
        them (asyncrl/pipeline.py). False on timeout or close."""
        return await self.gate.wait_step(step, timeout)

    async def note_held(self, version: int, holder: str | None = None) -> None:
        """A generator's swap to `version` landed: admits waiting at older versions return now; its own
        (`holder`) goes on waiting at `version` instead."""
        self.gate.note_held(version)  # (raises for a version no step made yet)
        if holder is not None and version > self._held_by.get(holder, -1):
            self._held_by[holder] = version
            # its admit waiting at an older version hears of it even when another generator noted the
            # version first (the gate's own wake-up is for versions it had not heard of)
            self.gate.nudge()

    async def publish(self, version: int) -> None:
        """Every generator holds `version`: the gate admits at it from now on."""
        self.gate.publish(version)

    # -- checkpoint -----------------------------------------------------------------------------
    async def state(self) -> BufferState:
        """The buffer's part of a checkpoint (accepted groups whole; running ones by id only)."""
        gate = self.gate.state()
        return BufferState(gate=gate, train=[self._train[gid] for gid, _, accepted in gate.live if accepted],
                           env_counts=dict(self.env_counts), submitted=dict(self.submitted),
                           window=self._window.marks())

    async def restore(self, state: BufferState) -> None:
        """Continue from a checkpoint (a fresh buffer, before the generators start): the accepted groups are
        trained as they were; the running ones are generated again, with their ids (`AdmissionGate.restore`)."""
        self.gate.restore(state.gate)
        self._train = {g.group_id: g for g in state.train}
        self.env_counts.update(state.env_counts)
        self.submitted.update(state.submitted)
        self._window = Window(state.window)

    # -- lifecycle ----------------------------------------------------------------------------
    async def close(self) -> None:
        """Wake every waiter: gets drain then return [], admit/take_step return [], puts raise."""
        self._closed = True
        self.rollouts.close()
        self.gate.close()
        self._train_room.notify_all()

    async def stats(self) -> RoleStats:
        """The buffer's report of its window: what happened since the previous `stats()` call."""
        gate, take = self.gate.stats(), self._window.take
        counts = {key: gate[key] for key in ("admitted", "accepted", "consumed", "filtered", "failed",
                                             "admit_wait_s", "trainer_wait_s")}
        counts.update({
            "rollout_put_wait_s": self.rollouts.put_wait_s, "rollout_get_wait_s": self.rollouts.get_wait_s,
            "train_put_wait_s": self.train_put_wait_s,
            "submitted_groups": self.submitted["groups"], "submitted_dropped_stale": self.submitted["dropped_stale"],
            "abandoned": self.abandoned["groups"],
        })
        metrics = {f"buffer/{key}": Total(take(key, value)) for key, value in counts.items()}
        metrics["buffer/running"] = Last(gate["running"])
        metrics["buffer/rollout_depth"] = Last(float(self.rollouts.qsize()))
        metrics["buffer/train_depth"] = Last(float(len(self._train)))
        metrics["buffer/rss_mb"] = Max(rss_mb())
        metrics.update(process_cpu_metrics("buffer", self.process_cpu))  # (with the scorers it hosts)
        for holder, (in_flight, seconds) in self.dispatch.report().items():  # what the routing sees, per generator
            role = holder.split("#")[0]  # "generator/0#1" (a restarted actor's name) -> "generator/0"
            metrics[f"{role}/in_flight"] = Last(float(in_flight))
            if seconds is not None:
                metrics[f"{role}/group_s"] = Last(seconds)
        metrics.update(peak_memory_metrics("buffer", "buffer"))
        groups = self.gate.take_events()
        if self.report_filtered:  # the window's filtered groups, each refilled with a fresh prompt by the gate
            metrics["dapo/groups_filtered"] = Sum(metrics["buffer/filtered"].value)
            metrics["dapo/groups_filtered_total"] = Total(metrics["buffer/filtered"].value)
        if self.env_counts["episodes"]:  # env metrics once env episodes flow (asyncrl/envs)
            metrics.update(self._env_metrics())
        return RoleStats(metrics=metrics, groups=groups or None)

    def _env_metrics(self) -> dict[str, Sum | Mean | Total]:
        """Env episodes queued in the window (their turns, errors, truncations) and, as `Total`s, since the
        start. Turns per episode is a `Mean` weighted by episodes: NaN (null) in a window without any."""
        window = {key: self._window.take(f"env/{key}", value) for key, value in self.env_counts.items()}
        episodes = window["episodes"]
        return {"env/episodes": Sum(episodes), "env/errors": Sum(window["errors"]),
                "env/truncated": Sum(window["truncated"]),
                "env/turns_mean": Mean(window["turns"] / episodes if episodes else 0.0, weight=episodes),
                "env/episodes_total": Total(episodes), "env/errors_total": Total(window["errors"]),
                "env/truncated_total": Total(window["truncated"]),
                "env/tool_calls": Sum(window["tool_calls"]), "env/tool_errors": Sum(window["tool_errors"]),
                "env/tool_calls_total": Total(window["tool_calls"]),
                "env/tool_errors_total": Total(window["tool_errors"])}


def whole_groups(trajs: list[Trajectory]) -> list[list[Trajectory]]:
    """Split a batch into its groups: `group_size` consecutive trajectories of one group_id each. Raises
    ValueError (one line) for a batch that does not consist of whole groups."""
    groups: list[list[Trajectory]] = []
    i = 0
    while i < len(trajs):
        first = trajs[i]
        members = trajs[i : i + max(first.group_size, 1)]
        if first.group_size < 1 or len(members) < first.group_size or any(
                t.group_id != first.group_id or t.group_size != first.group_size for t in members):
            raise ValueError(f"put_rollouts: group {first.group_id} (group_size {first.group_size}) does not come "
                             f"whole; put whole groups only, one group's trajectories after another's")
        groups.append(members)
        i += len(members)
    return groups
