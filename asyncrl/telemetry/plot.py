"""Reward curves from a run directory: `<run_dir>/metrics.jsonl` -> a PNG.

Place in the dataflow: the last consumer of the controller's metrics file (after the run, or while it
runs). matplotlib is an optional extra, imported inside `plot_run` so the core runtime never needs it.

Keys read (each optional; absent series are skipped):
  "step"                    train step (x-axis of the left panel)
  "time/elapsed_s"          wall-clock seconds since the run started (x-axis of the right panel)
  "reward/mean"             training reward, mean over the step's samples
  "eval/greedy_reward"      held-out reward, greedy decoding
  "eval/sampled_reward"     held-out reward, sampled at the training temperature
"""

from __future__ import annotations

import logging
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
