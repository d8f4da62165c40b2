"""The Controller only reduces: fake roles hand it typed reports of their windows, and `_role_metrics` combines
each key by its metric's type over the step's window (Sum over generators, Rate per second of the window, Share
of the generators' time, Totals added up over the windows) and computes busy shares and overlap from the spans
that came with the reports. No Ray, no model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.config.schema import Config, ModelConfig
from asyncrl.control.controller import Controller
from asyncrl.telemetry.metrics import Last, Mean, Rate, RoleStats, Share, Sum, Total
from asyncrl.telemetry.spans import Span


class FakeRole:
    """Answers `stats()` with the next of its prepared window reports."""

    def __init__(self, *reports: RoleStats) -> None:
        self.reports = list(reports)

    async def stats(self) -> RoleStats:
        return self.reports.pop(0)


def generator(i: int, tokens: float, stall: float, busy: tuple[float, float]) -> RoleStats:
    return RoleStats(metrics={"generation/tokens_per_s": Rate(tokens), "generation/stall_s": Sum(stall),
                              "generation/stall_s_total": Total(stall), "generation/stall_share": Share(stall)},
                     spans=[Span(role=f"generator/{i}", kind="generate", start=busy[0], end=busy[1])])


def buffer(failed: float, depth: float, episodes: float = 0.0, turns_mean: float = 0.0) -> RoleStats:
    return RoleStats(metrics={"buffer/failed": Total(failed), "buffer/rollout_depth": Last(depth),
                              "env/turns_mean": Mean(turns_mean, weight=episodes)})


def controller(tmp_path, generators: list[FakeRole], scorers: list[FakeRole], trainer: FakeRole,
               buffer_role: FakeRole) -> Controller:
    d = SimpleNamespace(generators=generators, scorers=scorers, trainer=trainer, buffer=buffer_role, restartable=())
    return Controller(Config(model=ModelConfig(path="unused")), d, run_dir=tmp_path)  # type: ignore[arg-type]


def test_controller_reduces_each_key_by_its_type_over_the_steps_window(tmp_path):
    gens = [FakeRole(generator(0, 100, 0.5, (10.0, 12.0))), FakeRole(generator(1, 300, 0.3, (11.0, 12.0)))]
    scorers = [FakeRole(RoleStats(metrics={"scorer/samples_per_s": Rate(8), "scorer/reward_errors": Total(1)},
                                  spans=[Span(role="scorer/0", kind="score", start=10.0, end=10.5)]))]
    trainer = FakeRole(RoleStats(spans=[Span(role="trainer", kind="train", start=10.0, end=11.0)]))
    c = controller(tmp_path, gens, scorers, trainer, FakeRole(buffer(failed=2, depth=5, episodes=4, turns_mean=2.5)))
    row = asyncio.run(c._role_metrics(10.0, 12.0))  # a 2-second window
    assert row["generation/tokens_per_s"] == 400 / 2  # summed over generators, per second of the window
    assert row["generation/stall_s"] == row["generation/stall_s_total"] == pytest.approx(0.8)
    assert row["generation/stall_share"] == pytest.approx(0.8 / (2 * 2))  # of 2 generators x 2 seconds
    assert row["scorer/samples_per_s"] == 4 and row["scorer/reward_errors"] == 1
    assert row["buffer/failed"] == 2 and row["buffer/rollout_depth"] == 5 and row["env/turns_mean"] == 2.5
    # spans that came with the reports: generator 0 busy the whole window, generator 1 half of it
    assert row["generator/busy_share"] == pytest.approx(0.75) and row["generator/1/busy_share"] == 0.5
    assert row["trainer/busy_share"] == 0.5 and row["scorer/busy_share"] == 0.25
    assert row["overlap_ratio"] == 0.5  # generation and training at once during [10, 11]


def test_controller_adds_totals_up_over_windows_and_rates_use_each_windows_length(tmp_path):
    gens = [FakeRole(generator(0, 10, 0.5, (0.0, 1.0)), generator(0, 30, 0.25, (1.0, 4.0)))]
    scorer = FakeRole(RoleStats(metrics={"scorer/reward_errors": Total(1)}),
                      RoleStats(metrics={"scorer/reward_errors": Total(0)}))
    buffer_role = FakeRole(buffer(failed=2, depth=5), buffer(failed=1, depth=0))
    c = controller(tmp_path, gens, [scorer], FakeRole(RoleStats(), RoleStats()), buffer_role)
    first = asyncio.run(c._role_metrics(0.0, 1.0))
    second = asyncio.run(c._role_metrics(1.0, 4.0))
    assert (first["generation/tokens_per_s"], second["generation/tokens_per_s"]) == (10, 10)
    assert (first["generation/stall_s"], second["generation/stall_s"]) == (0.5, 0.25)  # the window's
    assert (first["generation/stall_s_total"], second["generation/stall_s_total"]) == (0.5, 0.75)  # so far
    assert (first["buffer/failed"], second["buffer/failed"]) == (2, 3)
    assert (first["scorer/reward_errors"], second["scorer/reward_errors"]) == (1, 1)
    assert second["buffer/rollout_depth"] == 0  # a gauge: as it is now
    assert first["generator/busy_share"] == second["generator/busy_share"] == 1.0


def test_controller_keeps_only_the_spans_that_reach_past_the_window(tmp_path):
    # window [0, 1]: generator 0's span ends inside it; the trainer's (drained just after t1) reaches into [1, 2]
    gens = [FakeRole(generator(0, 1, 0.0, (0.0, 0.5)), RoleStats())]
    trainer = FakeRole(RoleStats(spans=[Span(role="trainer", kind="train", start=0.5, end=1.5)]), RoleStats())
    c = controller(tmp_path, gens, [], trainer, FakeRole(buffer(0, 0), buffer(0, 0)))
    first = asyncio.run(c._role_metrics(0.0, 1.0))
    assert [(s.role, s.end) for s in c._spans] == [("trainer", 1.5)]  # nothing else can overlap a later window
    second = asyncio.run(c._role_metrics(1.0, 2.0))
    assert (first["trainer/busy_share"], second["trainer/busy_share"]) == (0.5, 0.5)  # the kept span, clipped
    assert second["generator/0/busy_share"] == 0.0  # a role seen before, silent now: idle, not missing
    assert c._spans == []


def test_controller_keeps_the_newest_rows_and_counts_them_all(tmp_path):
    from asyncrl.control.controller import ROWS_KEPT

    c = controller(tmp_path, [], [], FakeRole(), FakeRole())
    for step in range(ROWS_KEPT + 5):
        c._keep_row([], {"step": step + 1})
    assert len(c.rows) == ROWS_KEPT and c.rows[0]["step"] == 6 and c.rows_written == ROWS_KEPT + 5


def test_controller_seconds_count_the_drivers_cpu_in_each_window_not_its_waiting(tmp_path):
    """`time/controller_s` is the loop thread's CPU in the step's window: a step whose pipeline computes on the
    driver shows it, a step that only awaits (the roles working elsewhere) shows almost none."""
    import time

    def busy(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def step(step: int, while_asleep=None):
        if step == 0:
            busy(0.05)  # the driver's own work
        else:
            await asyncio.sleep(0.05)  # waiting on the roles: no CPU here
        return {}, {}

    c = controller(tmp_path, [], [], FakeRole(RoleStats(), RoleStats()),
                   FakeRole(buffer(0, 0), buffer(0, 0)))
    c.steps.step, c.steps.ask_next = step, lambda version: None

    async def two_steps():
        c._cpu_mark, t_prev = time.thread_time(), time.time()
        first = await c._one_step(0, t_prev, t_prev)
        second = await c._one_step(1, t_prev, c._window_end)
        return first, second

    first, second = asyncio.run(two_steps())
    assert first["time/controller_s"] >= 0.05  # the busy step's CPU is all counted
    assert second["time/controller_s"] < first["time/controller_s"]
    assert second["time/controller_s"] < second["time/step_s"]  # awaiting is not the driver's time


class Unasked(FakeRole):
    """A role whose report came with a reply: the Controller must not ask it again."""

    async def stats(self) -> RoleStats:
        raise AssertionError("stats() asked of a role whose report came with the step's replies")


def test_reports_that_came_with_the_replies_replace_the_stats_calls_and_give_the_same_row(tmp_path):
    gen_report = generator(0, 100, 0.5, (10.0, 12.0))
    trainer_report = RoleStats(spans=[Span(role="trainer", kind="train", start=10.0, end=11.0)])
    buffer_report = buffer(failed=2, depth=5)
    scorer_report = RoleStats(metrics={"scorer/samples_per_s": Rate(8)})
    asked = controller(tmp_path / "a", [FakeRole(gen_report)], [FakeRole(scorer_report)], FakeRole(trainer_report),
                       FakeRole(buffer_report))
    came = controller(tmp_path / "b", [Unasked()], [FakeRole(scorer_report)], Unasked(), Unasked())
    came.steps.reports = [("generator/0", gen_report), ("trainer", trainer_report), ("buffer", buffer_report)]
    by_stats = asyncio.run(asked._role_metrics(10.0, 12.0))
    by_replies = asyncio.run(came._role_metrics(10.0, 12.0))
    measured = ("controller/rss_mb", "controller/cpu_cores")  # the driver's own, now
    assert by_replies == {**by_stats, **{k: by_replies[k] for k in measured}}
    assert by_replies["generation/tokens_per_s"] == 50 and by_replies["scorer/samples_per_s"] == 4  # (the scorer asked)
    assert came.steps.reports == []  # taken: the next window starts empty


def test_a_role_with_two_reports_in_one_step_counts_both_windows(tmp_path):
    """A receive that returned before a failed sync, then the retry's: neither window's counts are lost."""
    c = controller(tmp_path, [Unasked()], [], Unasked(), Unasked())
    c.steps.reports = [("generator/0", generator(0, 10, 0.0, (0.0, 0.5))),
                       ("generator/0", generator(0, 30, 0.0, (0.5, 1.0))), ("trainer", RoleStats()),
                       ("buffer", buffer(1, 0))]
    row = asyncio.run(c._role_metrics(0.0, 1.0))
    assert row["generation/tokens_per_s"] == 40 and row["buffer/failed"] == 1


def test_the_buffers_group_events_go_to_admissions_jsonl_as_they_come_and_the_last_ones_at_the_end(tmp_path):
    from asyncrl.telemetry.admissions import read_attempts
    from asyncrl.telemetry.metrics import GroupEvents

    class Buffer(FakeRole):
        async def group_events(self) -> GroupEvents:
            return GroupEvents(released=[(3, "failed", "scorer/0#0 died")])

    asked = RoleStats(groups=GroupEvents(admitted=[2, 3], accepted=[2]))
    c = controller(tmp_path, [FakeRole(RoleStats(), RoleStats())], [], FakeRole(RoleStats()), Buffer(asked))
    c.admissions.start(0)
    c.steps.reports = [("buffer", RoleStats(groups=GroupEvents(admitted=[0, 1], accepted=[0, 1])))]
    c._step = 1
    asyncio.run(c._role_metrics(0.0, 1.0))  # the report that came with the publish
    c._step = 2
    c.steps.reports = [("trainer", RoleStats())]
    asyncio.run(c._role_metrics(1.0, 2.0))  # the buffer asked
    asyncio.run(c._last_group_events())
    [attempt] = read_attempts(tmp_path / "admissions.jsonl")
    assert (attempt.admitted, attempt.accepted, attempt.released) == ([0, 1, 2, 3], [0, 1, 2],
                                                                      [(3, "failed", "scorer/0#0 died")])
    steps = [line.split(",")[0] for line in (tmp_path / "admissions.jsonl").read_text().splitlines()]
    assert steps == ['{"attempt": 0', '{"step": 1', '{"step": 2', '{"step": 2']
