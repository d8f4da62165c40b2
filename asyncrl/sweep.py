"""`asyncrl sweep`: run a grid of settings, one `asyncrl launch` run per point, then tabulate and plot them.

Place in the dataflow: config + `--set key=v1,v2,...` axes ──► one run directory per grid point under
`sweep_dir/<setting>/` (each a normal `asyncrl launch` subprocess: a crash in one point cannot take the
sweep down, and each point gets a fresh process, as a user's own run would) ──► `summary.json` of each
run ──► `sweep_dir/results.csv`, `results.md`, `throughput_vs_staleness.png`, `reward_vs_time.png`.

A failed point is recorded in the table (status "failed", the error's last line) and the sweep goes on.
By default points run with `--local` (every role in one process: no ~35 s Ray start per point); `ray=True`
runs them on Ray, which gives each role its own process as in production.
"""

from __future__ import annotations

import csv
import itertools
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.telemetry.metrics import read_metrics
from asyncrl.telemetry.summary import summarize_rows, train_rows

log = logging.getLogger(__name__)

# Columns of the results table: (header, summary key, format)
COLUMNS: list[tuple[str, str, str]] = [
    ("samples/s", "throughput/samples_per_s", ".2f"),
    ("step s", "step_s/mean", ".3f"),
    ("time to target s", "time_to_target_s", ".1f"),
    ("final reward", "reward_final", ".3f"),
    ("final eval", "eval_greedy_last", ".3f"),
    ("staleness mean", "staleness_mean", ".2f"),
    ("staleness max", "staleness_max", ".0f"),
    ("generator busy", "generator/busy_share", ".2f"),
    ("scorer busy", "scorer/busy_share", ".2f"),
    ("trainer busy", "trainer/busy_share", ".2f"),
    ("overlap", "overlap_ratio", ".2f"),
]


class SweepPoint(msgspec.Struct, kw_only=True):
    name: str                         # directory name under the sweep dir, e.g. "max_staleness=1,num_generators=2"
    overrides: list[str]              # the `--set key=value` of this point
    values: dict[str, str]            # axis key -> value as written on the command line
    status: str = "pending"           # "ok" | "failed"
    error: str = ""                   # last line of a failed run's stderr
    summary: dict[str, Any] = {}


def parse_axes(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`["staleness.max_staleness=0,1,2", "rollout.num_generators=1,2"]` -> the grid's axes.

    Values are split on commas outside brackets and quotes, so `--set 'rollout.stop=["a","b"]'` stays one
    value. Raises ValueError with the item's text for a malformed axis.
    """
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or "." not in key or not text.strip():
            raise ValueError(f"--set {item}: expected section.key=v1,v2,..., e.g. staleness.max_staleness=0,1,2")
        if any(k == key for k, _ in axes):
            raise ValueError(f"--set {item}: {key} is given twice; list all its values in one --set")
        axes.append((key, _split_values(text)))
    return axes


def _split_values(text: str) -> list[str]:
    values, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(cur.strip())
            cur = ""
            continue
        cur += ch
    values.append(cur.strip())
    if any(not v for v in values):
        raise ValueError(f"empty value in {text!r}")
    return values


def grid(axes: list[tuple[str, list[str]]]) -> list[SweepPoint]:
    """Every combination of the axes' values, first axis varying slowest."""
    points = []
    for combo in itertools.product(*[vals for _, vals in axes]):
        values = {key: val for (key, _), val in zip(axes, combo)}
        name = ",".join(f"{key.rsplit('.', 1)[-1]}={_safe(val)}" for key, val in values.items()) or "default"
        points.append(SweepPoint(name=name, overrides=[f"{k}={v}" for k, v in values.items()], values=values))
    return points


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in text)


def run_point(config: str | Path, point: SweepPoint, run_dir: Path, *, ray: bool, extra: Sequence[str],
              timeout_s: float | None) -> tuple[str, str]:
    """Launch one grid point as `asyncrl launch` in a subprocess; (status, error line)."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", str(config)]
    for item in [*extra, *point.overrides, f'run.output_dir="{run_dir}"', "logging.live=false"]:
        cmd += ["--set", item]
    if not ray:
        cmd.append("--local")
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "launch.log").open("w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, timeout=timeout_s,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            return "failed", f"timed out after {timeout_s:.0f}s"
    if proc.stderr:
        with (run_dir / "launch.log").open("a") as log_file:
            log_file.write(proc.stderr)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return "failed", (lines[-1] if lines else f"exit code {proc.returncode}")[:300]
    return "ok", ""


def collect(point: SweepPoint, run_dir: Path, target_reward: float | None) -> dict[str, Any]:
    """The point's summary, recomputed from metrics.jsonl (so a target reward can be applied afterwards)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return {}
    return summarize_rows(read_metrics(metrics), target_reward=target_reward)


