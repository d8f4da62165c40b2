"""Spans: who was busy, who waited, and when — the raw material of busy shares and overlap.

Place in the dataflow: every role (generator, scorer, trainer) owns a `SpanRecorder` and wraps its own
work and its waits in `rec.span(kind)`. Each role's `stats()` `drain()`s its recorder into the report of
its window (`telemetry.metrics.RoleStats`; Spans are msgspec Structs, so they cross the actor boundary),
and the controller computes from them the metrics defined in docs/metrics.md: `<role>/busy_share`,
`<role>/idle_share` and `overlap_ratio`. Spans can also be exported as Chrome/Perfetto trace events.
A role marks the start of each span with `rec.begin(kind)`: the activity it began last, which the run's
watch (asyncrl/control/watchdog.py) quotes when the role's event loop stalls.

Roles run in different processes on the same machine, so times are `time.time()` wall-clock seconds:
the only clock that is comparable across processes. Everything below the recorder is pure interval
maths on `(start, end)` pairs, tested by hand.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import msgspec

Interval = tuple[float, float]

# The one place that says which span kinds are a role's own work and which are waits.
# sleep / wake: a generator's engine releasing / taking back its cache (colocated placement); asleep: the
# time between them, while the trainer has the device.
BUSY_KINDS: frozenset[str] = frozenset(
    {"generate", "score", "train", "weights_send", "weights_recv", "weights_swap", "eval", "sleep", "wake"}
)
IDLE_KINDS: frozenset[str] = frozenset({"wait_queue", "wait_gate", "wait_weights", "asleep"})
# overlap_ratio counts only decode/prefill against forward/backward/optimizer, not weight traffic.
GENERATION_KINDS: frozenset[str] = frozenset({"generate"})
TRAINING_KINDS: frozenset[str] = frozenset({"train"})


class Span(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One stretch of wall time a role spent on one kind of thing."""

    role: str           # actor name, "<type>/<index>" (e.g. "generator/0") or a lone "trainer"
    kind: str           # a BUSY_KINDS or IDLE_KINDS member (other kinds are kept but count as neither)
    start: float        # time.time() seconds: comparable across processes on one machine
    end: float
    version: int = -1   # policy version the work ran under / produced; -1 = not applicable
    # CPU seconds of the recording process (all its threads) during the span; -1 = not measured. In the
    # in-process deployment that is every role's CPU: the planner's measure of how much of a phase's
    # wall time was computing rather than waiting (on the interpreter lock, a thread hand-off, the OS).
    cpu_s: float = -1.0

    @property
    def duration(self) -> float:
        return self.end - self.start


class Activity(msgspec.Struct, kw_only=True, frozen=True):
    """What a role began last: the watch (asyncrl/control/watchdog.py) quotes it when the role's loop stalls."""

    kind: str           # a span kind ("score", "generate", "wait_queue", ...)
    detail: str = ""    # a few words more, e.g. "reward fn"
    since: float        # time.time() when it began


class SpanRecorder:
    """Collects the spans of one role and the activity it began last. Thread-safe: engine compute runs on
    worker threads, and the watch reads the activity from another thread."""

    def __init__(self, role: str, *, clock: Callable[[], float] = time.time) -> None:
        self.role = role
        self._clock = clock
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._activity: Activity | None = None

    def begin(self, kind: str, detail: str = "") -> float:
        """Note that the role begins `kind` now (its last activity, until the next `begin`); returns the time,
        the start of the span the caller records when it ends."""
        now = self._clock()
        self._activity = Activity(kind=kind, detail=detail, since=now)  # one reference store: atomic
        return now

    @property
    def activity(self) -> Activity | None:
        """The activity begun last (None before the first)."""
        return self._activity

    @contextlib.contextmanager
    def span(self, kind: str, version: int = -1) -> Iterator[None]:
        """Record the wall time spent inside the block (also across awaits; also if it raises)."""
        start = self.begin(kind)
        try:
            yield
        finally:
            # time.time() can step backwards (NTP); a clock step is not the caller's error.
            end = max(self._clock(), start)
            self.record(kind, start, end, version)

    def record(self, kind: str, start: float, end: float, version: int = -1, cpu_s: float = -1.0) -> None:
        """Record a span measured elsewhere (e.g. timestamps returned by an engine thread); `cpu_s`: the
        process CPU seconds it took, where measured (`time.process_time()` difference)."""
        if end < start:
            raise ValueError(f"span {self.role}:{kind} ends before it starts ({end} < {start})")
        item = Span(role=self.role, kind=kind, start=start, end=end, version=version, cpu_s=cpu_s)
        with self._lock:
            self._spans.append(item)

    def drain(self) -> list[Span]:
        """Return the spans recorded since the last drain, and forget them."""
        with self._lock:
            out, self._spans = self._spans, []
        return out


# ---------------------------------------------------------------------------------------------
# Interval maths (pure)


