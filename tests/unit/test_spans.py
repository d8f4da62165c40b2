"""Interval maths, busy/idle shares and overlap from hand-made spans; the recorder across threads."""

import asyncio
import threading

import msgspec
import pytest

from asyncrl.telemetry.spans import (
    Span,
    SpanRecorder,
    TrackIds,
    busy_shares,
    chrome_trace_events,
    intersection_length,
    overlap_ratio,
    union_length,
)


def span(role: str, kind: str, start: float, end: float) -> Span:
    return Span(role=role, kind=kind, start=start, end=end)


@pytest.mark.parametrize(
    ("intervals", "window", "expected"),
    [
        ([], None, 0.0),
        ([(0, 2), (5, 6)], None, 3.0),                    # disjoint
        ([(0, 4), (1, 2)], None, 4.0),                    # nested
        ([(0, 2), (1, 3)], None, 3.0),                    # overlapping
        ([(0, 1), (1, 2)], None, 2.0),                    # touching
        ([(3, 4), (0, 2), (1, 3.5)], None, 4.0),          # unsorted chain
        ([(0, 10)], (2, 5), 3.0),                         # clipped on both sides
        ([(0, 1), (4, 6), (9, 12)], (0.5, 10), 3.5),      # clipped at the edges, middle whole
        ([(0, 1)], (2, 5), 0.0),                          # entirely outside
        ([(1, 1), (2, 2)], None, 0.0),                    # zero-length spans count nothing
    ],
)
def test_union_length_counts_covered_time_once(intervals, window, expected):
    assert union_length(intervals, window) == pytest.approx(expected)


def test_union_length_rejects_inverted_interval():
    with pytest.raises(ValueError, match="ends before it starts"):
        union_length([(2, 1)])


@pytest.mark.parametrize(
    ("a", "b", "window", "expected"),
    [
        ([(0, 4)], [(2, 6)], None, 2.0),
        ([(0, 1)], [(1, 2)], None, 0.0),                      # touching is not overlapping
        ([(0, 10)], [(1, 2), (4, 5), (8, 12)], None, 4.0),    # one long against several short
        ([(0, 3), (2, 5)], [(1, 2), (1.5, 4)], None, 3.0),    # each side overlaps itself: unions first
        ([(0, 10)], [(0, 10)], (3, 7), 4.0),                  # clipped to the window
        ([(0, 2)], [(5, 6)], None, 0.0),                      # disjoint
        ([], [(0, 1)], None, 0.0),
    ],
)
def test_intersection_length_is_time_both_unions_are_active(a, b, window, expected):
    assert intersection_length(a, b, window) == pytest.approx(expected)
    assert intersection_length(b, a, window) == pytest.approx(expected)


def test_busy_shares_per_actor_and_mean_per_role_type():
    spans = [
        # generator/0: busy [0,4] and [3,6] overlap -> 6 s busy; the wait does not count
        span("generator/0", "generate", 0, 4),
        span("generator/0", "weights_swap", 3, 6),
        span("generator/0", "wait_weights", 6, 10),
        # generator/1: busy 2 s
        span("generator/1", "generate", 8, 10),
        span("generator/1", "wait_gate", 0, 8),
        # trainer (unindexed): busy 5 s, partly outside the window
        span("trainer", "train", -3, 4),
        span("trainer", "weights_send", 4, 5),
        span("trainer", "wait_queue", 5, 10),
    ]
    shares = busy_shares(spans, window=(0, 10))
    assert shares == pytest.approx(
        {
            "generator/0/busy_share": 0.6, "generator/0/idle_share": 0.4,
            "generator/1/busy_share": 0.2, "generator/1/idle_share": 0.8,
            "generator/busy_share": 0.4, "generator/idle_share": 0.6,
            "trainer/busy_share": 0.5, "trainer/idle_share": 0.5,
        }
    )


def test_busy_shares_counts_named_silent_actor_as_fully_idle():
    shares = busy_shares([span("scorer/0", "score", 0, 2)], window=(0, 4), roles=["scorer/1"])
    assert shares["scorer/1/busy_share"] == 0.0
    assert shares["scorer/busy_share"] == pytest.approx(0.25)


def test_busy_shares_window_defaults_to_extent_of_spans():
    shares = busy_shares([span("trainer", "train", 2, 3), span("trainer", "wait_queue", 3, 6)])
    assert shares["trainer/busy_share"] == pytest.approx(0.25)


def test_busy_shares_rejects_empty_window():
    with pytest.raises(ValueError, match="positive length"):
        busy_shares([span("trainer", "train", 0, 1)], window=(5, 5))