def run_sweep(config: str | Path, axes: list[tuple[str, list[str]]], sweep_dir: str | Path, *,
              ray: bool = False, extra: Sequence[str] = (), target_reward: float | None = None,
              timeout_s: float | None = None, skip_existing: bool = False) -> list[SweepPoint]:
    """Run every grid point (continuing past failures), then write the table and plots into `sweep_dir`."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    points = grid(axes)
    for i, point in enumerate(points, 1):
        run_dir = sweep_dir / point.name
        if skip_existing and (run_dir / "summary.json").exists():
            point.status = "ok"
        else:
            log.info("sweep point %d/%d: %s", i, len(points), point.name)
            point.status, point.error = run_point(config, point, run_dir, ray=ray, extra=extra, timeout_s=timeout_s)
            if point.status != "ok":
                log.warning("sweep point %s failed: %s", point.name, point.error)
        point.summary = collect(point, run_dir, target_reward)
    write_results(points, [k for k, _ in axes], sweep_dir)
    return points


def write_results(points: list[SweepPoint], axis_keys: list[str], sweep_dir: Path) -> None:
    (sweep_dir / "sweep.json").write_bytes(msgspec.json.format(msgspec.json.encode(points)))
    write_tables(points, axis_keys, sweep_dir)
    try:
        plot_sweep(points, axis_keys, sweep_dir)
    except ImportError as err:
        log.warning("no sweep plots: %s", err)


def _cell(value: Any, fmt: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return "" if value is None else str(value)


def write_tables(points: list[SweepPoint], axis_keys: list[str], sweep_dir: Path) -> None:
    """results.csv (raw numbers) and results.md (formatted), one row per grid point."""
    short = [k.rsplit(".", 1)[-1] for k in axis_keys]
    with (sweep_dir / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*short, "status", *[key for _, key, _ in COLUMNS], "error"])
        for p in points:
            w.writerow([*[p.values[k] for k in axis_keys], p.status,
                        *[p.summary.get(key, "") for _, key, _ in COLUMNS], p.error])
    head = [*short, "status", *[h for h, _, _ in COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        cells = [*[p.values[k] for k in axis_keys], p.status if p.status == "ok" else f"failed: {p.error}",
                 *[_cell(p.summary.get(key), fmt) for _, key, fmt in COLUMNS]]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    (sweep_dir / "results.md").write_text("\n".join(lines) + "\n")


def plot_sweep(points: list[SweepPoint], axis_keys: list[str], sweep_dir: Path) -> list[Path]:
    """throughput_vs_staleness.png (one line per setting of the other axes) and reward_vs_time.png."""
    from asyncrl.telemetry.plot import new_figure, save_figure

    ok = [p for p in points if p.status == "ok" and p.summary.get("throughput/samples_per_s") is not None]
    stale_key = next((k for k in axis_keys if k.endswith("max_staleness")), None)
    fig, ax = new_figure()
    if stale_key is not None:
        others = [k for k in axis_keys if k != stale_key]
        series: dict[str, list[tuple[float, float]]] = {}
        for p in ok:
            label = ",".join(f"{k.rsplit('.', 1)[-1]}={p.values[k]}" for k in others) or "throughput"
            series.setdefault(label, []).append((float(p.values[stale_key]), p.summary["throughput/samples_per_s"]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set_xticks(sorted({float(p.values[stale_key]) for p in ok}))
        ax.set_xlabel("max_staleness")
    else:  # no staleness axis: measured mean staleness on x
        for p in ok:
            ax.scatter([p.summary.get("staleness_mean", 0.0)], [p.summary["throughput/samples_per_s"]], label=p.name)
        ax.set_xlabel("mean staleness (policy versions)")
    ax.set_ylabel("throughput (trained samples / s)")
    ax.set_title("throughput vs staleness")
    if ok:
        ax.legend(loc="best", fontsize="small")
    paths = [save_figure(fig, sweep_dir / "throughput_vs_staleness.png")]

    fig, ax = new_figure()
    for p in points:
        metrics = sweep_dir / p.name / "metrics.jsonl"
        if p.status != "ok" or not metrics.exists():
            continue
        rows = train_rows(read_metrics(metrics))
        ax.plot([r["time/elapsed_s"] for r in rows], [r["reward/mean"] for r in rows], label=p.name, lw=1.2)
    ax.set_xlabel("wall clock (s)")
    ax.set_ylabel("training reward (reward/mean)")
    ax.set_title("reward vs wall time per setting")
    if ok:
        ax.legend(loc="best", fontsize="small")
    paths.append(save_figure(fig, sweep_dir / "reward_vs_time.png"))
    return paths


def load_sweep(sweep_dir: str | Path) -> list[SweepPoint]:
    return msgspec.json.decode((Path(sweep_dir) / "sweep.json").read_bytes(), type=list[SweepPoint])

