"""Run-level figures from the per-step metrics rows: what `summary.json`, sweeps and reports show.

Place in the dataflow: metrics.jsonl rows (written by the Controller, one per train step) ──►
`summarize_rows` ──► `summary.json` (Controller), the sweep table (`asyncrl.sweep`), `asyncrl report`.

Each step's window is `time/step_s` seconds long and the windows tile the training loop, so a run's busy
share or overlap ratio is the window-length-weighted mean of the per-step values: exactly the share of
the whole loop, not an average of ratios.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

REWARD_KEY = "reward/mean"
SMOOTH_STEPS = 5  # final reward and time-to-target use the mean of this many consecutive train steps
COLOCATE_KEYS = ("colocate/sleep_s", "colocate/asleep_s", "colocate/wake_s")  # colocated placement only
# written where they apply (MoE routing, the native engine's decode batch; docs/metrics.md): their run means too
RUN_MEAN_KEYS = ("routing/agreement", "trainer/logprob_gap", "trainer/logprob_diff", "generation/occupancy")
_SHARE = re.compile(r"^([a-z_]+)/(busy_share|idle_share)$")  # role *types* only, not "generator/0/..."


def train_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of finished train steps (the evaluation-only row of version 0 is not one)."""
    return [r for r in rows if isinstance(r.get(REWARD_KEY), (int, float))]


def _num(row: Mapping[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _weighted(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    pairs = [(w, v) for r in rows if (w := _num(r, "time/step_s")) and (v := _num(r, key)) is not None]
    total = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / total if total > 0 else None


def _merged_hist(rows: Sequence[Mapping[str, Any]], prefix: str) -> dict[int, float]:
    hist: dict[int, float] = {}
    for r in rows:
        for key, v in r.items():
            if key.startswith(prefix) and isinstance(v, (int, float)):
                k = int(key[len(prefix):])
                hist[k] = hist.get(k, 0.0) + float(v)
    return dict(sorted(hist.items()))


def time_to_target(rows: Sequence[Mapping[str, Any]], target: float, key: str = REWARD_KEY,
                   smooth: int = SMOOTH_STEPS) -> float | None:
    """Wall seconds (`time/elapsed_s`) at the first step where the mean of `key` over the last `smooth`
    steps reaches `target`; None if it never does."""
    window: list[float] = []
    for r in rows:
        v, t = _num(r, key), _num(r, "time/elapsed_s")
        if v is None or t is None:
            continue
        window = [*window, v][-max(1, smooth):]
        if len(window) == max(1, smooth) and sum(window) / len(window) >= target:
            return t
    return None


def summarize_rows(rows: Sequence[Mapping[str, Any]], *, target_reward: float | None = None) -> dict[str, Any]:
    """Run-level figures from metrics rows (see docs/metrics.md, "summary.json")."""
    steps = train_rows(rows)
    out: dict[str, Any] = {"steps": len(steps)}
    if not steps:
        return out
    train_s = sum(_num(r, "time/step_s") or 0.0 for r in steps)
    samples = sum(_num(r, "trainer/samples") or 0.0 for r in steps)
    tokens = sum(_num(r, "trainer/tokens") or 0.0 for r in steps)
    out["train_s"] = train_s
    out["step_s/mean"] = train_s / len(steps)
    if train_s > 0:
        out["throughput/samples_per_s"] = samples / train_s
        out["throughput/tokens_per_s"] = tokens / train_s
    rewards = [float(r[REWARD_KEY]) for r in steps]
    out["reward_first"] = rewards[0]
    out["reward_last"] = rewards[-1]
    out["reward_final"] = sum(rewards[-SMOOTH_STEPS:]) / len(rewards[-SMOOTH_STEPS:])
    evals = [r for r in rows if _num(r, "eval/greedy_reward") is not None]
    if evals:
        out["eval_greedy_first"] = float(evals[0]["eval/greedy_reward"])
        out["eval_greedy_last"] = float(evals[-1]["eval/greedy_reward"])
    hist = _merged_hist(steps, "staleness/hist/")
    if hist:
        n = sum(hist.values())
        out["staleness_mean"] = sum(k * c for k, c in hist.items()) / n if n else 0.0
        out["staleness_max"] = max(k for k, c in hist.items() if c > 0) if n else 0
        out["staleness_hist"] = {str(k): int(c) for k, c in hist.items()}
    token_hist = _merged_hist(steps, "staleness/token_hist/")
    if token_hist:
        n = sum(token_hist.values())
        out["staleness_token_mean"] = sum(k * c for k, c in token_hist.items()) / n if n else 0.0
        out["staleness_token_hist"] = {str(k): int(c) for k, c in token_hist.items()}
    share_keys = sorted({k for r in steps for k in r if _SHARE.match(k)})
    for key in [*share_keys, "overlap_ratio"]:
        value = _weighted(steps, key)
        if value is not None:
            out[key] = value
    for key in ("sync/seconds", "sync/gbps", "trainer/step_s", "trainer/gate_wait_s", *COLOCATE_KEYS,
                *RUN_MEAN_KEYS):
        vals = [v for r in steps if (v := _num(r, key)) is not None]
        if vals:
            out[f"{key}/mean"] = sum(vals) / len(vals)
    for key in sorted({k for r in steps for k in r if k.startswith("memory/")}):  # the run's peak per role
        peak = max((v for r in steps if (v := _num(r, key)) is not None), default=None)
        if peak is not None:
            out[key] = peak
    stall = [v for r in steps if (v := _num(r, "generation/stall_s")) is not None]
    if stall:
        out["generation/stall_s"] = sum(stall)
    if target_reward is not None:
        out["target_reward"] = target_reward
        out["time_to_target_s"] = time_to_target(steps, target_reward)
    return out
