"""trace.json: written as the run goes, readable closed or not, spans round-trip through it."""

import json

import pytest

from asyncrl.telemetry.spans import Span
from asyncrl.telemetry.trace import TraceWriter, read_trace, spans_from_trace


def spans():
    return [Span(role="generator/0", kind="generate", start=100.5, end=101.0, version=3),
            Span(role="trainer", kind="train", start=100.75, end=101.25, version=3)]


def test_closed_trace_is_valid_json_with_spans_counters_and_track_names(tmp_path):
    writer = TraceWriter(tmp_path / "trace.json", origin=100.0)
    writer.add_spans(spans())
    writer.add_counters(101.0, {"buffer/rollout_depth": 7})
    writer.close()
    events = json.loads((tmp_path / "trace.json").read_text())  # plain JSON: what Perfetto loads
    counters = [e for e in events if e["ph"] == "C"]
    assert counters == [{"name": "buffer/rollout_depth", "ph": "C", "ts": pytest.approx(1e6), "pid": 0,
                         "args": {"value": 7.0}}]
    names = {e["args"]["name"] for e in events if e["name"] in ("process_name", "thread_name")}
    assert {"run", "generator", "generator/0", "trainer"} <= names


def test_unclosed_trace_of_a_crashed_run_is_still_readable(tmp_path):
    writer = TraceWriter(tmp_path / "trace.json", origin=100.0)
    writer.add_spans(spans())  # no close(): the run died here
    events = read_trace(tmp_path / "trace.json")
    assert [e["name"] for e in events if e["ph"] == "X"] == ["generate", "train"]


def test_spans_round_trip_through_the_trace(tmp_path):
    writer = TraceWriter(tmp_path / "trace.json", origin=100.0)
    writer.add_spans(spans())
    writer.close()
    back = spans_from_trace(read_trace(tmp_path / "trace.json"), origin=100.0)
    assert [(s.role, s.kind, s.version) for s in back] == [(s.role, s.kind, s.version) for s in spans()]
    assert [(s.start, s.end) for s in back] == [pytest.approx((s.start, s.end)) for s in spans()]


def test_writing_after_close_is_an_error(tmp_path):
    writer = TraceWriter(tmp_path / "trace.json", origin=0.0)
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.add_spans(spans())


def test_read_trace_accepts_the_object_form(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "dur": 1}]}))
    assert read_trace(path)[0]["name"] == "x"
