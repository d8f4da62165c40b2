"""ReplayBuffer: capacity checks, train-store ordering, and a fake generator/scorer/trainer run."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from asyncrl.messages import Group, Trajectory
from asyncrl.telemetry.metrics import Last, Total
from buffers.grouping import GroupAssembler
from buffers.queue import QueueClosed
from buffers.replay import ReplayBuffer

SHORT = 0.02  # seconds


def run(coro, timeout: float = 2.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def traj(seq_id: int, group_id: int, group_size: int, version: int) -> Trajectory:
    return Trajectory(
        seq_id=seq_id, group_id=group_id, group_size=group_size,
        prompt_ids=[1, 2], response_ids=[3], loss_mask=[True], behavior_logprobs=[-1.0],
        versions=[version], min_version=version, max_version=version, finish_reason="stop",
    )


def group(group_id: int, version: int, size: int = 2) -> Group:
    members = [traj(group_id * size + i, group_id, size, version) for i in range(size)]
    return Group(group_id=group_id, min_version=version, trajectories=members)


def make_buffer(**overrides) -> ReplayBuffer:
    kwargs = dict(prompts_per_step=2, group_size=2, max_staleness=1, rollout_capacity=8, train_capacity=8)
    kwargs.update(overrides)
    return ReplayBuffer(**kwargs)


def test_capacities_below_one_step_are_config_errors_naming_the_key():
    with pytest.raises(ValueError, match=r"buffer\.rollout_capacity"):
        make_buffer(rollout_capacity=3)  # one step is 2 * 2 = 4 samples
    with pytest.raises(ValueError, match=r"buffer\.train_capacity"):
        make_buffer(train_capacity=1)


def test_train_capacity_below_k_plus_1_steps_is_raised_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="buffers.replay"):
        buffer = make_buffer(max_staleness=3, train_capacity=2)
    assert buffer.train_capacity == 8
    assert "buffer.train_capacity" in caplog.text
    assert make_buffer(max_staleness=3, train_capacity=20).train_capacity == 20


def test_accept_groups_never_blocks_with_the_most_groups_the_gate_lets_live():
    async def main():
        buffer = make_buffer(max_staleness=2, train_capacity=2)  # raised to (2 + 1) * 2 = 6
        ids = await buffer.admit(100, 0)
        # every admitted group accepted, newest first (out of admission order)
        await asyncio.wait_for(buffer.accept_groups([group(g, 0) for g in reversed(ids)]), SHORT * 5)
        return ids, (await buffer.stats()).values()

    ids, stats = run(main())
    assert len(ids) == 6
    assert stats["buffer/train_depth"] == 6 and stats["buffer/train_put_wait_s"] == 0.0


def test_take_step_returns_groups_in_admission_order_after_out_of_order_accepts():
    async def main():
        buffer = make_buffer()
        ids = await buffer.admit(4, 0)
        await buffer.accept_groups([group(ids[3], 0), group(ids[1], 0), group(ids[2], 0)])
        early = await buffer.take_step(0, timeout=SHORT)  # ids[0] still running
        await buffer.accept_groups([group(ids[0], 0)])
        first = await buffer.take_step(0, timeout=0)
        await buffer.publish(1)
        second = await buffer.take_step(1, timeout=0)
        return ids, early, first, second, (await buffer.stats()).values()

    ids, early, first, second, stats = run(main())
    assert early == []
    assert [g.group_id for g in first] == ids[:2] and [g.group_id for g in second] == ids[2:]
    assert stats["buffer/train_depth"] == 0 and stats["buffer/consumed"] == 4


def test_accept_groups_rejects_a_group_older_than_its_admission_or_not_running():
    async def main():
        buffer = make_buffer()
        [gid] = await buffer.admit(1, 0)
        await buffer.release_groups([gid], "filtered")
        with pytest.raises(ValueError, match="not running"):
            await buffer.accept_groups([group(gid, 0)])
        for gid in await buffer.admit(3, 0):
            await buffer.accept_groups([group(gid, 0)])
        await buffer.take_step(0)
        await buffer.publish(1)
        [late] = await buffer.admit(1, 1)
        with pytest.raises(ValueError, match="admitted at version 1"):
            await buffer.accept_groups([group(late, 0)])
        with pytest.raises(ValueError, match="not running"):
            await buffer.release_groups([late, 999], "failed")
        return buffer.gate.is_running(late), (await buffer.stats()).values()

    still_running, stats = run(main())
    assert still_running  # the bad id in the batch released nothing
    assert stats["buffer/filtered"] == 1 and stats["buffer/failed"] == 0


def test_close_wakes_every_buffer_waiter():
    async def main():
        buffer = make_buffer(max_staleness=0)
        await buffer.admit(2, 0)
        waiters = [
            asyncio.create_task(buffer.admit(1, 0)),
            asyncio.create_task(buffer.get_rollouts(4)),
            asyncio.create_task(buffer.take_step(0)),
        ]
        await asyncio.sleep(SHORT)
        await buffer.close()
        results = await asyncio.wait_for(asyncio.gather(*waiters), SHORT * 5)
        with pytest.raises(QueueClosed):
            await buffer.put_rollouts([traj(0, 0, 2, 0)])
        return results

    assert run(main()) == [[], [], []]


def test_fake_generators_scorer_and_trainer_run_steps_with_consistent_counts():
    p, size, k, steps = 3, 2, 1, 5
    seq = itertools.count()

    async def main():
        buffer = ReplayBuffer(prompts_per_step=p, group_size=size, max_staleness=k,
                        rollout_capacity=p * size, train_capacity=p)
        staleness: list[int] = []

        async def generator() -> None:
            try:
                while True:
                    version = buffer.gate.published_version
                    ids = await buffer.admit(2, version)
                    if not ids:
                        if buffer.gate.closed:
                            return
                        continue
                    await asyncio.sleep(0)  # "decode"
                    await buffer.put_rollouts([traj(next(seq), g, size, version) for g in ids for _ in range(size)])
            except QueueClosed:
                return

        async def scorer() -> None:
            assembler = GroupAssembler()
            while batch := await buffer.get_rollouts(4):
                for t in batch:
                    done = assembler.add(t)
                    if done is None:
                        continue
                    try:
                        if done.group_id % 4 == 3:  # e.g. zero reward variance
                            await buffer.release_groups([done.group_id], "filtered")
                        else:
                            await buffer.accept_groups([done])
                    except QueueClosed:
                        return

        async def trainer() -> None:
            for step in range(steps):
                groups = await buffer.take_step(step)
                assert len(groups) == p
                staleness.extend(step - g.min_version for g in groups)
                await asyncio.sleep(0)  # "train"
                await buffer.publish(step + 1)
            await buffer.close()

        roles = [generator(), generator(), scorer(), trainer()]
        await asyncio.gather(*roles)
        return staleness, buffer.rollouts, (await buffer.stats()).values()  # the first stats(): since the start

    staleness, rollouts, stats = run(main())
    assert len(staleness) == steps * p and 0 <= min(staleness) and max(staleness) <= k
    assert stats["buffer/consumed"] == steps * p and stats["buffer/filtered"] >= 1
    assert stats["buffer/admitted"] == (
        stats["buffer/consumed"] + stats["buffer/filtered"] + stats["buffer/failed"]
        + stats["buffer/running"] + stats["buffer/train_depth"]
    )
    assert stats["buffer/train_depth"] == stats["buffer/accepted"] - stats["buffer/consumed"]
    assert rollouts.total_put == rollouts.total_got + stats["buffer/rollout_depth"]


def test_buffer_stats_report_the_window_since_the_previous_read_and_depths_as_they_are_now():
    async def main():
        buffer = make_buffer(report_filtered=True)
        ids = await buffer.admit(4, 0)
        await buffer.put_rollouts(group(ids[0], 0).trajectories)
        await buffer.accept_groups([group(ids[1], 0)])
        await buffer.release_groups([ids[2]], "filtered")
        first = await buffer.stats()
        again = await buffer.stats()  # nothing happened since: every count of the window is 0
        await buffer.release_groups([ids[3]], "failed")
        return first, again, await buffer.stats()

    first, again, third = run(main())
    assert first.spans == [] and isinstance(first.metrics["buffer/admitted"], Total)
    f, a, t = first.values(), again.values(), third.values()
    assert (f["buffer/admitted"], f["buffer/accepted"], f["buffer/filtered"], f["buffer/failed"]) == (4, 1, 1, 0)
    assert f["dapo/groups_filtered"] == f["dapo/groups_filtered_total"] == 1  # the buffer's one count of filtered
    assert all(a[k] == 0 for k in ("buffer/admitted", "buffer/accepted", "buffer/filtered", "dapo/groups_filtered"))
    assert (t["buffer/failed"], t["buffer/admitted"]) == (1, 0)
    # gauges are the state at the read, not a window's increment
    assert f["buffer/rollout_depth"] == a["buffer/rollout_depth"] == t["buffer/rollout_depth"] == 2
    assert (f["buffer/running"], a["buffer/running"], t["buffer/running"]) == (2, 2, 1)
    assert f["buffer/train_depth"] == 1 and isinstance(first.metrics["buffer/train_depth"], Last)


def test_buffer_reports_dapo_filtered_groups_only_when_filtering_refills_them():
    assert "dapo/groups_filtered" not in run(make_buffer().stats()).metrics


def test_a_restored_buffer_trains_its_accepted_groups_whole_and_its_totals_go_on():
    import msgspec

    from buffers.replay import BufferState

    async def before() -> BufferState:
        buf = make_buffer()
        assert await buf.admit(4, 0) == [0, 1, 2, 3]
        await buf.put_rollouts(group(2, 0).trajectories)  # queued for scoring: regenerated after a restore
        await buf.accept_groups([group(0, 0), group(1, 0), group(3, 0)])
        first = (await buf.stats()).values()
        assert first["buffer/accepted"] == 3
        return await buf.state()

    state = msgspec.msgpack.decode(msgspec.msgpack.encode(run(before())), type=BufferState)

    async def after() -> tuple[list[int], dict[str, float], list[int]]:
        buf = make_buffer()
        await buf.restore(state)
        again = await buf.admit(4, 0)
        await buf.accept_groups([group(2, 0)])
        step0 = await buf.take_step(0)
        assert [len(g.trajectories) for g in step0] == [2, 2]
        window = (await buf.stats()).values()
        return again, window, [g.group_id for g in step0 + await buf.take_step(1, timeout=SHORT)]

    again, window, trained = run(after())
    assert again == [2]  # only the running group, with its id
    assert window["buffer/accepted"] == 1 and window["buffer/admitted"] == 0  # not counted twice
    assert window["buffer/rollout_depth"] == 0  # its queued trajectories were not kept
    assert trained == [0, 1, 2, 3]


# -- groups stay whole between generators and scorers ----------------------------------------------------------
def test_get_rollouts_hands_out_whole_groups_also_after_a_put_into_a_full_queue():
    # group_size 5 does not divide the getters' 3 or 8: every batch must still hold whole groups only
    async def main():
        buffer = make_buffer(group_size=5, rollout_capacity=10, train_capacity=8)
        a, b, c = await buffer.admit(3, 0)
        await buffer.put_rollouts(group(a, 0, 5).trajectories + group(b, 0, 5).trajectories)
        blocked = asyncio.create_task(buffer.put_rollouts(group(c, 0, 5).trajectories))  # the queue is full
        await asyncio.sleep(SHORT)
        assert not blocked.done()
        batches = [await buffer.get_rollouts(3)]  # frees room for part of c: it must not go in in chunks
        await asyncio.sleep(SHORT)
        batches += [await buffer.get_rollouts(8), await buffer.get_rollouts(8, timeout=SHORT)]
        await asyncio.wait_for(blocked, SHORT * 5)
        return batches, buffer.rollouts.qsize()

    batches, left = run(main())
    assert [[t.group_id for t in batch] for batch in batches] == [[0] * 5, [1] * 5, [2] * 5]
    assert left == 0


def test_two_consumers_of_a_backed_up_queue_complete_every_group_when_group_size_does_not_divide_their_batch():
    # Each consumer assembles groups on its own, as scorers do: a group split between them would never
    # complete, and take_step would wait for it forever.
    p, size = 4, 5

    async def main():
        buffer = make_buffer(prompts_per_step=p, group_size=size, max_staleness=0, rollout_capacity=p * size,
                             train_capacity=p)
        ids = await buffer.admit(p, 0)
        await buffer.put_rollouts([t for gid in ids for t in group(gid, 0, size).trajectories])  # backed up

        async def consumer() -> None:
            assembler = GroupAssembler()
            while batch := await buffer.get_rollouts(8, timeout=SHORT):
                await asyncio.sleep(0)  # "score": the other consumer gets its turn
                done = [g for g in map(assembler.add, batch) if g is not None]
                await buffer.accept_groups(done)

        await asyncio.gather(consumer(), consumer())
        return await buffer.take_step(0, timeout=1.0)

    assert [g.group_id for g in run(main())] == [0, 1, 2, 3]


def test_put_rollouts_refuses_a_group_that_is_not_whole():
    async def main():
        buffer = make_buffer(group_size=3)
        [gid] = await buffer.admit(1, 0)
        members = group(gid, 0, 3).trajectories
        with pytest.raises(ValueError, match="whole groups"):
            await buffer.put_rollouts(members[:2])
        with pytest.raises(ValueError, match="whole groups"):
            await buffer.put_rollouts([members[0], traj(99, 7, 3, 0), *members[1:]])
        return buffer.rollouts.qsize()

    assert run(main()) == 0  # nothing of a refused batch was queued


def test_a_dead_generators_unqueued_groups_are_released_and_its_queued_ones_are_not():
    async def main():
        buf = make_buffer()
        ids = await buf.admit(3, 0, holder="generator/0")
        other = await buf.admit(1, 0, holder="generator/1")
        await buf.put_rollouts([traj(ids[0] * 2 + j, ids[0], 2, 0) for j in range(2)])  # queued: the queue holds it
        released = await buf.release_holder("generator/0")
        assert released == ids[1:]
        assert buf.gate.is_running(ids[0]) and buf.gate.is_running(other[0])
        assert buf.gate.stats()["failed"] == 2
        return buf, ids

    buf, ids = run(main())
    assert run(buf.stats()).metrics["buffer/abandoned"] == Total(2.0)


def test_a_dead_scorers_taken_groups_are_released_and_a_late_accept_of_them_is_dropped():
    async def main():
        buf = make_buffer()
        ids = await buf.admit(2, 0, holder="generator/0")
        await buf.put_rollouts([traj(g * 2 + j, g, 2, 0) for g in ids for j in range(2)])
        taken = await buf.get_rollouts(4, holder="scorer/0")  # both groups, whole
        assert {t.group_id for t in taken} == set(ids)
        assert await buf.release_holder("scorer/0") == ids
        assert await buf.get_rollouts(8, timeout=SHORT, holder="scorer/1") == []  # nothing of them is left
        await buf.accept_groups([group(ids[0], 0)])  # a late accept (a put that was in flight): dropped
        await buf.release_groups([ids[1]], "failed")  # a late release: dropped too
        st = buf.gate.stats()
        assert (st["accepted"], st["failed"], st["running"]) == (0, 2, 0)
        assert buf.abandoned == {"groups": 2, "late": 2}

    run(main())


def test_release_holder_never_releases_an_accepted_group():
    async def main():
        buf = make_buffer()
        ids = await buf.admit(1, 0, holder="generator/0")
        await buf.put_rollouts([traj(ids[0] * 2 + j, ids[0], 2, 0) for j in range(2)])
        await buf.get_rollouts(2, holder="scorer/0")
        await buf.accept_groups([group(ids[0], 0)])
        assert await buf.release_holder("scorer/0") == []
        assert await buf.release_holder("generator/0") == []
        assert buf.gate.stats()["accepted"] == 1

    run(main())


def test_an_admit_of_a_dead_holder_that_was_waiting_gets_nothing_and_the_room_goes_to_the_living():
    async def main():
        buf = make_buffer()  # capacity at version 0: (0 + 1 + 1) * 2 = 4 groups
        await buf.admit(4, 0, holder="generator/0#0")
        late = asyncio.ensure_future(buf.admit(1, 0, timeout=0.2, holder="generator/0#0"))  # waits for room
        await asyncio.sleep(0.01)
        assert await buf.release_holder("generator/0#0") == [0, 1, 2, 3]  # room, but not for the dead one
        assert await late == []
        assert await buf.admit(1, 0, holder="generator/0#0") == []  # a call of the dead actor arriving late
        st = buf.gate.stats()
        assert (st["running"], st["failed"]) == (0, 4)
        assert await buf.admit(1, 0, holder="generator/0#1") == [4]  # the restarted actor's own name works

    run(main())


async def _on_policy_after_step_0() -> ReplayBuffer:
    """k = 0, P = 2: step 0's two groups admitted (by generator 0), generated, accepted and taken; version 0
    has no room left, version 1 two groups."""
    buffer = make_buffer(max_staleness=0)
    first = await buffer.admit(2, 0, holder="generator/0")
    await buffer.put_rollouts([t for gid in first for t in group(gid, 0).trajectories])
    await buffer.get_rollouts(4)
    await buffer.accept_groups([group(gid, 0) for gid in first])
    await buffer.take_step(0)
    return buffer


def test_an_admit_waiting_when_its_own_generator_swaps_goes_on_at_the_new_version():
    async def main():
        buffer = await _on_policy_after_step_0()
        mine = asyncio.create_task(buffer.admit(2, 0, timeout=1.0, holder="generator/0"))
        other = asyncio.create_task(buffer.admit(2, 0, timeout=1.0, holder="generator/1"))
        await asyncio.sleep(SHORT)
        waiting = not mine.done() and not other.done()
        await buffer.note_held(1, holder="generator/0")  # generator 0's swap to version 1 landed
        ids = await asyncio.wait_for(mine, SHORT * 10)
        return waiting, ids, [buffer.gate.admitted_version(g) for g in ids], await other

    waiting, ids, versions, other = run(main())
    assert waiting
    # admitted at the version it holds, without asking again: its share of the room (the other generator,
    # which returned to ask again, keeps its place a while: buffers/dispatch.py)
    assert ids == [2] and versions == [1]
    assert other == []  # another generator still on version 0 returns, to ask again at its own version


def test_an_admit_waiting_goes_on_at_the_version_its_generator_notes_after_another_noted_it_first():
    """Two generators: the first to swap notes version 1; the other's admit, waiting at version 0, goes on at
    version 1 when its own swap lands, not at the publish (which follows both swaps and the Controller's round
    trip). Its note raises no version the gate has not heard of, yet its own admit must hear of it."""
    async def main():
        buffer = await _on_policy_after_step_0()
        await buffer.note_held(1, holder="generator/1")  # generator 1 swapped first
        mine = asyncio.create_task(buffer.admit(1, 0, timeout=1.0, holder="generator/0"))
        await asyncio.sleep(SHORT)
        waiting = not mine.done()
        await buffer.note_held(1, holder="generator/0")  # now generator 0's swap landed too
        ids = await asyncio.wait_for(mine, SHORT * 10)
        # asked at the older version after its own note (its swap still landing): at once, at the noted one
        late = await asyncio.wait_for(buffer.admit(1, 0, timeout=1.0, holder="generator/0"), SHORT * 10)
        return waiting, ids, [buffer.gate.admitted_version(g) for g in ids + late], late

    waiting, ids, versions, late = run(main())
    assert waiting
    assert ids and versions == [1] * len(ids + late)  # admitted at the version it holds, before any publish
    assert ids + late == [2, 3]  # version 1's room: one group each ask


class _Wire:
    """A Ray actor handle stand-in: `handle.call.remote(method, *args)` runs the method as `RoleActor.call` does
    (asyncrl/deploy/actors.py `_invoke`: the packed argument decoded, the reply encoded) and records what crossed."""

    def __init__(self, role) -> None:
        from asyncrl.deploy.actors import _invoke

        self.crossed: list[tuple[str, type, type]] = []  # (method, its first argument's type, its reply's type)

        async def remote(method, *args, **kwargs):
            reply = await _invoke(role, method, args, kwargs)
            self.crossed.append((method, type(args[0]) if args else type(None), type(reply)))
            return reply

        self.call = type("Call", (), {"remote": staticmethod(lambda *a, **k: asyncio.ensure_future(remote(*a, **k)))})


def test_trajectories_and_groups_cross_the_proxy_packed_and_the_buffer_sees_typed_lists():
    """asyncrl/deploy/wire.py: a generator's put, a scorer's get and accept and the trainer's take travel as one
    msgpack blob each through RayProxy and the actor's side; every field survives, and the buffer and its callers
    get lists of Structs."""
    from asyncrl.deploy.actors import RayProxy

    async def main():
        buffer = make_buffer()  # 2 prompts a step
        handle = _Wire(buffer)
        proxy = RayProxy(handle)
        ids = await proxy.admit(2, 0)
        first = group(ids[0], 0).trajectories
        first[0].reward_components = {"fmt": 0.5}
        first[1].row_json = b'{"answer": "7"}'
        await proxy.put_rollouts(first + group(ids[1], 0).trajectories)
        trajs = await proxy.get_rollouts(8, SHORT, "scorer/0")
        await proxy.accept_groups([Group(group_id=gid, min_version=0,
                                         trajectories=[t for t in trajs if t.group_id == gid]) for gid in ids])
        return first, trajs, await proxy.take_step(0, SHORT), handle.crossed

    first, trajs, taken, crossed = run(main())
    assert trajs[:2] == first and all(isinstance(t, Trajectory) for t in trajs)  # every field survives
    assert [g.group_id for g in taken] == [0, 1] and all(isinstance(g, Group) for g in taken)
    assert [g.trajectories for g in taken] == [first, group(1, 0).trajectories]
    assert crossed == [("admit", int, list), ("put_rollouts", bytes, type(None)), ("get_rollouts", int, bytes),
                       ("accept_groups", bytes, type(None)), ("take_step", int, bytes)]


def test_the_buffers_report_carries_the_gates_group_events_with_each_releases_cause():
    async def main():
        buf = make_buffer()
        ids = await buf.admit(3, 0, holder="generator/0#1")
        await buf.release_groups([ids[0]], "failed", "generation: RuntimeError: boom")
        await buf.release_holder("generator/0#1")
        report = await buf.stats()
        return ids, report, await buf.group_events()

    ids, report, rest = run(main())
    assert report.groups.admitted == ids and report.groups.accepted == []
    died = "generator/0#1 died"
    assert report.groups.released == [(ids[0], "failed", "generation: RuntimeError: boom"),
                                       (ids[1], "failed", died), (ids[2], "failed", died)]
    assert not rest and run(make_buffer().stats()).groups is None  # reported once; a quiet window carries none
