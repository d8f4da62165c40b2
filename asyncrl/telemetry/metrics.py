"""Typed metrics, the roles' window reports, and the run's metrics file.

Place in the dataflow: each role's `stats()` returns a `RoleStats` — its `dict[str, Metric]` and spans for
its own window, i.e. what happened since its previous `stats()` call (reading resets it). The metric's type
says how values from several actors combine (tokens: `Sum`, loss: `Mean`, staleness: `Max`), and for the
window types how the window turns into a row value (`Rate`: per second of the step's window, `Share`: of
the actors' time in it, `Total`: added up over the windows, a count since the start). The Controller's
`WindowReducer` reduces the reports of a step into plain floats; `MetricsWriter` appends one line per step
to `<run_dir>/metrics.jsonl`; `read_metrics()` and `telemetry.plot` read it back.

Keys follow `role/quantity[/reduction]` (docs/metrics.md lists every key and what it means).

Non-finite numbers: JSON has no NaN/Infinity, so `MetricsWriter` writes NaN and ±inf as `null`, and
`read_metrics` returns them as `None` ("no value this step"); readers skip `None`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import msgspec

from asyncrl.telemetry.spans import Span

logger = logging.getLogger(__name__)

Scalar = float | int | str | bool | None


class Metric(msgspec.Struct, frozen=True, tag=True):
    """A reported value that knows how to combine with the same key from other actors.

    Tagged Structs, so a report survives msgspec encoding (decode with `type=dict[str, AnyMetric]`).
    """

    value: float

    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        raise NotImplementedError(f"{cls.__name__} has no reduction; use Mean, Sum, Max, Min or Last")


class Mean(Metric, frozen=True):
    """Weighted mean across reports; `weight` is e.g. the token count behind each actor's value."""

    weight: float = 1.0

    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        total = sum(m.weight for m in metrics)  # type: ignore[attr-defined]
        if total == 0:
            return math.nan
        return sum(m.value * m.weight for m in metrics) / total  # type: ignore[attr-defined]


class Sum(Metric, frozen=True):
    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        return float(sum(m.value for m in metrics))


class Max(Metric, frozen=True):
    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        return float(max(m.value for m in metrics))


class Min(Metric, frozen=True):
    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        return float(min(m.value for m in metrics))


class Last(Metric, frozen=True):
    """The value of the last report in the order given (e.g. a queue depth now, a learning rate)."""

    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        return float(metrics[-1].value)


class Total(Sum, frozen=True):
    """A count since the start of the run. Each report carries its window's increment; `reduce_metrics`
    sums the actors' increments, and `WindowReducer` adds the windows up into the row's total."""


class Rate(Metric, frozen=True):
    """An amount of the window (tokens, samples), summed over actors and shown per second of the window."""

    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        return float(sum(m.value for m in metrics)) / _window(cls, window_s)


class Share(Metric, frozen=True):
    """Seconds of each actor's window spent on one thing, shown as the share of the actors' time:
    the sum over actors / (window seconds × actors reporting)."""

    @classmethod
    def combine(cls, metrics: Sequence[Metric], window_s: float | None = None) -> float:
        return float(sum(m.value for m in metrics)) / (_window(cls, window_s) * len(metrics))


def _window(cls: type, window_s: float | None) -> float:
    if window_s is None or window_s <= 0:
        raise ValueError(f"a {cls.__name__} metric needs the window's length: reduce_metrics(..., window_s=...)")
    return window_s


AnyMetric = Mean | Sum | Max | Min | Last | Total | Rate | Share


