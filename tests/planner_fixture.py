"""Score the planner against finished runs, and keep such runs as compact fixtures.

Place in the dataflow: two finished run directories (a calibration run and a run of another setting) ──►
`prediction_error` (calibrate on the first, predict the second's setting for its length, compare with
its measured throughput) ──► the planner's accuracy tests and benchmarks/README.md's figures.
`write_fixture` copies a run directory down to what the planner reads (config.toml, placement.json, the
metrics the throughput and the processes' CPU are read from, the trace's spans of the kinds `calibrate`
uses), so real runs can be checked in under tests/fixtures and re-scored without Ray.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from asyncrl.config import read_run_config
from asyncrl.planning.planner import Costs, Setting, calibrate, measured_throughput, steady_throughput
from asyncrl.telemetry.trace import read_trace

WARMUP = 3  # first train steps of a measured run left out (first-call allocations: no term in the model)
# what `calibrate` and `measured_throughput` read; everything else in a run directory is left out
FIXTURE_METRICS = ("step", "version", "time/step_s", "time/elapsed_s", "reward/mean", "trainer/samples",
                   "trainer/tokens", "staleness/mean", "generator/cpu_cores", "buffer/cpu_cores",
                   "controller/cpu_cores")
FIXTURE_SPANS = frozenset({"generate", "score", "train", "weights_send", "weights_swap", "wait_gate", "eval"})


def prediction_error(calibration: str | Path | Costs, run: str | Path, *, cores: float = 2.0,
                     warmup: int = WARMUP) -> float:
    """(predicted − measured) / measured trained samples/s of `run`'s setting, calibrated on `calibration`
    (a run directory, or the Costs calibrated from one).

    Measured: `run` without its first `warmup` steps; predicted likewise (`steady_throughput`)."""
    run = Path(run)
    costs = calibration if isinstance(calibration, Costs) else calibrate(calibration, cores=cores)
    cfg = read_run_config(run)
    steps = sum(1 for line in (run / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in line)
    if steps <= warmup:
        raise ValueError(f"{run}: {steps} train steps, not more than the {warmup} left out as warm-up")
    setting = Setting(cfg.rollout.num_generators, cfg.staleness.max_staleness)
    predicted = steady_throughput(costs, setting, steps, warmup)
    measured = measured_throughput(run, skip=warmup)
    if not measured:
        raise ValueError(f"{run}: no measured throughput")
    return (predicted - measured) / measured


def write_fixture(run: str | Path, out: str | Path) -> Path:
    """Copy the run directory `run` into `out` with only what the planner reads: config.toml, placement.json
    (where the run has one), the metrics rows' FIXTURE_METRICS keys, and the trace's FIXTURE_SPANS spans (times
    rounded to the microsecond)."""
    run, out = Path(run), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "config.toml", out / "config.toml")
    if (run / "placement.json").exists():  # which cores each role was pinned to (a Ray run's)
        shutil.copyfile(run / "placement.json", out / "placement.json")
    with (run / "metrics.jsonl").open() as src, (out / "metrics.jsonl").open("w") as dst:
        for line in src:
            if line.strip():
                row = json.loads(line)
                dst.write(json.dumps({k: row[k] for k in FIXTURE_METRICS if k in row}) + "\n")
    events = [e for e in read_trace(run / "trace.json") if e.get("ph") == "M" or e.get("name") in FIXTURE_SPANS]
    for e in events:
        if e.get("ph") == "X":
            e["ts"], e["dur"] = round(float(e["ts"])), round(float(e["dur"]))  # microseconds
    (out / "trace.json").write_text("[\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
                                    + "\n]\n")
    return out
