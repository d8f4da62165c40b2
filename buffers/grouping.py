"""Grouping by prompt: turns a stream of scored trajectories into complete `Group`s.

Place in the dataflow: a Scorer takes trajectories from the rollout queue (members of one group may
arrive in any order, from any generator), scores them, and `add`s each here; once all `group_size`
members of a group have arrived, `add` returns the `Group` that goes to the train store
(`ReplayBuffer.accept_groups`) — or, if it is to be filtered, whose id is released at the gate.
"""

from __future__ import annotations

import logging

from asyncrl.messages import Group, Trajectory

log = logging.getLogger(__name__)


class GroupAssembler:
    """Collects trajectories by `group_id` until `trajectory.group_size` members have arrived."""

    def __init__(self) -> None:
        self._pending: dict[int, dict[int, Trajectory]] = {}  # group_id -> seq_id -> trajectory

    def add(self, traj: Trajectory) -> Group | None:
        """Add one member; the complete Group (members sorted by seq_id) when it was the last one.

        Raises ValueError on a duplicate seq_id within a group, a group_size that disagrees with
        the group's earlier members, or a group_size below 1.
        """
        if traj.group_size < 1:
            raise ValueError(f"trajectory {traj.seq_id}: group_size must be >= 1, got {traj.group_size}")
        members = self._pending.setdefault(traj.group_id, {})
        if traj.seq_id in members:
            raise ValueError(f"group {traj.group_id}: duplicate seq_id {traj.seq_id}")
        if members:
            expected = next(iter(members.values())).group_size
            if traj.group_size != expected:
                raise ValueError(
                    f"group {traj.group_id}: trajectory {traj.seq_id} says group_size "
                    f"{traj.group_size}, earlier members said {expected}"
                )
        members[traj.seq_id] = traj
        if len(members) < traj.group_size:
            return None
        del self._pending[traj.group_id]
        ordered = [members[s] for s in sorted(members)]
        return Group(
            group_id=traj.group_id,
            min_version=min(t.min_version for t in ordered),
            trajectories=ordered,
        )

    def discard(self, group_id: int) -> list[Trajectory]:
        """Drop an incomplete group (e.g. it failed and its slot is released); returns its members."""
        members = self._pending.pop(group_id, {})
        return [members[s] for s in sorted(members)]

    def pending(self) -> int:
        """Number of incomplete groups held."""
        return len(self._pending)

    def pending_trajectories(self) -> int:
        """Number of trajectories held in incomplete groups."""
        return sum(len(m) for m in self._pending.values())
