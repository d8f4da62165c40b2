"""The run's timeline: `<run_dir>/trace.json`, a Chrome/Perfetto trace of every role's spans.

Place in the dataflow: the Controller drains each role's `SpanRecorder` once per train step and hands the
spans to `TraceWriter.add_spans`; it also adds counter samples (queue depths, policy version) with
`add_counters`. Open the file in https://ui.perfetto.dev (or chrome://tracing): one process per role type,
one thread per actor, each span named by its kind and carrying the policy version it ran under.

The file is the JSON *array* form of the trace format, written as the run goes: `[` then one event per
line, each followed by a comma; `close()` ends it with `]`. Both viewers accept the array without its
closing bracket, so a crashed run still leaves a readable trace. `read_trace` parses either form.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from asyncrl.telemetry.spans import Span, TrackIds, chrome_trace_events

COUNTER_PID = 0  # counters get their own "process" so they sit above the role tracks
_ENCODE = msgspec.json.Encoder().encode  # one call per event: about 10x json.dumps (the driver writes ~60 a step)


class TraceWriter:
    """Appends trace events to a file as they arrive. Thread-safe; `origin` is the run's start time."""

    def __init__(self, path: str | Path, origin: float) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.origin = origin
        self._ids = TrackIds()
        self._lock = threading.Lock()
        self._file = self.path.open("w")
        self._file.write("[\n")
        self._write([{"name": "process_name", "ph": "M", "pid": COUNTER_PID, "args": {"name": "run"}}])

    def add_spans(self, spans: Iterable[Span]) -> None:
        with self._lock:
            self._write(chrome_trace_events(spans, origin=self.origin, ids=self._ids))

    def add_counters(self, t: float, values: Mapping[str, float]) -> None:
        """One sample of each counter at wall time `t` (e.g. {"buffer/rollout_depth": 12})."""
        events = [{"name": name, "ph": "C", "ts": (t - self.origin) * 1e6, "pid": COUNTER_PID,
                   "args": {"value": float(v)}} for name, v in values.items()]
        with self._lock:
            self._write(events)

    def _write(self, events: list[dict[str, object]]) -> None:
        if self._file.closed:
            raise ValueError(f"TraceWriter for {self.path} is closed")
        self._file.write(b"".join(_ENCODE(e) + b",\n" for e in events).decode())
        self._file.flush()  # a crashed run keeps the timeline up to its last step

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                # The array form tolerates a trailing comma before "]" only in some viewers: end with a
                # harmless metadata event instead.
                self._file.write(json.dumps({"name": "trace_end", "ph": "M", "pid": COUNTER_PID, "args": {}}))
                self._file.write("\n]\n")
                self._file.close()


def read_trace(path: str | Path) -> list[dict[str, object]]:
    """The events of a trace file: the object form `{"traceEvents": [...]}` or the array form, closed
    or not (a run that crashed before `close()`)."""
    text = Path(path).read_text().strip()
    if text.startswith("{"):
        return list(json.loads(text)["traceEvents"])
    if not text.endswith("]"):
        text = text.rstrip().rstrip(",") + "]"
    return list(json.loads(text))


def spans_from_trace(events: Iterable[Mapping[str, object]], origin: float = 0.0) -> list[Span]:
    """The Spans back from a trace's "X" events (times in seconds since `origin` + the trace's zero)."""
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        assert isinstance(args, dict)
        start = origin + float(e["ts"]) / 1e6  # type: ignore[arg-type]
        out.append(Span(role=str(args.get("role", e.get("tid"))), kind=str(e["name"]), start=start,
                        end=start + float(e["dur"]) / 1e6, version=int(args.get("version", -1)),  # type: ignore[arg-type]
                        cpu_s=float(args.get("cpu_s", -1.0))))  # type: ignore[arg-type]
    return out
