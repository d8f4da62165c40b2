"""Planner validation: calibrate on one setting, predict the others, run them all, report the errors.

    python benchmarks/planner_validation.py                      # first_digit example, 8 settings, --local
    python benchmarks/planner_validation.py --steps 30 --ray     # other lengths, on Ray
    python benchmarks/planner_validation.py --reuse DIR          # re-score a finished sweep, no runs
                                                                 # (add --ray if it ran on Ray)
    python benchmarks/planner_validation.py --rounds 1 --steps 80  # one round of longer runs

Issue 7's goal: predicted throughput within 15% of measured on settings not used for calibration, and the
recommended setting's measured throughput within 5% of the best measured.

Steps: (1) `asyncrl sweep` over --generators x --max-staleness (one `asyncrl launch` per point), into
--out/round-<i> for each of --rounds rounds of the whole grid (into --out itself with one round);
(2) `calibrate` from the first round's run of the --calibrate setting only (default the on-policy run,
1 generator, k = 0: the one setting where every phase runs alone, so its spans are uncontended costs; in
process, `shared_interpreter` models the one interpreter lock the roles share); (3) `plan` every setting
for the same number of steps; (4) per setting |predicted - measured| / measured, measured over all its
rounds pooled, each run without its first --warmup steps, and the recommendation against the measured
best; the round-to-round spread of one setting is the machine's own noise. Evaluation is off
(`trainer.eval_every = 0`) so steps measure training, not held-out evaluation. The last line is the
benchmark JSON: value = share of held-out settings within 15%.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import msgspec

from asyncrl.planning.planner import Setting, calibrate, measure_cpu_shares, plan, recommend
from asyncrl.sweep import SweepPoint, load_sweep, parse_axes, run_sweep
from asyncrl.telemetry.metrics import read_metrics
from asyncrl.telemetry.summary import summarize_rows, train_rows

TOLERANCE = 0.15
RECOMMEND_TOLERANCE = 0.05


def setting_of(point: SweepPoint) -> Setting:
    return Setting(int(point.values["rollout.num_generators"]), int(point.values["staleness.max_staleness"]))


def sweep_dirs(root: Path) -> list[Path]:
    """The sweeps of a validation directory: itself (one round) or its round-<i> folders, in order."""
    if (root / "sweep.json").exists():
        return [root]
    rounds = sorted(root.glob("round-*/sweep.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not rounds:
        raise SystemExit(f"{root}: no sweep.json, nor round-<i>/sweep.json: not a validation sweep")
    return [p.parent for p in rounds]


def pooled_throughput(run_dirs: list[Path], skip: int) -> float:
    """Trained samples/s over every run of one setting together, each without its first `skip` steps."""
    rows = []
    for run_dir in run_dirs:
        steps = train_rows(read_metrics(run_dir / "metrics.jsonl"))
        if skip >= len(steps):
            raise SystemExit(f"{run_dir}: cannot leave out {skip} of its {len(steps)} train steps (--warmup)")
        rows += steps[skip:]
    return summarize_rows(rows)["throughput/samples_per_s"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/first_digit/config.toml")
    ap.add_argument("--generators", default="1,2")
    ap.add_argument("--max-staleness", default="0,1,2,4")
    ap.add_argument("--calibrate", default="1,0", help="GENERATORS,MAX_STALENESS of the calibration run "
                    "(default on-policy: every phase runs alone, so its spans measure uncontended costs)")
    ap.add_argument("--steps", type=int, default=40, help="train steps per setting and round")
    ap.add_argument("--rounds", type=int, default=2, help="run the whole grid this many times, one round "
                    "after the other, and pool each setting's rounds: a change of the machine's load then "
                    "hits every setting alike instead of whichever ran at the time")
    ap.add_argument("--warmup", type=int, default=3, help="first train steps of each run left out of the "
                    "measured throughput")
    ap.add_argument("--out", default="runs/planner-validation")
    ap.add_argument("--ray", action="store_true", help="run the points on Ray (default: --local; with "
                    "--reuse: the sweep ran on Ray)")
    ap.add_argument("--reuse", default=None, help="a finished validation sweep directory: score it again")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra config override")
    ap.add_argument("--cpu-shares", action="store_true", help="count each phase by its measured process CPU "
                    "share (experimental, see asyncrl.planning.planner.calibrate)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps <= args.warmup:
        raise SystemExit("--rounds must be >= 1 and --steps greater than --warmup")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.reuse:
        dirs = sweep_dirs(Path(args.reuse))
        rounds = [load_sweep(d) for d in dirs]
    else:
        root = Path(args.out)
        dirs = [root] if args.rounds == 1 else [root / f"round-{i}" for i in range(1, args.rounds + 1)]
        axes = parse_axes([f"rollout.num_generators={args.generators}",
                           f"staleness.max_staleness={args.max_staleness}"])
        extra = [f"trainer.total_steps={args.steps}", "trainer.eval_every=0", "run.save_checkpoint=false",
                 "run.save_every_s=0", *args.extra]
        rounds = []
        for i, d in enumerate(dirs, 1):
            logging.info("round %d/%d into %s", i, len(dirs), d)
            rounds.append(run_sweep(args.config, axes, d, ray=args.ray, extra=extra))
    g, k = (int(x) for x in args.calibrate.split(","))
    calib = next((p for p in rounds[0] if setting_of(p) == Setting(g, k)), None)
    if calib is None or calib.status != "ok":
        raise SystemExit(f"calibration point generators={g}, max_staleness={k} is missing or failed")
    # calibration: the first round's run of the calibration setting, nothing else
    costs = calibrate(dirs[0] / calib.name, shared_interpreter=not args.ray, cpu_shares=args.cpu_shares)
    shares = None if args.ray else measure_cpu_shares(dirs[0] / calib.name)
    ok_names = set.intersection(*[{p.name for p in r if p.status == "ok"} for r in rounds])
    ok = [p for p in rounds[0] if p.name in ok_names]
    per_round = {p.name: [pooled_throughput([d / p.name], args.warmup) for d in dirs] for p in ok}
    measured = {p.name: pooled_throughput([d / p.name for d in dirs], args.warmup) for p in ok}
    preds = {p.setting: p for p in plan(costs, sorted({setting_of(p).num_generators for p in ok}),
                                        sorted({setting_of(p).max_staleness for p in ok}), costs.steps)}
    print(f"calibrated on generators={g}, max_staleness={k} ({dirs[0] / calib.name})")
    print("costs:", json.dumps({f: round(v, 5) if isinstance(v, float) else
                                (f"{len(v)} factors, mean {sum(v) / len(v):.3f}" if isinstance(v, list) and v else v)
                                for f, v in msgspec.to_builtins(costs).items()}))
    if shares is not None:
        starved = ("  <- well below 1: other jobs starved it, and the costs carry that load"
                   if min(shares) < 0.9 else "")
        print(f"calibration run's process CPU per wall second: gate wait {shares[0]:.2f}, train {shares[1]:.2f}"
              f"{starved}")
    print()
    print(f"measured = trained samples/s of {len(dirs)} round(s) pooled, each run without its first "
          f"{args.warmup} steps")
    print("| generators | max_staleness | measured samples/s | per round | predicted (sim) | error | closed form | "
          "error | staleness mean meas / pred | held out |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for p in ok:
        s = setting_of(p)
        meas = measured[p.name]
        pred = preds[s]
        err = (pred.samples_per_s - meas) / meas
        cf_err = (pred.closed_form_samples_per_s - meas) / meas
        held_out = s != Setting(g, k)
        if held_out:
            errors.append(abs(err))
        print(f"| {s.num_generators} | {s.max_staleness} | {meas:.1f} | "
              f"{' / '.join(f'{x:.0f}' for x in per_round[p.name])} | "
              f"{pred.samples_per_s:.1f} | {err:+.1%} | {pred.closed_form_samples_per_s:.1f} | {cf_err:+.1%} | "
              f"{p.summary.get('staleness_mean', 0.0):.2f} / {pred.staleness_mean:.2f} | "
              f"{'yes' if held_out else 'calibration'} |")
    best = max(ok, key=lambda p: measured[p.name])
    rec = recommend(list(preds.values()))
    rec_point = next(p for p in ok if setting_of(p) == rec.setting)
    rec_share = measured[rec_point.name] / measured[best.name]
    within = sum(e <= TOLERANCE for e in errors) / max(1, len(errors))
    # the machine's own noise: how much one setting's rounds differ (a floor under any prediction error)
    spread = max((max(v) / min(v) - 1.0 for v in per_round.values()), default=0.0) if len(dirs) > 1 else None
    print()
    print(f"held-out settings within {TOLERANCE:.0%}: {within:.0%} "
          f"(mean |error| {sum(errors) / max(1, len(errors)):.1%}, max {max(errors, default=0.0):.1%})")
    print(f"recommended {rec.setting.num_generators} generator(s), max_staleness {rec.setting.max_staleness}: measured "
          f"{measured[rec_point.name]:.1f} samples/s = {rec_share:.1%} of the best measured "
          f"({best.name}, {measured[best.name]:.1f}); goal >= {1 - RECOMMEND_TOLERANCE:.0%}")
    if spread is not None:
        print(f"round-to-round spread of one setting's measurement: up to {spread:.1%} (the machine's own noise)")
    result = {"benchmark": "planner_validation", "value": round(within, 4),
              "unit": f"share of held-out settings predicted within {TOLERANCE:.0%}", "baseline": 1.0,
              "ratio": round(within, 4), "target": 1.0,
              "mean_abs_error": round(sum(errors) / max(1, len(errors)), 4),
              "recommended_share_of_best": round(rec_share, 4),
              "round_spread_max": None if spread is None else round(spread, 4),
              "calibration_cpu_shares": None if shares is None else [round(x, 3) for x in shares]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