def reduce_metrics(reports: Iterable[Mapping[str, Metric]], *, window_s: float | None = None) -> dict[str, float]:
    """Combine the reports of several actors key by key, each key by its metric's own reduction.

    `window_s`: the length of the window the reports cover (needed by `Rate` and `Share`). Raises
    ValueError if actors report one key with different reductions (a bug, not a choice).
    """
    grouped: dict[str, list[Metric]] = {}
    for report in reports:
        for key, metric in report.items():
            if not isinstance(metric, Metric):
                raise TypeError(f"metric {key!r} is a {type(metric).__name__}; wrap it in its Metric type "
                                "(Mean, Sum, Max, Min, Last, Total, Rate, Share)")
            grouped.setdefault(key, []).append(metric)
    out: dict[str, float] = {}
    for key, metrics in grouped.items():
        kinds = {type(m) for m in metrics}
        if len(kinds) > 1:
            names = sorted(k.__name__ for k in kinds)
            raise ValueError(f"metric {key!r} reported with different reductions: {names}")
        out[key] = type(metrics[0]).combine(metrics, window_s)
    return out


class GroupEvents(msgspec.Struct, kw_only=True):
    """What the staleness gate did with group ids in a window (buffers/gate.py), in the order it happened: the
    Controller appends it to RUN_DIR/admissions.jsonl (asyncrl/telemetry/admissions.py). A group id is the
    index of its prompt in the prompt stream (`PromptStream.row`), so `admitted` lists the prompts drawn."""

    admitted: list[int] = []  # handed to a generator (or `Runtime.submit`): fresh ids, or a resume's regenerated ones
    accepted: list[int] = []  # scored and stored for training
    released: list[tuple[int, str, str]] = []  # (id, "failed" | "filtered", why): will not be trained

    def __bool__(self) -> bool:
        return bool(self.admitted or self.accepted or self.released)


class RoleStats(msgspec.Struct, kw_only=True):
    """What a role's `stats()` returns: its metrics and spans for its own window — everything since its
    previous `stats()` call (reading resets the window). Structs all the way down, so it crosses the actor
    boundary as it is."""

    metrics: dict[str, AnyMetric] = {}
    spans: list[Span] = []  # the role's SpanRecorder, drained: busy shares, overlap, the trace
    groups: GroupEvents | None = None  # the buffer's only: its gate's group events (RUN_DIR/admissions.jsonl)

    def values(self) -> dict[str, float]:
        """Each metric's value as this one report carries it (unreduced: a `Total` is the window's
        increment, a `Rate` the window's amount)."""
        return {key: metric.value for key, metric in self.metrics.items()}


# The key under which a reply the Controller receives anyway (a generator's weight receive, the trainer's weight
# send, the buffer's publish) carries the role's `stats()` report when the caller asks for it (`report=True`):
# the report of the window that ends there, one actor call a step fewer per role (asyncrl/pipeline.py).
REPORT_KEY = "role/report"


_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 0.0  # statm counts pages
_kept: dict[tuple[str, int], tuple[int, int, int]] = {}  # (file, flags) -> (pid, its descriptor, the file's inode)


def _inode(fd: int) -> int:
    try:
        return os.fstat(fd).st_ino
    except OSError:  # closed
        return -1


