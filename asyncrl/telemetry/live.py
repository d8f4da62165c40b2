"""The live console view of `asyncrl launch`: progress to `total_steps`, reward, staleness, busy shares, ETA.

Place in the dataflow: a metric sink (see `loggers.py`): the Controller hands it each step's row; it
redraws a small rich panel in place. On only when `[logging] live` says so ("auto": stdout is a
terminal), so CI logs and tests never see control codes. rich is a core dependency.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROLE_TYPES = ("generator", "scorer", "trainer")


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def eta_seconds(done: int, total: int, elapsed_s: float) -> float | None:
    """Seconds left at the mean pace so far; None before the first step."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return max(0, total - done) * elapsed_s / done


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def stats_table(row: Mapping[str, Any], eta_s: float | None) -> Table:
    """The figures under the progress bar, from the latest metrics row."""
    table = Table.grid(padding=(0, 2))
    for _ in range(4):
        table.add_column()
    table.add_row("reward", _fmt(row.get("reward/mean")), "eval greedy", _fmt(row.get("eval/greedy_reward")))
    table.add_row("staleness mean", _fmt(row.get("staleness/mean"), ".2f"),
                  "staleness max", _fmt(row.get("staleness/max"), ".0f"))
    busy = " ".join(f"{r} {_fmt(row.get(f'{r}/busy_share'), '.0%')}" for r in ROLE_TYPES)
    table.add_row("busy", busy, "overlap", _fmt(row.get("overlap_ratio"), ".0%"))
    table.add_row("gen tok/s", _fmt(row.get("generation/tokens_per_s"), ".0f"),
                  "ETA", format_duration(eta_s))
    return table


class LiveView:
    """Metric sink that redraws a progress bar and the latest figures. `console` is injectable for tests."""

    def __init__(self, total_steps: int, run_name: str = "", console: Console | None = None,
                 clock: Any = time.monotonic) -> None:
        self.total_steps = total_steps
        self._clock = clock
        self._t0 = clock()
        self._progress = Progress(TextColumn(f"[bold]{run_name}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console)
        self._task = self._progress.add_task("steps", total=total_steps)
        self._row: Mapping[str, Any] = {}
        self._live = Live(self._render(None), console=console, refresh_per_second=4, transient=False)
        self._live.start()
        # Live reroutes sys.stdout/stderr so prints appear above the panel; log handlers opened on the
        # original streams would draw through it, so point them at the rerouted ones until close().
        self._handlers = [(h, h.stream) for h in logging.getLogger().handlers
                          if type(h) is logging.StreamHandler and h.stream in (sys.__stderr__, sys.__stdout__)]
        for h, stream in self._handlers:
            h.setStream(sys.stderr if stream is sys.__stderr__ else sys.stdout)

    def _render(self, eta_s: float | None) -> Group:
        return Group(self._progress, stats_table(self._row, eta_s))

    def log(self, row: Mapping[str, Any]) -> None:
        self._row = row
        done = int(row.get("step", 0))
        self._progress.update(self._task, completed=done)
        self._live.update(self._render(eta_seconds(done, self.total_steps, self._clock() - self._t0)))

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Shown above the panel as log lines (RolloutLog logs the first `logging.rollouts_shown`)."""

    def close(self, outcome: str = "finished") -> None:
        for h, stream in self._handlers:
            h.setStream(stream)
        self._live.stop()
