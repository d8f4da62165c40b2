"""Soak benchmark: a long run of the tiny learning example must not grow.

    python benchmarks/soak.py                   # Ray, 4000 train steps of a tiny model: a few minutes
    python benchmarks/soak.py --steps 2000      # shorter (the slope then starts at step 1000)
    python benchmarks/soak.py --local           # every role in this process

The learning example (examples/first_digit/config.toml) with 4 groups of 4 a step and staleness 4:
generation is much faster than training, so queues stay full and every per-step leftover (rows, spans,
store keys, reward threads) would show. Each role reports its resident memory every step (`<role>/rss_mb`,
`buffer/rss_mb`, and the driver's `controller/rss_mb`). The slope of a least-squares line through each
series after the first `--warmup` share of the steps is printed in MiB per 1000 steps, beside the series'
value at the start, at the end of the warm-up and at the end. The JSON line's value is the largest slope
over the roles and the driver; the target is below 1 MiB per 1000 steps (the baseline is a flat series, 0).

What the run keeps per step, and its bound: the Controller the newest 100 rows (`ROWS_KEPT`; every row
streams to metrics.jsonl) and the spans that end after the current window (every span streams to
trace.json when tracing is on); each engine the last 4096 decode-step and swap records; the weight-sync
store no key per broadcast (the last receiver deletes it); a scorer at most 8 hung reward threads.

Why the warm-up is half the run: the roles' resident memory rises over roughly the first 2000 steps of this
workload (about a minute) and is flat after that. The rise is the C heap settling, not live data: glibc's
in-use bytes (mallinfo2) stayed flat in every role while its free-list bytes grew by a few MiB, in steps
(benchmarks/log/2026-12-01.md). A warm-up of a quarter of 2000 steps measured that settling as a slope.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXAMPLE = ROOT / "examples" / "first_digit" / "config.toml"
# the learning example, with little training per step and generation allowed far ahead of it
OVERRIDES = ("trainer.prompts_per_step=4", "rollout.group_size=4", "rollout.concurrency=8",
             "trainer.micro_batch_size=16", "trainer.eval_every=0", "staleness.max_staleness=4",
             "logging.live=false", "logging.trace=false", "run.save_checkpoint=false", "run.save_every_s=0",
             "cluster.torch_threads=1")


KEYS = ("generator/rss_mb", "scorer/rss_mb", "trainer/rss_mb", "buffer/rss_mb", "controller/rss_mb")


def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, times 1000."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--warmup", type=float, default=0.5, help="share of the steps left out of the slopes")
    ap.add_argument("--local", action="store_true", help="in-process deployment instead of Ray")
    ap.add_argument("--target", type=float, default=1.0, help="MiB per 1000 steps")
    args = ap.parse_args(argv)

    from asyncrl.config import load_config
    from asyncrl.deploy.launch import run_with_ray
    from asyncrl.deploy.local import run_local

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(EXAMPLE, [*OVERRIDES, f"trainer.total_steps={args.steps}",
                                    f"run.log_every={max(1, args.steps // 10)}",
                                    f'model.path="{Path(tmp) / "model"}"', f'run.output_dir="{Path(tmp) / "run"}"'])
        t0 = time.time()
        rows = (run_local if args.local else run_with_ray)(cfg)
        wall = time.time() - t0

    rows = [r for r in rows if "trainer/samples" in r]
    start = int(len(rows) * args.warmup)
    steady = rows[start:]
    slopes: dict[str, float] = {}
    print(f"{len(rows)} steps in {wall:.0f} s; MiB at the first step, at step {start} and at the last; "
          f"slope after step {start}, MiB per 1000 steps:")
    for key in KEYS:
        pts = [(r["step"], r[key]) for r in steady if r.get(key) is not None]
        if len(pts) > 2:
            slopes[key] = slope_per_1000([p[0] for p in pts], [p[1] for p in pts])
            first = next((r[key] for r in rows if r.get(key) is not None), float("nan"))
            print(f"  {key:18s} {first:8.1f} {pts[0][1]:8.1f} {pts[-1][1]:8.1f}   slope {slopes[key]:+.3f}")
    worst = max(slopes.values(), default=float("nan"))
    result = {"benchmark": "soak", "value": round(worst, 4), "unit": "MiB per 1000 steps (largest slope)",
              "baseline": 0.0, "ratio": round(worst / args.target, 4), "target": args.target}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
