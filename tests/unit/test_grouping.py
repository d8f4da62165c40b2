"""GroupAssembler: complete groups only, min_version over members, duplicates rejected."""

from __future__ import annotations

import pytest

from asyncrl.messages import Trajectory
from buffers.grouping import GroupAssembler


def traj(seq_id: int, group_id: int, group_size: int = 3, min_version: int = 0) -> Trajectory:
    return Trajectory(
        seq_id=seq_id, group_id=group_id, group_size=group_size,
        prompt_ids=[1], response_ids=[2], loss_mask=[True], behavior_logprobs=[-0.5],
        versions=[min_version], min_version=min_version, max_version=min_version, finish_reason="stop",
    )


def test_group_completes_only_when_all_members_arrived_sorted_by_seq_id():
    asm = GroupAssembler()
    assert asm.add(traj(12, group_id=4)) is None
    assert asm.add(traj(10, group_id=4)) is None
    assert asm.add(traj(20, group_id=5)) is None
    assert asm.pending() == 2 and asm.pending_trajectories() == 3
    group = asm.add(traj(11, group_id=4))
    assert group is not None and group.group_id == 4
    assert [t.seq_id for t in group.trajectories] == [10, 11, 12]
    assert asm.pending() == 1


def test_group_min_version_is_the_minimum_over_members():
    asm = GroupAssembler()
    asm.add(traj(0, 1, min_version=3))
    asm.add(traj(1, 1, min_version=1))
    group = asm.add(traj(2, 1, min_version=2))
    assert group is not None and group.min_version == 1


def test_duplicate_seq_id_in_a_group_is_rejected():
    asm = GroupAssembler()
    asm.add(traj(0, 1))
    with pytest.raises(ValueError, match="duplicate seq_id 0"):
        asm.add(traj(0, 1))
    assert asm.pending_trajectories() == 1


def test_disagreeing_group_size_is_rejected():
    asm = GroupAssembler()
    asm.add(traj(0, 1, group_size=3))
    with pytest.raises(ValueError, match="group_size"):
        asm.add(traj(1, 1, group_size=2))


def test_single_member_group_completes_immediately_and_discard_drops_a_partial_group():
    asm = GroupAssembler()
    assert asm.add(traj(0, 1, group_size=1)) is not None
    asm.add(traj(1, 2))
    asm.add(traj(2, 2))
    assert [t.seq_id for t in asm.discard(2)] == [1, 2]
    assert asm.pending() == 0 and asm.discard(2) == []