def _merged(intervals: Iterable[Interval], window: Interval | None) -> list[Interval]:
    """Sorted, disjoint union of the intervals, clipped to the window; empty pieces dropped."""
    if window is not None and window[1] < window[0]:
        raise ValueError(f"window ends before it starts: {window}")
    pieces: list[Interval] = []
    for start, end in intervals:
        if end < start:
            raise ValueError(f"interval ends before it starts: ({start}, {end})")
        if window is not None:
            start, end = max(start, window[0]), min(end, window[1])
        if end > start:
            pieces.append((start, end))
    pieces.sort()
    merged: list[Interval] = []
    for start, end in pieces:
        if merged and start <= merged[-1][1]:  # overlapping or touching: extend the last piece
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def union_length(intervals: Iterable[Interval], window: Interval | None = None) -> float:
    """Length of the union of `(start, end)` intervals, counting only the part inside `window`."""
    return sum(end - start for start, end in _merged(intervals, window))


def intersection_length(
    a_intervals: Iterable[Interval], b_intervals: Iterable[Interval], window: Interval | None = None
) -> float:
    """Length of the time (inside `window`) covered by both the union of `a` and the union of `b`."""
    a, b = _merged(a_intervals, window), _merged(b_intervals, window)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:  # advance whichever piece finishes first
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------------------------------------
# Metrics from spans


def _window_length(spans: Sequence[Span], window: Interval | None) -> tuple[Interval, float]:
    if window is None:
        if not spans:
            raise ValueError("no spans and no window: nothing to measure")
        window = (min(s.start for s in spans), max(s.end for s in spans))
    length = window[1] - window[0]
    if length <= 0:
        raise ValueError(f"window must have positive length, got {window}")
    return window, length


def role_type(role: str) -> str:
    """The type of an actor: "generator/1" -> "generator"; an unindexed role is its own type."""
    return role.split("/", 1)[0]


def busy_shares(
    spans: Sequence[Span], window: Interval | None = None, roles: Iterable[str] = ()
) -> dict[str, float]:
    """Busy and idle share of each role over `window` (default: from the first start to the last end).

    Returns `"<role>/busy_share"` = |union of the role's BUSY_KINDS spans ∩ window| / |window| and
    `"<role>/idle_share"` = 1 - busy, for every role seen in `spans` or named in `roles` (name silent
    actors there so they count as fully idle). For indexed roles ("generator/0", "generator/1") the
    role type also gets the mean over its actors, "generator/busy_share" / "generator/idle_share".
    """
    window, length = _window_length(spans, window)
    busy: dict[str, list[Interval]] = {role: [] for role in roles}
    for s in spans:
        intervals = busy.setdefault(s.role, [])
        if s.kind in BUSY_KINDS:
            intervals.append((s.start, s.end))
    out: dict[str, float] = {}
    per_type: dict[str, list[float]] = {}
    for role, intervals in sorted(busy.items()):
        share = union_length(intervals, window) / length
        out[f"{role}/busy_share"] = share
        out[f"{role}/idle_share"] = 1.0 - share
        if "/" in role:
            per_type.setdefault(role_type(role), []).append(share)
    for kind, shares in per_type.items():
        mean = sum(shares) / len(shares)
        out[f"{kind}/busy_share"] = mean
        out[f"{kind}/idle_share"] = 1.0 - mean
    return out


def overlap_ratio(spans: Sequence[Span], window: Interval | None = None) -> float:
    """Fraction of `window` in which some generator generated while some trainer trained."""
    window, length = _window_length(spans, window)
    gen = [(s.start, s.end) for s in spans if s.kind in GENERATION_KINDS]
    train = [(s.start, s.end) for s in spans if s.kind in TRAINING_KINDS]
    return intersection_length(gen, train, window) / length


class TrackIds:
    """Integer process/thread ids for trace tracks (Perfetto's JSON importer wants integers), one per
    role type (process) and actor (thread), stable for the life of one trace."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.tids: dict[str, int] = {}

    def pid(self, role: str) -> tuple[int, bool]:
        """(pid of the role's type, True if this call created it)."""
        kind = role_type(role)
        if kind in self.pids:
            return self.pids[kind], False
        self.pids[kind] = len(self.pids) + 1
        return self.pids[kind], True

    def tid(self, role: str) -> tuple[int, bool]:
        if role in self.tids:
            return self.tids[role], False
        self.tids[role] = len(self.tids) + 1
        return self.tids[role], True


def chrome_trace_events(
    spans: Iterable[Span], *, origin: float = 0.0, ids: TrackIds | None = None
) -> list[dict[str, object]]:
    """Spans as Chrome/Perfetto "complete" events, one process per role type and one thread per actor.

    `ts` counts microseconds since `origin` (e.g. the run's start). The first event of a new process or
    thread is preceded by its name ("M" metadata event), so the tracks read "generator / generator/1".
    Pass the same `ids` to successive calls to append to one trace. Dump as `{"traceEvents": events}`.
    """
    ids = ids if ids is not None else TrackIds()
    events: list[dict[str, object]] = []
    for s in spans:
        pid, new_pid = ids.pid(s.role)
        tid, new_tid = ids.tid(s.role)
        if new_pid:
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": role_type(s.role)}})
        if new_tid:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": s.role}})
        events.append(
            {
                "name": s.kind,
                "cat": "busy" if s.kind in BUSY_KINDS else "idle",
                "ph": "X",
                "ts": (s.start - origin) * 1e6,  # the trace format counts microseconds
                "dur": (s.end - s.start) * 1e6,
                "pid": pid,
                "tid": tid,
                "args": {"version": s.version, "role": s.role, **({"cpu_s": s.cpu_s} if s.cpu_s >= 0 else {})},
            }
        )
    return events
