"""Faults benchmark: one run of the learning example on Ray with generators and scorers killed (SIGKILL) at
fixed steps, against a clean run of the same config.

    python benchmarks/faults.py                 # examples/first_digit/config.toml, 60 steps, twice
    python benchmarks/faults.py --steps 20      # shorter (the kills are spread over the steps run)
    python benchmarks/faults.py --quick         # tiny smoke run (used by the test); says nothing about overhead

The faulted run kills generator 0 five times and scorer 0 three times, each when the metrics row of a chosen
step is written (the steps are spread evenly over the run, so the schedule is deterministic in steps; where in
the step pipeline a kill lands is not). Supervision (docs/checkpoints.md, Supervision) restarts each one
(`cluster.max_restarts` is raised to the number of kills).

Printed: trajectories generated (groups admitted x group size), trained (groups consumed x group size),
groups released as failed (of them, abandoned by a dead actor), accepted groups lost (accepted but neither
trained nor still stored at the end, plus groups the ledger lists twice: the target is 0), restarts, and the
wall time of both runs. The last line is the result JSON: value = accepted groups lost, baseline = 0 (the
target), ratio = the faulted run's wall time over the clean run's (the overhead of the faults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "first_digit" / "config.toml"
GENERATOR_KILLS = 5
SCORER_KILLS = 3


def schedule(steps: int) -> list[tuple[int, str]]:
    """(step after which to kill, role) for 5 generator and 3 scorer kills, spread evenly over steps 1..steps-1."""
    kills = ["generator"] * GENERATOR_KILLS + ["scorer"] * SCORER_KILLS
    order = [kills[i] for i in (0, 5, 1, 2, 6, 3, 4, 7)]  # interleaved: generator, scorer, generator, ...
    n = len(order)
    return [(max(1, round((i + 1) * (steps - 1) / (n + 1))), role) for i, role in enumerate(order)]


def run(cfg, kills: list[tuple[int, str]]) -> tuple[list[dict], float]:
    """Run `cfg` on Ray, killing the scheduled actors; returns (metrics rows, wall seconds)."""
    from asyncrl.controller import Controller
    from asyncrl.launch import RayDeployment

    deployment = RayDeployment(cfg)
    deployment.wait_ready()
    controller = Controller(cfg, deployment)

    async def main() -> list[dict]:
        task = asyncio.create_task(controller.run())
        pending = list(kills)
        while pending and not task.done():
            step, role = pending[0]
            if sum("trainer/samples" in r for r in controller.rows) >= step:
                pending.pop(0)
                actor = deployment.generator_actors[0] if role == "generator" else deployment.scorer_actors[0]
                try:
                    os.kill(await actor.pid.remote(), signal.SIGKILL)
                    print(f"  killed {role} 0 after step {step}", flush=True)
                except Exception as exc:  # the previous restart still in progress: the kill moves on a step
                    print(f"  {role} 0 not reachable after step {step} ({type(exc).__name__}), retrying",
                          flush=True)
                    pending.insert(0, (step + 1, role))
                continue
            await asyncio.sleep(0.05)
        return await task

    t0 = time.time()
    rows = asyncio.run(main())
    wall = time.time() - t0
    trained = [r for r in rows if "trainer/samples" in r]
    if len(trained) != cfg.trainer.total_steps:
        raise RuntimeError(f"{len(trained)} of {cfg.trainer.total_steps} steps trained")
    return rows, wall


def lost_groups(rows: list[dict], run_dir: Path) -> int:
    """Accepted groups neither trained nor stored at the end, plus groups the ledger lists more than once."""
    last = [r for r in rows if "trainer/samples" in r][-1]
    unaccounted = last["buffer/accepted"] - last["buffer/consumed"] - last["buffer/train_depth"]
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    ids = [g[0] for r in ledger for g in r["groups"]]
    return int(unaccounted) + len(ids) - len(set(ids))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--steps", type=int, default=None, help="train steps (default: the config's)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 12 steps of a tiny model")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (key=value)")
    args = ap.parse_args(argv)

    import ray

    from asyncrl.config import load_config
    from asyncrl.launch import start_ray

    root = Path(tempfile.mkdtemp(prefix="faults-"))
    sets = ["trainer.eval_every=0", "run.save_checkpoint=false", "logging.live=false",
            f"cluster.max_restarts={GENERATOR_KILLS + SCORER_KILLS}", "cluster.num_cpus=4", *args.set]
    if args.quick:
        sets += ["trainer.prompts_per_step=4", "rollout.group_size=4", "rollout.concurrency=4",
                 "trainer.micro_batch_size=16", "model.build_tiny.hidden_size=32",
                 "model.build_tiny.intermediate_size=64", f'model.path="{root / "tiny-model"}"']
    steps = args.steps or (12 if args.quick else None)
    if steps:
        sets.append(f"trainer.total_steps={steps}")

    def config(name: str):
        return load_config(args.config, [*sets, f'run.output_dir="{root / name}"'])

    clean_cfg = config("clean")
    steps = clean_cfg.trainer.total_steps
    kills = schedule(steps)
    from engines.hf import ensure_model

    ensure_model(clean_cfg.model)
    started = start_ray(clean_cfg)
    try:
        print(f"clean run: {steps} steps", flush=True)
        _, clean_s = run(clean_cfg, [])
        print(f"faulted run: {steps} steps, kills after steps {kills}", flush=True)
        rows, faulted_s = run(config("faulted"), kills)
    finally:
        if started:
            ray.shutdown()
    group_size = clean_cfg.rollout.group_size
    last = [r for r in rows if "trainer/samples" in r][-1]
    lost = lost_groups(rows, root / "faulted")
    print(f"trajectories generated    {int(last['buffer/admitted']) * group_size}")
    print(f"trajectories trained      {int(last['buffer/consumed']) * group_size}")
    print(f"groups released (failed)  {int(last['buffer/failed'])} (abandoned by a dead actor: "
          f"{int(last['buffer/abandoned'])})")
    print(f"restarts                  {int(last['supervisor/restarts'])} of {len(kills)} kills")
    print(f"accepted groups lost      {lost} (target 0)")
    print(f"wall time                 clean {clean_s:.1f}s, faulted {faulted_s:.1f}s "
          f"(overhead {faulted_s / clean_s - 1:+.1%})")
    result = {"benchmark": "faults", "value": lost, "unit": "groups", "baseline": 0,
              "ratio": round(faulted_s / clean_s, 3), "target": 0}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["value"] == 0 else 1)
