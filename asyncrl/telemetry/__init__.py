"""Telemetry: spans (busy/idle, overlap, traces), typed metrics and metrics.jsonl, reward plots.

matplotlib is imported only inside `plot_run`, so importing this package needs no plotting extra.
"""

from asyncrl.telemetry.metrics import (
    AnyMetric,
    Last,
    Max,
    Mean,
    Metric,
    MetricsWriter,
    Min,
    Sum,
    read_metrics,
    reduce_metrics,
    staleness_stats,
)
from asyncrl.telemetry.plot import plot_run
from asyncrl.telemetry.spans import (
    BUSY_KINDS,
    IDLE_KINDS,
    Span,
    SpanRecorder,
    busy_shares,
    chrome_trace_events,
    intersection_length,
    overlap_ratio,
    union_length,
)

__all__ = [
    "BUSY_KINDS", "IDLE_KINDS", "AnyMetric", "Last", "Max", "Mean", "Metric", "MetricsWriter", "Min",
    "Span", "SpanRecorder", "Sum", "busy_shares", "chrome_trace_events", "intersection_length",
    "overlap_ratio", "plot_run", "read_metrics", "reduce_metrics", "staleness_stats", "union_length",
]