def test_overlap_ratio_counts_generate_against_train_only():
    spans = [
        span("generator/0", "generate", 0, 3),
        span("generator/1", "generate", 2, 5),         # union of generation: [0, 5]
        span("generator/0", "weights_swap", 5, 9),     # busy, but not generation
        span("trainer", "train", 4, 8),                # overlaps generation on [4, 5]
        span("trainer", "train", 1, 2),                # overlaps on [1, 2]
        span("trainer", "weights_send", 0, 10),        # busy, but not training
    ]
    assert overlap_ratio(spans, window=(0, 10)) == pytest.approx(0.2)


def test_recorder_drains_span_recorded_on_another_thread():
    rec = SpanRecorder("generator/0")

    def work():
        with rec.span("generate", version=3):
            pass

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    (only,) = rec.drain()
    assert (only.role, only.kind, only.version) == ("generator/0", "generate", 3)
    assert only.end >= only.start
    assert rec.drain() == []  # drain forgets what it returned


def test_recorder_span_measures_wall_time_across_awaits_and_exceptions():
    ticks = iter([10.0, 12.5, 20.0, 21.0])
    rec = SpanRecorder("trainer", clock=lambda: next(ticks))

    async def train():
        with rec.span("train", version=1):
            await asyncio.sleep(0)

    asyncio.run(train())
    with pytest.raises(RuntimeError):
        with rec.span("wait_queue"):
            raise RuntimeError("boom")
    assert [(s.kind, s.start, s.end) for s in rec.drain()] == [("train", 10.0, 12.5), ("wait_queue", 20.0, 21.0)]


def test_recorder_keeps_the_activity_begun_last_and_begin_returns_the_spans_start():
    ticks = iter([5.0, 7.0, 9.0, 9.5])
    rec = SpanRecorder("scorer/0", clock=lambda: next(ticks))
    assert rec.activity is None
    assert rec.begin("wait_queue", "rollout queue") == 5.0
    assert rec.begin("score", "reward fn") == 7.0
    assert (rec.activity.kind, rec.activity.detail, rec.activity.since) == ("score", "reward fn", 7.0)
    with rec.span("reference"):  # a span begins an activity too
        pass
    assert (rec.activity.kind, rec.activity.since) == ("reference", 9.0)
    assert rec.drain() == [Span(role="scorer/0", kind="reference", start=9.0, end=9.5)]  # begin records no span


def test_record_rejects_span_that_ends_before_it_starts():
    with pytest.raises(ValueError, match="ends before it starts"):
        SpanRecorder("trainer").record("train", 5.0, 4.0)


def test_span_round_trips_through_msgspec():
    s = Span(role="scorer/0", kind="score", start=1.5, end=2.0, version=7)
    assert msgspec.json.decode(msgspec.json.encode(s), type=Span) == s


def test_chrome_trace_events_use_microseconds_and_one_track_per_role():
    meta_process, meta_thread, event = chrome_trace_events([span("generator/1", "generate", 1.0, 1.5)])
    assert event["ph"] == "X" and event["ts"] == 1e6 and event["dur"] == pytest.approx(5e5)
    assert event["cat"] == "busy" and event["args"] == {"version": -1, "role": "generator/1"}
    assert meta_process == {"name": "process_name", "ph": "M", "pid": event["pid"], "args": {"name": "generator"}}
    assert meta_thread["args"] == {"name": "generator/1"} and meta_thread["tid"] == event["tid"]


def test_chrome_trace_events_name_each_track_once_across_calls():
    ids = TrackIds()
    first = chrome_trace_events([span("generator/0", "generate", 10.0, 11.0),
                                 span("generator/1", "generate", 10.0, 11.0)], origin=10.0, ids=ids)
    second = chrome_trace_events([span("generator/0", "wait_gate", 11.0, 12.0),
                                  span("trainer", "train", 11.0, 12.0)], origin=10.0, ids=ids)
    names = [e["args"]["name"] for e in first + second if e["ph"] == "M"]
    assert names == ["generator", "generator/0", "generator/1", "trainer", "trainer"]
    xs = [e for e in first + second if e["ph"] == "X"]
    assert xs[0]["ts"] == 0.0 and xs[2]["ts"] == pytest.approx(1e6)
    assert xs[0]["pid"] == xs[1]["pid"] != xs[3]["pid"]          # one process per role type
    assert xs[0]["tid"] == xs[2]["tid"] != xs[1]["tid"]          # one thread per actor
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in xs)
