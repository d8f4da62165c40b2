"""Least-loaded dispatch (buffers/dispatch.py): the gate's room goes to the waiting generators by expected
wait — fewest groups in flight among equals, a slow one only when the fast ones are busier — without
touching the gate's exactly-once accounting or its staleness bound."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncrl.messages import Group, Trajectory
from asyncrl.telemetry.metrics import Last, generator_staleness_stats
from buffers.dispatch import LEASE_S, Dispatch, Loads, natural_key
from buffers.queue import QueueClosed
from buffers.replay import ReplayBuffer


def run(coro, timeout: float = 5.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def traj(group_id: int, j: int, size: int, version: int, generator_id: int = 0) -> Trajectory:
    return Trajectory(seq_id=group_id * size + j, group_id=group_id, group_size=size, prompt_ids=[1],
                      response_ids=[2], loss_mask=[True], behavior_logprobs=[-1.0], versions=[version],
                      min_version=version, max_version=version, finish_reason="stop", generator_id=generator_id)


def finish(dispatch: Dispatch, clock: Clock, holder: str, seconds: float, gid: int) -> None:
    """`holder` samples group `gid` in `seconds`."""
    dispatch.granted(holder, [gid])
    clock.now += seconds
    dispatch.finished(gid)


def test_equal_generators_share_the_room_by_fewest_in_flight_and_ties_go_to_the_lower_index():
    d = Dispatch()
    d.wait("generator/1", 8)
    d.wait("generator/0", 8)
    assert (d.share("generator/0", 4), d.share("generator/1", 4)) == (2, 2)
    assert (d.share("generator/0", 3), d.share("generator/1", 3)) == (2, 1)  # the odd one: the lower index
    d.granted("generator/0", [0, 1])  # generator 0 already holds two: the next two go to generator 1
    assert (d.share("generator/0", 2), d.share("generator/1", 2)) == (0, 2)
    assert d.share("generator/2", 4) == 0  # not asking: no share


def test_a_generator_slow_per_group_gets_nothing_while_a_fast_one_wants_the_room_and_the_rest_once_it_is_full():
    clock = Clock()
    d = Dispatch(clock=clock)
    finish(d, clock, "generator/0", 1.0, 0)  # slow: a second per group
    finish(d, clock, "generator/1", 0.01, 1)  # fast
    d.wait("generator/0", 8)
    d.wait("generator/1", 8)
    assert (d.share("generator/0", 6), d.share("generator/1", 6)) == (0, 6)
    d.leave("generator/1", 8)
    d.wait("generator/1", 2)  # the fast one has only two free slots: the slow one takes what is left
    assert (d.share("generator/0", 6), d.share("generator/1", 6)) == (4, 2)


def test_a_generator_asking_again_keeps_its_place_for_a_round_trip_and_loses_it_after():
    clock = Clock()
    d = Dispatch(clock=clock)
    d.wait("generator/0", 4)
    d.leave("generator/0", 4, got=0)  # a timeout or a newer version: it asks again at once (over Ray: later)
    d.wait("generator/1", 4)
    assert d.share("generator/1", 4) == 2  # generator 0's half stays free for it
    clock.now += LEASE_S + 0.01  # it did not ask again in time: it stopped asking
    assert d.share("generator/1", 4) == 4
    d.forget("generator/1")
    d.leave("generator/1", 4, got=0)  # a dead actor's admit returning: keeps no place
    d.wait("generator/0", 4)
    assert d.share("generator/0", 4) == 4


def test_a_generator_whose_group_hangs_looks_as_slow_as_that_group_is_old():
    clock = Clock()
    d = Dispatch(clock=clock)
    finish(d, clock, "generator/0", 0.1, 0)
    finish(d, clock, "generator/1", 0.2, 1)
    d.granted("generator/0", [2])
    clock.now += 5.0  # generator 0's group has run for 5 s: its expected wait is no longer 0.1 s per group
    d.wait("generator/0", 4)
    d.wait("generator/1", 4)
    assert (d.share("generator/0", 4), d.share("generator/1", 4)) == (0, 4)


def test_a_generator_with_no_finished_group_counts_as_the_mean_of_the_known_ones():
    clock = Clock()
    loads = Loads(clock)
    loads.started("a", 0)
    clock.now += 0.5
    loads.finished(0)
    assert loads.estimate("b", clock.now) == 0.5 and loads.latency("b") is None
    assert Loads(clock).estimate("b", clock.now) == 1.0  # none known: only counts matter
    loads.started("c", 1)
    loads.finished(1, ok=False)  # a failure says nothing about speed
    assert loads.latency("c") is None


def test_ties_follow_the_generator_index_not_the_spelling():
    assert natural_key("generator/2#0") < natural_key("generator/10#0")
    assert Loads().order(["generator/10", "generator/2", "generator/1#3"]) == ["generator/1#3", "generator/2",
                                                                               "generator/10"]


def test_the_first_admission_waits_until_every_generator_asks_then_splits_the_room():
    async def main():
        buf = ReplayBuffer(prompts_per_step=2, group_size=1, max_staleness=1, rollout_capacity=8,
                           train_capacity=8, generators=2)  # room at version 0: 4 groups
        first = asyncio.ensure_future(buf.admit(8, 0, timeout=2.0, holder="generator/0"))
        await asyncio.sleep(0.05)
        assert not first.done()  # generator 1 has not asked yet
        second = await buf.admit(8, 0, timeout=2.0, holder="generator/1")
        return await first, second

    first, second = run(main())
    assert len(first) == len(second) == 2 and sorted(first + second) == [0, 1, 2, 3]


def test_the_first_admission_waits_no_longer_than_the_startup_wait_for_a_generator_that_never_asks():
    async def main():
        buf = ReplayBuffer(prompts_per_step=2, group_size=1, max_staleness=1, rollout_capacity=8,
                           train_capacity=8, generators=2)
        buf.dispatch.startup_s = 0.05
        got = await buf.admit(8, 0, timeout=2.0, holder="generator/0")  # [] once the startup wait is over
        return got or await buf.admit(8, 0, timeout=2.0, holder="generator/0")

    assert run(main()) == [0, 1, 2, 3]


def test_a_freed_slot_goes_to_the_waiting_generator_that_holds_fewer_groups():
    async def main():
        buf = ReplayBuffer(prompts_per_step=2, group_size=1, max_staleness=1, rollout_capacity=8, train_capacity=8)
        assert await buf.admit(3, 0, holder="generator/0") == [0, 1, 2]  # room at version 0: 4 groups
        assert await buf.admit(8, 0, holder="generator/1") == [3]
        got: dict[str, list[int]] = {"generator/0": [], "generator/1": []}

        async def ask(holder: str) -> None:
            while not buf.gate.closed:
                got[holder] += await buf.admit(8, 0, timeout=0.05, holder=holder)

        asking = [asyncio.ensure_future(ask(h)) for h in got]
        await asyncio.sleep(0.01)
        await buf.release_groups([0], "failed")  # generator 0 holds 2, generator 1 holds 1: to generator 1
        await asyncio.sleep(0.01)
        first = {h: list(ids) for h, ids in got.items()}
        await buf.release_groups([1, 3], "failed")  # generator 0 holds 1, generator 1 holds 1: one each
        await asyncio.sleep(0.01)
        await buf.close()
        await asyncio.gather(*asking)
        return first, got

    first, got = run(main())
    assert first == {"generator/0": [], "generator/1": [4]}
    assert len(got["generator/0"]) == 1 and len(got["generator/1"]) == 2  # the second time, one slot each
    assert sorted(got["generator/0"] + got["generator/1"]) == [4, 5, 6]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generators_of_different_speeds_keep_exactly_once_accounting_and_the_staleness_bound(seed):
    """Three generators (one 10x slower), random failures and filtering: every admitted group is consumed,
    released or still live exactly once, each step trains P groups in admission order, staleness <= k."""
    p, size, k, steps = 3, 2, 1, 12
    rng = random.Random(seed)

    async def main():
        buf = ReplayBuffer(prompts_per_step=p, group_size=size, max_staleness=k, rollout_capacity=4 * p * size,
                           train_capacity=4 * p, generators=3)
        trained: list[tuple[int, int, int]] = []  # (step, group id, generator)
        by_gid: dict[int, int] = {}

        async def generator(i: int, delay: float) -> None:
            while not buf.gate.closed:
                version = buf.gate.published_version
                ids = await buf.admit(2, version, timeout=0.2, holder=f"generator/{i}")
                for gid in ids:
                    await asyncio.sleep(delay * rng.random())
                    by_gid[gid] = i
                    if rng.random() < 0.1:
                        await buf.release_groups([gid], "failed")
                        continue
                    try:
                        await buf.put_rollouts([traj(gid, j, size, version, i) for j in range(size)])
                    except Exception:
                        return

        async def scorer() -> None:
            while not buf.gate.closed:  # (an empty batch is a timeout: on a loaded machine the generators may lag)
                batch = await buf.get_rollouts(size * 2, timeout=0.2)
                for gid in sorted({t.group_id for t in batch}):
                    if rng.random() < 0.1:
                        await buf.release_groups([gid], "filtered")
                        continue
                    members = [t for t in batch if t.group_id == gid]
                    try:
                        await buf.accept_groups([Group(group_id=gid, min_version=members[0].min_version,
                                                       trajectories=members)])
                    except QueueClosed:  # closed by the trainer while this waited for train room: the run is over
                        return

        async def trainer() -> None:
            for step in range(steps):
                groups = await buf.take_step(step)
                trained.extend((step, g.group_id, by_gid[g.group_id]) for g in groups)
                assert all(0 <= step - g.min_version <= k for g in groups)
                await buf.publish(step + 1)
            await buf.close()

        await asyncio.gather(trainer(), scorer(), *[generator(i, d) for i, d in enumerate((0.002, 0.002, 0.02))])
        return trained, buf.gate.stats()

    trained, st = run(main(), timeout=30.0)
    gids = [g for _, g, _ in trained]
    assert len(gids) == len(set(gids)) == steps * p
    assert all(a < b for a, b in zip(gids, gids[1:]))  # admission order
    assert st["admitted"] == st["accepted"] + st["running"] + st["filtered"] + st["failed"]
    assert st["consumed"] == steps * p


def test_buffer_reports_each_generators_groups_in_flight_and_seconds_per_group():
    async def main():
        buf = ReplayBuffer(prompts_per_step=2, group_size=1, max_staleness=1, rollout_capacity=8, train_capacity=8)
        a = await buf.admit(2, 0, holder="generator/0#0")
        await buf.admit(1, 0, holder="generator/1#2")  # a restarted actor's name: reported as generator/1
        await buf.put_rollouts([traj(a[0], 0, 1, 0)])
        return (await buf.stats()).metrics

    metrics = run(main())
    assert metrics["generator/0/in_flight"] == Last(1.0) and metrics["generator/1/in_flight"] == Last(1.0)
    assert metrics["generator/0/group_s"].value >= 0.0 and "generator/1/group_s" not in metrics  # none finished


def test_generator_staleness_stats_are_per_generator_and_skip_groups_of_no_generator():
    out = generator_staleness_stats([(0, 0), (0, 2), (1, 1), (-1, 5)])
    assert out == {"generator/0/trained_samples": 2, "generator/0/staleness/mean": 1.0,
                   "generator/0/staleness/max": 2, "generator/1/trained_samples": 1,
                   "generator/1/staleness/mean": 1.0, "generator/1/staleness/max": 1}
    assert generator_staleness_stats([]) == {}
