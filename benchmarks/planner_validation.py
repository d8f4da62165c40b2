"""Planner validation: calibrate on one setting, predict the others, run them all, report the errors.

    python benchmarks/planner_validation.py                      # first_digit example, 8 settings, --local
    python benchmarks/planner_validation.py --steps 30 --ray     # longer runs, on Ray
    python benchmarks/planner_validation.py --reuse DIR          # re-score a finished sweep, no runs

Issue 7's goal: predicted throughput within 15% of measured on settings not used for calibration, and the
recommended setting's measured throughput within 5% of the best measured.

Steps: (1) `asyncrl sweep` over --generators x --max-staleness (one `asyncrl launch` per point, into
--out); (2) `calibrate` from the --calibrate point's run directory only; (3) `plan` every setting for the
same number of steps; (4) per setting |predicted - measured| / measured, and the recommendation against
the measured best. Evaluation is off (`trainer.eval_every = 0`) so steps measure training, not held-out
evaluation. The last line is the benchmark JSON: value = share of held-out settings within 15%.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import msgspec

from asyncrl.planner import Setting, calibrate, plan, recommend
from asyncrl.sweep import SweepPoint, load_sweep, parse_axes, run_sweep

TOLERANCE = 0.15
RECOMMEND_TOLERANCE = 0.05


def setting_of(point: SweepPoint) -> Setting:
    return Setting(int(point.values["rollout.num_generators"]), int(point.values["staleness.max_staleness"]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/first_digit/config.toml")
    ap.add_argument("--generators", default="1,2")
    ap.add_argument("--max-staleness", default="0,1,2,4")
    ap.add_argument("--calibrate", default="1,1", help="GENERATORS,MAX_STALENESS of the calibration run "
                    "(asynchronous, so that CPU contention between the roles can be measured)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="runs/planner-validation")
    ap.add_argument("--ray", action="store_true", help="run the points on Ray (default: --local)")
    ap.add_argument("--reuse", default=None, help="a finished validation sweep directory: score it again")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra config override")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.reuse:
        sweep_dir = Path(args.reuse)
        points = load_sweep(sweep_dir)
    else:
        sweep_dir = Path(args.out)
        axes = parse_axes([f"rollout.num_generators={args.generators}", f"staleness.max_staleness={args.max_staleness}"])
        extra = [f"trainer.total_steps={args.steps}", "trainer.eval_every=0", "run.save_checkpoint=false",
                 *args.extra]
        points = run_sweep(args.config, axes, sweep_dir, ray=args.ray, extra=extra)
    g, k = (int(x) for x in args.calibrate.split(","))
    calib = next((p for p in points if setting_of(p) == Setting(g, k)), None)
    if calib is None or calib.status != "ok":
        raise SystemExit(f"calibration point generators={g}, max_staleness={k} is missing or failed")
    costs = calibrate(sweep_dir / calib.name)
    ok = [p for p in points if p.status == "ok" and "throughput/samples_per_s" in p.summary]
    preds = {p.setting: p for p in plan(costs, sorted({setting_of(p).num_generators for p in ok}),
                                        sorted({setting_of(p).max_staleness for p in ok}), costs.steps)}
    print(f"calibrated on generators={g}, max_staleness={k} ({sweep_dir / calib.name})")
    print("costs:", json.dumps({f: round(v, 5) if isinstance(v, float) else v
                                for f, v in msgspec.to_builtins(costs).items()}))
    print()
    print("| generators | max_staleness | measured samples/s | predicted (sim) | error | closed form | error | "
          "staleness mean meas / pred | held out |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for p in ok:
        s = setting_of(p)
        meas = p.summary["throughput/samples_per_s"]
        pred = preds[s]
        err = (pred.samples_per_s - meas) / meas
        cf_err = (pred.closed_form_samples_per_s - meas) / meas
        held_out = s != Setting(g, k)
        if held_out:
            errors.append(abs(err))
        print(f"| {s.num_generators} | {s.max_staleness} | {meas:.1f} | {pred.samples_per_s:.1f} | {err:+.1%} | "
              f"{pred.closed_form_samples_per_s:.1f} | {cf_err:+.1%} | "
              f"{p.summary.get('staleness_mean', 0.0):.2f} / {pred.staleness_mean:.2f} | {'yes' if held_out else 'calibration'} |")
    best = max(ok, key=lambda p: p.summary["throughput/samples_per_s"])
    rec = recommend(list(preds.values()))
    rec_point = next(p for p in ok if setting_of(p) == rec.setting)
    rec_share = rec_point.summary["throughput/samples_per_s"] / best.summary["throughput/samples_per_s"]
    within = sum(e <= TOLERANCE for e in errors) / max(1, len(errors))
    print()
    print(f"held-out settings within {TOLERANCE:.0%}: {within:.0%} (mean |error| {sum(errors) / max(1, len(errors)):.1%}, "
          f"max {max(errors, default=0.0):.1%})")
    print(f"recommended {rec.setting.num_generators} generator(s), max_staleness {rec.setting.max_staleness}: measured "
          f"{rec_point.summary['throughput/samples_per_s']:.1f} samples/s = {rec_share:.1%} of the best measured "
          f"({best.name}, {best.summary['throughput/samples_per_s']:.1f}); goal >= {1 - RECOMMEND_TOLERANCE:.0%}")
    result = {"benchmark": "planner_validation", "value": round(within, 4),
              "unit": f"share of held-out settings predicted within {TOLERANCE:.0%}", "baseline": 1.0,
              "ratio": round(within, 4), "target": 1.0}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