def proc_fd(name: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of this process's /proc/<pid>/<name>, kept open across calls: the figures a role reads every
    step (`rss_mb`, asyncrl.telemetry.memory's peak) cost one `pread` or `write` and an `fstat` instead of an open
    and a close. A forked child opens its own (the parent's descriptor names the parent's process), and so does a
    process whose descriptor someone else closed (the number may name another file since: its inode tells).
    Raises OSError where there is no /proc."""
    pid, key = os.getpid(), (name, flags)
    kept = _kept.get(key)
    if kept is None or kept[0] != pid or _inode(kept[1]) != kept[2]:
        fd = os.open(f"/proc/{pid}/{name}", flags | os.O_CLOEXEC)
        kept = _kept[key] = (pid, fd, os.fstat(fd).st_ino)
    return kept[1]


def rss_mb() -> float:
    """This process's resident memory now, in MiB (/proc/self/statm; elsewhere the peak from getrusage).

    Every role's `stats()` and the Controller's row read it once a step, through a kept descriptor (`proc_fd`:
    6 µs against 35 µs to open, read and close the file)."""
    try:
        return int(os.pread(proc_fd("statm"), 256, 0).split()[1]) * _PAGE_MB
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc (macOS), no pread (Windows)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class CallCount:
    """Actor calls this process submitted (`asyncrl.deploy.actors.RayProxy`'s calls and the watch's heartbeats count
    themselves in `ACTOR_CALLS`): the Controller's rows carry the driver's calls a step (`controller/actor_calls`),
    each of which costs its event loop a Ray round trip (benchmarks/hub.py)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


ACTOR_CALLS = CallCount()  # this process's


class ProcessCpu:
    """The CPU seconds this process used since the previous `take()` (every thread: the role's event loop, its
    compute threads, Ray's own), for a role's window as `<role>/cpu_cores` (a Rate: cores busy on average).
    One per process: the Ray actor gives it to the role it was built for (a scorer the buffer's actor hosts
    reports none, the buffer's figure has its work); in process (--local) no role has one.

    `from_now=False` (a role's): the first `take()` only marks, returning None: what the process did before
    its first report (building the role, the weight-sync setup, the first evaluation) is no step's."""

    def __init__(self, *, from_now: bool = True) -> None:
        self._last: float | None = time.process_time() if from_now else None

    def take(self) -> float | None:
        now = time.process_time()
        used, self._last = (None if self._last is None else now - self._last), now
        return used


def process_cpu_metrics(role: str, cpu: ProcessCpu | None) -> dict[str, Metric]:
    """`<role>/cpu_cores` of the window when the role's process reports its CPU (`ProcessCpu`) and has a window
    to report (not its first report), else nothing."""
    used = cpu.take() if cpu is not None else None
    return {f"{role}/cpu_cores": Rate(used)} if used is not None else {}


class Window:
    """Increments since the previous read of counters kept since the start: how a role's `stats()` reports
    its window without resetting counters that must stay whole (the gate's counts drive admission, an
    engine keeps its own pause record)."""

    def __init__(self, marks: Mapping[str, float] | None = None) -> None:
        self._read: dict[str, float] = dict(marks or {})

    def marks(self) -> dict[str, float]:
        """Each counter's value at its previous read (a checkpoint keeps them: `Window(marks)` goes on)."""
        return dict(self._read)

    def take(self, key: str, total: float) -> float:
        """`total` minus its value at the previous `take` of `key` (0 before the first)."""
        previous = self._read.get(key, 0.0)
        self._read[key] = float(total)
        return float(total) - previous


class WindowReducer:
    """The Controller's reduction of one step's role reports into metrics-row values: each key by its
    metric's type over the step's window, and each `Total` key added up over the windows so far (a total
    stays in every row once it has been reported)."""

    def __init__(self, totals: Mapping[str, float] | None = None) -> None:
        self.totals: dict[str, float] = dict(totals or {})  # a resumed run starts from the checkpoint's

    def reduce(self, reports: Iterable[Mapping[str, Metric]], window_s: float) -> dict[str, float]:
        reports = list(reports)
        out = reduce_metrics(reports, window_s=window_s)
        for key in {k for r in reports for k, m in r.items() if isinstance(m, Total)}:
            self.totals[key] = self.totals.get(key, 0.0) + out[key]
        out.update(self.totals)
        return out


def staleness_stats(values: Sequence[int]) -> dict[str, float]:
    """Mean, max and histogram of per-trajectory staleness (`v_train - min_version`).

    Returns "staleness/mean", "staleness/max" and "staleness/hist/<k>" (count) for k = 0..max;
    empty when nothing was trained.
    """
    if not values:
        return {}
    if min(values) < 0:
        raise ValueError(f"staleness must be >= 0 (v_train - min_version), got {min(values)}")
    top = max(values)
    counts = [0] * (top + 1)
    for v in values:
        counts[int(v)] += 1
    out: dict[str, float] = {"staleness/mean": sum(values) / len(values), "staleness/max": int(top)}
    out.update({f"staleness/hist/{k}": n for k, n in enumerate(counts)})
    return out


def generator_staleness_stats(samples: Iterable[tuple[int, int]]) -> dict[str, float]:
    """Per generator, of a step's trained trajectories given as (generator id, staleness): how many it sampled
    and their staleness mean and max, as "generator/<i>/trained_samples", "generator/<i>/staleness/mean" and
    "generator/<i>/staleness/max"; a generator none of whose trajectories were trained gets no keys, and
    trajectories of no generator (id -1: `Runtime.submit`) count for none."""
    by_generator: dict[int, list[int]] = {}
    for generator_id, staleness in samples:
        if generator_id >= 0:
            by_generator.setdefault(int(generator_id), []).append(staleness)
    out: dict[str, float] = {}
    for i, values in sorted(by_generator.items()):
        out[f"generator/{i}/trained_samples"] = len(values)
        out[f"generator/{i}/staleness/mean"] = sum(values) / len(values)
        out[f"generator/{i}/staleness/max"] = max(values)
    return out


def token_staleness_stats(lags: Sequence[int]) -> dict[str, float]:
    """Per-token staleness (`v_train - version of the token`) of a step's trained response tokens.

    A trajectory whose weights were swapped mid-generation spans several versions; its tokens are counted
    each at its own version. Returns "staleness/token_mean" and "staleness/token_hist/<k>" (token count)
    for k = 0..max; empty when there were no tokens.
    """
    if not lags:
        return {}
    if min(lags) < 0:
        raise ValueError(f"token staleness must be >= 0, got {min(lags)}")
    counts = [0] * (max(lags) + 1)
    for v in lags:
        counts[int(v)] += 1
    out: dict[str, float] = {"staleness/token_mean": sum(lags) / len(lags)}
    out.update({f"staleness/token_hist/{k}": n for k, n in enumerate(counts)})
    return out


# ---------------------------------------------------------------------------------------------
# metrics.jsonl


def _plain(key: str, value: object) -> Scalar:
    """A JSON-ready scalar: numpy/torch scalars unwrapped, NaN/±inf -> None."""
    kind = type(value)  # a row's ~100 values are nearly all plain floats and ints: those first
    if kind is float:
        return value if math.isfinite(value) else None  # type: ignore[arg-type]
    if kind is int:
        return value  # type: ignore[return-value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if not isinstance(value, (int, float)) and hasattr(value, "item"):
        try:
            value = value.item()  # numpy scalar, 0-d array, one-element torch tensor
        except (ValueError, RuntimeError) as err:
            raise TypeError(f"metric {key!r} is not a scalar: {err}") from None
        if isinstance(value, bool):
            return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} has a {type(value).__name__}; log numbers or strings only")


class MetricsWriter:
    """Appends one JSON object per line to a metrics file, flushed after every write.

    Appending (never truncating) lets a resumed run continue the same file. Thread-safe.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, object]) -> None:
        """Write one record (e.g. one train step's reduced metrics). Values must be scalars."""
        line = msgspec.json.encode({str(k): _plain(str(k), v) for k, v in record.items()}) + b"\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"MetricsWriter for {self.path} is closed")
            self._file.write(line)
            self._file.flush()  # a crashed run still leaves every finished step on disk

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Scalar]]:
    """All records of a metrics file, in order. NaN/inf were written as null and come back as None.

    A malformed *last* line (a run killed mid-write) is skipped with a warning; one elsewhere raises.
    """
    path = Path(path)
    lines = path.read_bytes().splitlines()
    records: list[dict[str, Scalar]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = msgspec.json.decode(line)
        except msgspec.DecodeError as err:
            if number == len(lines):
                logger.warning("%s:%d: skipping a truncated last line (%s)", path, number, err)
                continue
            raise ValueError(f"{path}:{number}: not a JSON object: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records
