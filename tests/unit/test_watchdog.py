"""The run's watch: the buffer's progress record (groups released in a row and why) and the bounds that end a
run which cannot progress with one error line. Fakes only: no Ray, no model."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.messages import Group, Trajectory
from asyncrl.watchdog import RunStalled, RunWatch
from buffers.progress import Progress, ProgressTracker
from buffers.replay import ReplayBuffer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_counts_released_groups_in_a_row_and_keeps_the_last_distinct_reasons_newest_last():
    tracker = ProgressTracker(keep=2)
    tracker.released(2, "failed", "reward: KeyError: 'answer'\nTraceback ...")
    tracker.released(1, "filtered", "zero reward variance: every reward of the group is 0")
    tracker.released(3, "failed", "reward: KeyError: 'answer'")  # seen before: moves to the end, counts add up
    tracker.released(1, "failed", "")
    report = tracker.report()
    assert report.released_in_a_row == 7
    assert report.reasons == ["failed: reward: KeyError: 'answer' (x5)", "failed (no reason given) (x1)"]


def test_an_accepted_group_ends_the_streak_and_a_step_counts_as_progress_too():
    clock = Clock()
    tracker = ProgressTracker(clock=clock)
    tracker.released(4, "failed", "boom")
    clock.now += 30
    assert (tracker.report().released_in_a_row, tracker.report().idle_s) == (4, 30)
    tracker.accepted(1)
    assert tracker.report() == Progress(released_in_a_row=0, idle_s=0.0, reasons=[])
    clock.now += 5
    tracker.stepped()
    clock.now += 2
    assert tracker.report().idle_s == 2


def test_the_buffer_records_why_groups_were_released_until_one_is_accepted():
    async def main() -> tuple[Progress, Progress]:
        buffer = ReplayBuffer(prompts_per_step=1, group_size=1, max_staleness=2, rollout_capacity=4, train_capacity=4)
        ids = await buffer.admit(3, 0)
        await buffer.release_groups(ids[:2], "failed", "generation: TypeError: Object of type set is not JSON "
                                                       "serializable")
        before = await buffer.progress()
        t = Trajectory(seq_id=ids[2], group_id=ids[2], group_size=1, prompt_ids=[1], response_ids=[2],
                       loss_mask=[True], behavior_logprobs=[0.0], versions=[0], min_version=0, max_version=0,
                       finish_reason="stop")
        await buffer.accept_groups([Group(group_id=ids[2], min_version=0, trajectories=[t])])
        return before, await buffer.progress()

    before, after = asyncio.run(main())
    assert before.released_in_a_row == 2
    assert before.reasons == ["failed: generation: TypeError: Object of type set is not JSON serializable (x2)"]
    assert after.released_in_a_row == 0 and after.reasons == []


def watch(**kw) -> RunWatch:
    return RunWatch(**{"buffer": None, "max_failed_in_a_row": 10, "no_progress_timeout_s": 0.0, **kw})


def test_the_watch_ends_the_run_once_the_limit_of_released_groups_in_a_row_is_reached():
    w = watch()
    w.check_progress(Progress(released_in_a_row=9, idle_s=1e6, reasons=["failed: a (x9)"]))  # time bound off
    with pytest.raises(RunStalled) as info:
        w.check_progress(Progress(released_in_a_row=10, idle_s=1.0, reasons=["failed: old (x3)", "failed: new (x7)"]))
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "run.max_failed_groups_in_a_row = 10" in message
    assert message.index("failed: new (x7)") < message.index("failed: old (x3)")  # newest first
    watch(max_failed_in_a_row=0).check_progress(Progress(released_in_a_row=10**6, idle_s=0.0, reasons=[]))


def test_the_watch_ends_a_run_without_progress_for_the_timeout_when_one_is_set():
    w = watch(max_failed_in_a_row=0, no_progress_timeout_s=60.0)
    w.check_progress(Progress(released_in_a_row=0, idle_s=59.0, reasons=[]))
    with pytest.raises(RunStalled, match=r"no step taken for 61 s \(run.no_progress_timeout_s = 60\)$"):
        w.check_progress(Progress(released_in_a_row=0, idle_s=61.0, reasons=[]))


class FakeBuffer:
    def __init__(self, reports: list[Progress], hang: bool = False) -> None:
        self.reports, self.hang, self.reads = reports, hang, 0

    async def progress(self) -> Progress:
        self.reads += 1
        if self.hang:
            await asyncio.sleep(3600)
        return self.reports.pop(0) if len(self.reports) > 1 else self.reports[0]


def test_the_watch_loop_raises_when_the_buffer_reports_a_stalled_run_and_when_it_does_not_answer():
    ok = Progress(released_in_a_row=1, idle_s=0.0, reasons=["failed: x (x1)"])
    stalled = Progress(released_in_a_row=10, idle_s=0.0, reasons=["failed: x (x10)"])
    buffer = FakeBuffer([ok, ok, stalled])
    with pytest.raises(RunStalled, match="groups all failed"):
        asyncio.run(asyncio.wait_for(watch(buffer=buffer, period_s=0.001).run(), 5))
    assert buffer.reads == 3
    with pytest.raises(RunStalled, match="replay buffer has not answered for 0.05 s"):
        asyncio.run(asyncio.wait_for(watch(buffer=FakeBuffer([ok], hang=True), period_s=0.001,
                                           call_timeout_s=0.05).run(), 5))
