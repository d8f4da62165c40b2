"""`asyncrl report RUN_DIR`: a finished run's plots and a one-page summary (`RUN_DIR/report.md`).

Place in the dataflow: the last reader of a run directory — metrics.jsonl (per-step rows) and, when
present, trace.json (spans) and config.toml ──► `summarize_rows` ──► report.md + PNGs beside it:

  reward_curve.png   reward against step and wall clock (`telemetry.plot.plot_run`)
  utilisation.png    busy share per role type and overlap ratio, per step, against wall clock
  staleness.png      staleness histogram: trained samples (min version) and trained tokens (own version)

With max_staleness >= 1 and a trace, report.md also has the weight-version chain, link by link
(`telemetry.chain`): where the time goes between one update's end and the trainer holding the groups sampled
with its weights, and whether the trainer waited for them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from asyncrl.config import read_run_config
from asyncrl.telemetry.chain import chain_lines, weight_chain
from asyncrl.telemetry.metrics import read_metrics
from asyncrl.telemetry.plot import new_figure, plot_run, save_figure
from asyncrl.telemetry.summary import summarize_rows, train_rows
from asyncrl.telemetry.trace import read_trace, spans_from_trace

log = logging.getLogger(__name__)

ROLE_TYPES = ("generator", "scorer", "trainer")

# (label, summary key, format) of the report's table
LINES: list[tuple[str, str, str]] = [
    ("train steps", "steps", "d"),
    ("training loop seconds", "train_s", ".1f"),
    ("throughput (trained samples/s)", "throughput/samples_per_s", ".2f"),
    ("throughput (trained tokens/s)", "throughput/tokens_per_s", ".1f"),
    ("mean step seconds", "step_s/mean", ".3f"),
    ("reward first → final (mean of last 5 steps)", "reward_first", ".3f"),
    ("", "reward_final", ".3f"),
    ("held-out greedy reward first → last", "eval_greedy_first", ".3f"),
    ("", "eval_greedy_last", ".3f"),
    ("time to target reward (s)", "time_to_target_s", ".1f"),
    ("staleness mean / max (versions, per sample)", "staleness_mean", ".2f"),
    ("", "staleness_max", "d"),
    ("staleness mean per token", "staleness_token_mean", ".2f"),
    ("generator busy share", "generator/busy_share", ".2f"),
    ("scorer busy share", "scorer/busy_share", ".2f"),
    ("trainer busy share", "trainer/busy_share", ".2f"),
    ("overlap ratio", "overlap_ratio", ".2f"),
    ("weight sync seconds (mean)", "sync/seconds/mean", ".4f"),
    ("weight sync GB/s (mean)", "sync/gbps/mean", ".3f"),
    ("generation stall from updates (s, total)", "generation/stall_s", ".3f"),
    ("decode batch occupancy (mean)", "generation/occupancy/mean", ".2f"),
    ("engine-trainer logprob gap (mean)", "trainer/logprob_gap/mean", ".2e"),
    ("engine-trainer logprob diff, stale tokens too (mean)", "trainer/logprob_diff/mean", ".2e"),
    ("MoE routing agreement, engine vs trainer (mean)", "routing/agreement/mean", ".3f"),
]


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "d" and isinstance(value, (int, float)):
        return str(int(value))
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """Markdown table rows; a line with an empty label joins the previous one ("a → b" or "a / b")."""
    rows: list[list[str]] = []
    for label, key, spec in LINES:
        if key not in summary:
            continue
        if not label and rows:
            sep = " → " if "→" in rows[-1][0] else " / "
            rows[-1][1] += sep + _fmt(summary[key], spec)
        elif label:
            rows.append([label, _fmt(summary[key], spec)])
    return ["| figure | value |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows]]


def plot_utilisation(rows: list[dict[str, Any]], out: Path) -> Path:
    fig, ax = new_figure((7.5, 4.2))
    steps = train_rows(rows)
    t = [r["time/elapsed_s"] for r in steps]
    for role in ROLE_TYPES:
        ys = [r.get(f"{role}/busy_share") for r in steps]
        if any(isinstance(y, (int, float)) for y in ys):
            ax.plot(t, [y if isinstance(y, (int, float)) else float("nan") for y in ys], label=f"{role} busy")
    ov = [r.get("overlap_ratio") for r in steps]
    if any(isinstance(y, (int, float)) for y in ov):
        ax.plot(t, [y if isinstance(y, (int, float)) else float("nan") for y in ov], "k--", label="overlap")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("wall clock (s)")
    ax.set_ylabel("share of the step's wall time")
    ax.set_title("busy shares and overlap per step")
    ax.legend(loc="best", fontsize="small")
    return save_figure(fig, out)


def plot_staleness(summary: dict[str, Any], out: Path) -> Path:
    fig, ax = new_figure()
    width = 0.4
    for offset, key, label in ((-width / 2, "staleness_hist", "samples (min version)"),
                               (width / 2, "staleness_token_hist", "tokens (own version)")):
        hist = summary.get(key) or {}
        total = sum(hist.values())
        if total:
            ks = sorted(int(k) for k in hist)
            ax.bar([k + offset for k in ks], [hist[str(k)] / total for k in ks], width=width, label=label)
    ax.set_xlabel("staleness (policy versions behind the trainer)")
    ax.set_ylabel("share")
    ax.set_title("staleness distribution")
    ax.legend(loc="best", fontsize="small")
    return save_figure(fig, out)


def write_report(run_dir: str | Path, *, target_reward: float | None = None) -> Path:
    """Write report.md and its plots into `run_dir`; return report.md's path."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"no metrics file at {metrics}: is {run_dir} a run directory?")
    rows = read_metrics(metrics)
    if not train_rows(rows):
        raise ValueError(f"{metrics} has no finished train step: nothing to report")
    summary = summarize_rows(rows, target_reward=target_reward)
    figures = [plot_run(run_dir), plot_utilisation(rows, run_dir / "utilisation.png"),
               plot_staleness(summary, run_dir / "staleness.png")]
    lines = [f"# Run report: {run_dir.resolve().name}", ""]
    setting = _setting(run_dir)
    if setting:
        lines += ["Setting: " + ", ".join(f"`{k} = {v}`" for k, v in setting.items()), ""]
    lines += summary_lines(summary)
    lines += ["", "Definitions: docs/metrics.md. Timeline: open `trace.json` in https://ui.perfetto.dev."
              if (run_dir / "trace.json").exists() else "Definitions: docs/metrics.md (no trace.json in this run).", ""]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    k = setting.get("staleness.max_staleness", 0)
    chain = weight_chain(spans_from_trace(read_trace(run_dir / "trace.json")), k) \
        if k >= 1 and (run_dir / "trace.json").exists() else None
    if chain is not None:
        lines += ["", *chain_lines(chain)]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _setting(run_dir: Path) -> dict[str, Any]:
    """The overlap-relevant knobs from the run's config.toml (empty if it has none)."""
    if not (run_dir / "config.toml").exists():
        return {}
    cfg = read_run_config(run_dir)
    return {"rollout.num_generators": cfg.rollout.num_generators, "rollout.concurrency": cfg.rollout.concurrency,
            "staleness.max_staleness": cfg.staleness.max_staleness,
            "trainer.prompts_per_step": cfg.trainer.prompts_per_step, "rollout.group_size": cfg.rollout.group_size,
            "cluster.torch_threads": cfg.cluster.torch_threads}
