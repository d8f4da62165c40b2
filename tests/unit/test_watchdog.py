"""The run's watch: the buffer's progress record (groups released in a row and why), a process's loop monitor
(a blocked event loop: where, and what its roles began last), and the bounds that end a run which cannot
progress with one error line. Fakes only: no Ray, no model."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.control.watchdog import Heartbeat, LoopMonitor, RunStalled, RunWatch
from asyncrl.messages import Group, Trajectory
from asyncrl.telemetry.spans import SpanRecorder
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
    with pytest.raises(RunStalled, match=r"replay buffer has not answered for 0.05 s \(run.role_timeout_s\)"):
        asyncio.run(asyncio.wait_for(watch(buffer=FakeBuffer([ok], hang=True), period_s=0.001,
                                           role_timeout_s=0.05).run(), 5))


# -- a role whose event loop is blocked ------------------------------------------------------------------------
def blocking_env_step(seconds: float) -> None:
    """Stands for a synchronous call inside an env's `async def step` (a blocking HTTP request, a subprocess)."""
    time.sleep(seconds)


def test_a_loop_monitor_sees_a_blocked_loop_and_says_where_it_is_blocked_and_what_the_role_began():
    recorder = SpanRecorder("generator/0")

    async def main() -> tuple[Heartbeat, Heartbeat]:
        monitor = LoopMonitor(asyncio.get_running_loop(), {"generator 0": recorder}, timeout_s=0.2,
                              tick_s=0.02).start()
        try:
            await asyncio.sleep(0.05)
            quiet = monitor.heartbeat()
            recorder.begin("generate", "env episodes")
            blocking_env_step(0.4)  # on the loop: nothing else runs meanwhile, the monitor's thread does
            await asyncio.sleep(0)
            return quiet, monitor.heartbeat()
        finally:
            monitor.stop()

    quiet, stalled = asyncio.run(main())
    # before the block: nothing begun and no blocking call seen (a loaded machine may still run the loop late)
    assert quiet.stalled_s < stalled.stalled_s and "blocking_env_step" not in quiet.where and quiet.activities == []
    assert stalled.stalled_s >= 0.25
    assert stalled.where.startswith("test_watchdog.py:") and " in blocking_env_step <- " in stalled.where
    (line,) = stalled.activities
    assert line.startswith("generator 0: generate (env episodes), begun ")


def test_a_stall_sampled_as_the_loop_leaves_the_blocking_call_keeps_where_it_was_blocked():
    # The monitor's thread measures how late the beat is, then reads the loop thread's frames: when the
    # blocking call returns in between, the longest sample of the stall finds no frame of its own.
    monitor = LoopMonitor(asyncio.new_event_loop(), {}, timeout_s=1.0)
    wheres = iter(["my_env.py:9 in step", "", ""])
    monitor._where = lambda: next(wheres)
    monitor._beat_at = time.monotonic()  # (heartbeat() finds the loop on time again)
    monitor._note(0.5)
    monitor._note(2.8)
    beat = monitor.heartbeat()
    assert (beat.stalled_s, beat.where) == (2.8, "my_env.py:9 in step")
    monitor._beat_at = time.monotonic() + 1e-3  # a later stall that never had a frame does not borrow the earlier one's
    monitor._note(0.3)
    assert monitor.heartbeat().where == ""
    monitor.loop.close()


def test_the_watch_names_a_role_whose_loop_stalled_and_one_whose_process_does_not_answer():
    beat = Heartbeat(stalled_s=31.0, where="my_env.py:9 in step <- asyncrl/envs/runner.py:128 in _play",
                     activities=["generator 0: generate (env episodes), begun 31.0 s before"])
    with pytest.raises(RunStalled) as info:
        watch(role_timeout_s=30.0).check_heartbeat("generator 0", beat)
    assert str(info.value) == ("the event loop of generator 0 did not run for 31.0 s (run.role_timeout_s = 30): "
                               "blocked in my_env.py:9 in step <- asyncrl/envs/runner.py:128 in _play; last "
                               "activity: generator 0: generate (env episodes), begun 31.0 s before")
    assert info.value.process == "generator 0"  # the Controller then asks none of its roles to stop
    watch(role_timeout_s=30.0).check_heartbeat("generator 0", Heartbeat(stalled_s=29.0))

    answers = [Heartbeat(stalled_s=0.0, activities=["scorer 0: score (reward fn), begun 0.1 s before"])]

    async def probe() -> Heartbeat:  # answers once, then never again: its whole process is stuck
        if answers:
            return answers.pop()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    w = watch(role_timeout_s=0.05, period_s=0.001, probes={"scorer 0": probe},
              buffer=FakeBuffer([Progress(released_in_a_row=0, idle_s=0.0, reasons=[])]))
    with pytest.raises(RunStalled) as info:
        asyncio.run(asyncio.wait_for(w.run(), 5))
    message = str(info.value)
    assert message.startswith("scorer 0 has not answered for 0.05 s (run.role_timeout_s): nothing in its process "
                              "runs, so something there holds the interpreter lock")
    assert message.endswith("ago: scorer 0: score (reward fn), begun 0.1 s before")
    assert info.value.process == "scorer 0"


def test_the_watch_looks_at_a_twentieth_of_its_shortest_bound_and_at_least_every_3_s():
    """Each look is an actor call to every role process and one to the buffer: no more often than the bounds need,
    and a crossed bound is seen within 5% of it (the default 60 s role timeout: every 3 s)."""
    from asyncrl.control.watchdog import watch_period

    assert watch(role_timeout_s=60.0).period_s == watch_period(60.0) == 3.0
    assert watch(role_timeout_s=2.0).period_s == pytest.approx(0.1)
    assert watch(role_timeout_s=60.0, no_progress_timeout_s=10.0).period_s == pytest.approx(0.5)
    assert watch_period(600.0, 0.0) == 3.0
    assert watch(role_timeout_s=60.0, period_s=0.01).period_s == 0.01  # an explicit period is kept
