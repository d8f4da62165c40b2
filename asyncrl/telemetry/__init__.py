"""Telemetry: spans (busy/idle, overlap), the Perfetto trace, typed metrics and metrics.jsonl, run
summaries, metric sinks (TensorBoard, W&B, MLflow, trackio, live view), reward plots.

matplotlib, rich, tensorboard, wandb, mlflow and trackio are imported only where used, so importing this package needs
none of them.
"""

from asyncrl.telemetry.metrics import (
    AnyMetric,
    Last,
    Max,
    Mean,
    Metric,
    MetricsWriter,
    Min,
    Rate,
    RoleStats,
    Share,
    Sum,
    Total,
    Window,
    WindowReducer,
    read_metrics,
    reduce_metrics,
    staleness_stats,
    token_staleness_stats,
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
from asyncrl.telemetry.summary import summarize_rows, time_to_target
from asyncrl.telemetry.trace import TraceWriter, read_trace, spans_from_trace

__all__ = [
    "BUSY_KINDS", "IDLE_KINDS", "AnyMetric", "Last", "Max", "Mean", "Metric", "MetricsWriter", "Min",
    "Rate", "RoleStats", "Share", "Span", "SpanRecorder", "Sum", "Total", "Window", "WindowReducer",
    "busy_shares", "chrome_trace_events", "intersection_length",
    "overlap_ratio", "plot_run", "read_metrics", "reduce_metrics", "staleness_stats", "union_length",
    "token_staleness_stats", "summarize_rows", "time_to_target", "TraceWriter", "read_trace", "spans_from_trace",
]
