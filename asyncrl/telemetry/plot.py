"""Reward curves from run directories: `<run_dir>/metrics.jsonl` -> a PNG (`asyncrl plot`).

Place in the dataflow: the last consumer of the controller's metrics file (after the run, or while it
runs). `plot_run` draws one run's rewards; `plot_runs` overlays several runs (or chosen metric keys),
one line per run labelled by its directory's name. matplotlib is an optional extra, imported inside
these functions so the core runtime never needs it.

Keys read (each optional; absent series are skipped):
  "step"                    train step (x-axis of the left panel)
  "time/elapsed_s"          wall-clock seconds since the run started (x-axis of the right panel)
  "reward/mean"             training reward, mean over the step's samples
  "eval/greedy_reward"      held-out reward, greedy decoding
  "eval/sampled_reward"     held-out reward, sampled at the training temperature
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.telemetry.metrics import Scalar, read_metrics

logger = logging.getLogger(__name__)

STEP_KEY = "step"
TIME_KEY = "time/elapsed_s"
TRAIN_REWARD_KEY = "reward/mean"
EVAL_KEYS = ("eval/greedy_reward", "eval/sampled_reward")


def _series(records: list[dict[str, Scalar]], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """(x, y) points of the records that carry both keys as numbers, sorted by x."""
    points = []
    for r in records:
        x, y = r.get(x_key), r.get(y_key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(y, bool):
            points.append((float(x), float(y)))
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def new_figure(figsize: tuple[float, float] = (6.4, 4.2)) -> tuple[Any, Any]:
    """A one-panel (Figure, Axes) on the Agg canvas, without pyplot; ImportError names the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plots need matplotlib ({err}); install it with: pip install 'asyncrl[plot]'") from err
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.13, top=0.9)
    ax.grid(alpha=0.3)
    return fig, ax


def save_figure(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's reward curves to `out` (default `<run_dir>/reward_curve.png`); return its path.

    Left: training reward and eval rewards against train step. Right: rewards against wall clock.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plot_run needs matplotlib ({err}); install it with: pip install 'asyncrl[plot]'") from err

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        raise FileNotFoundError(f"no metrics file at {metrics_path}: is {run_dir} a run directory?")
    records = read_metrics(metrics_path)
    out_path = Path(out) if out is not None else run_dir / "reward_curve.png"

    # Figure + Agg canvas directly (not pyplot): no global backend switch, no figure registry.
    # Fixed margins rather than constrained layout, which doubles the time to draw.
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    by_step, by_time = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.12, top=0.84, wspace=0.2)
    styles = {TRAIN_REWARD_KEY: dict(lw=1.2, alpha=0.8), EVAL_KEYS[0]: dict(marker="o"), EVAL_KEYS[1]: dict(marker="s")}
    for ax, x_key, x_label in ((by_step, STEP_KEY, "train step"), (by_time, TIME_KEY, "wall clock (s)")):
        drawn = 0
        for y_key in (TRAIN_REWARD_KEY, *EVAL_KEYS):
            xs, ys = _series(records, x_key, y_key)
            if xs:
                ax.plot(xs, ys, label=y_key, **styles[y_key])
                drawn += 1
        if drawn:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no rewards with {x_key!r} in metrics.jsonl", ha="center", va="center",
                    transform=ax.transAxes)
            logger.info("plot_run: no reward series against %s in %s", x_key, metrics_path)
        ax.set_xlabel(x_label)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
    by_step.set_title("reward vs step")
    by_time.set_title("reward vs wall clock")
    fig.suptitle(f"run: {run_dir.resolve().name}")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=100)
    return out_path


COMPARE_OUT = "compare.png"  # `asyncrl plot A B` without --out: in the current directory


def _run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name; the paths as given where two names are the same (runs/a/x, runs/b/x)."""
    names = [d.resolve().name for d in run_dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def _read_runs(run_dirs: Sequence[str | Path]) -> list[tuple[Path, list[dict[str, Scalar]]]]:
    runs = []
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").exists():
            raise FileNotFoundError(f"no metrics file at {d / 'metrics.jsonl'}: is {d} a run directory?")
        runs.append((d, read_metrics(d / "metrics.jsonl")))
    return runs


def _check_metrics(runs: list[tuple[Path, list[dict[str, Scalar]]]], metrics: Sequence[str]) -> None:
    """A chosen key that no run has is a mistake: name it, and the nearest key the runs do have."""
    known = sorted({k for _, records in runs for r in records for k, v in r.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)})
    for key in metrics:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "docs/metrics.md lists the keys"
            raise ValueError(f"--metric {key}: no run has this key — {hint}")


def compare_figure(run_dirs: Sequence[str | Path], metrics: Sequence[str] = ()) -> Any:
    """A Figure with one row of panels per metric (default: the training reward, and the greedy held-out
    reward when a run has it), against train step (left) and wall clock (right); one line per run, in
    the same colour in every panel, labelled by its directory's name."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plots need matplotlib ({err}); install it with: pip install 'asyncrl[plot]'") from err
    runs = _read_runs(run_dirs)
    _check_metrics(runs, metrics)
    if not metrics:
        has_eval = any(EVAL_KEYS[0] in r for _, records in runs for r in records)
        metrics = [TRAIN_REWARD_KEY, *([EVAL_KEYS[0]] if has_eval else [])]
    labels = _run_labels([d for d, _ in runs])
    height = 1.0 + 3.2 * len(metrics)  # inches: 3.2 per row of panels, the title and x labels in the rest
    fig = Figure(figsize=(11, height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(metrics), 2, squeeze=False)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / height, top=1 - 0.6 / height, wspace=0.2, hspace=0.45)
    for row, key in zip(axes, metrics):
        for ax, x_key, x_label in ((row[0], STEP_KEY, "train step"), (row[1], TIME_KEY, "wall clock (s)")):
            for i, ((_, records), label) in enumerate(zip(runs, labels)):
                xs, ys = _series(records, x_key, key)
                if xs:
                    ax.plot(xs, ys, label=label, color=f"C{i % 10}", marker="o" if len(xs) < 12 else None)
            if ax.lines:
                ax.legend(loc="best", fontsize="small")
            else:
                ax.text(0.5, 0.5, f"no {key!r} against {x_key!r}", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(f"{key} vs {x_label.split(' (')[0]}", fontsize="medium")
            ax.set_xlabel(x_label)
            ax.grid(alpha=0.3)
    fig.suptitle("runs: " + ", ".join(labels))
    return fig


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None, metrics: Sequence[str] = ()) -> Path:
    """`asyncrl plot RUN_DIR [RUN_DIR ...] [--metric KEY ...]`: one run without --metric is `plot_run`;
    otherwise the runs overlaid (`compare_figure`) in `out`, default ./compare.png. Returns the path."""
    if len(run_dirs) == 1 and not metrics:
        return plot_run(run_dirs[0], out)
    return save_figure(compare_figure(run_dirs, metrics), out if out is not None else COMPARE_OUT)
