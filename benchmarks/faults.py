"""Faults benchmark: one run of the learning example on Ray with generators, scorers and the trainer killed
(SIGKILL) at fixed steps, against a clean run of the same config.

    python benchmarks/faults.py                 # examples/first_digit/config.toml, 60 steps, twice
    python benchmarks/faults.py --steps 20      # shorter (the kills are spread over the steps run)
    python benchmarks/faults.py --quick         # tiny smoke run (used by the test); says nothing about overhead

The faulted run kills generator 0 five times, scorer 0 three times and the trainer once, each when the
metrics row of a chosen step is written (the steps are spread evenly over the run, so the schedule is
deterministic in steps; where in the step pipeline a kill lands is not). Supervision (docs/checkpoints.md,
Supervision) restarts each generator and scorer (`cluster.max_restarts` is raised to the number of kills);
the trainer's death makes `run_with_ray` start the roles afresh and resume from the newest checkpoint
(`run.save_every` = 5 in both runs, `run.max_resumes` = 1), so the steps after that checkpoint are trained
again.

Printed: trajectories generated (groups admitted x group size), trained (groups consumed x group size),
groups released as failed (of them, abandoned by a dead actor), accepted groups lost (accepted but neither
trained nor still stored at the end, plus groups the ledger lists twice: the target is 0), restarts and
resumes, steps trained again after the resume, and the wall time of both runs. `--png FILE` (default
faults.png in the runs' temporary folder) draws the reward curve of both runs. The last line is the result
JSON: value = accepted groups lost, baseline = 0 (the target), ratio = the faulted run's wall time over the
clean run's (the overhead of the faults).
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
TRAINER_KILLS = 1
SAVE_EVERY = 5


def schedule(steps: int) -> list[tuple[int, str]]:
    """(step after which to kill, role): 5 generator, 3 scorer and 1 trainer kill, spread evenly over steps
    1..steps-1; the trainer's in the middle."""
    kills = ["generator"] * GENERATOR_KILLS + ["scorer"] * SCORER_KILLS + ["trainer"] * TRAINER_KILLS
    order = [kills[i] for i in (0, 5, 1, 2, 8, 6, 3, 4, 7)]  # interleaved: generator, scorer, ..., trainer
    n = len(order)
    return [(max(1, round((i + 1) * (steps - 1) / (n + 1))), role) for i, role in enumerate(order)]


class Faults:
    """Kills the scheduled actors from beside each attempt of `run_with_ray` (a resume is a new attempt, with
    a new Controller and new actors); counts the restarts of every attempt and the resumes."""

    def __init__(self, kills: list[tuple[int, str]]) -> None:
        self.pending = list(kills)
        self.attempts = 0
        self.restarts = 0
        self.redone = 0  # steps trained again after a resume
        self._killed_at = 0

    async def __call__(self, controller, deployment) -> None:
        self.attempts += 1
        if self.attempts > 1:  # a resume: the steps after its checkpoint are trained again
            await controller.ready.wait()
            self.redone += self._killed_at - controller.first_step
        try:
            while self.pending:
                step, role = self.pending[0]
                done = max((r["step"] for r in controller.rows if "trainer/samples" in r), default=0)
                if done < step:
                    await asyncio.sleep(0.05)
                    continue
                self.pending.pop(0)
                actor = {"generator": lambda: deployment.generator_actors[0],
                         "scorer": lambda: deployment.scorer_actors[0],
                         "trainer": lambda: deployment.trainer_actor}[role]()
                try:
                    os.kill(await actor.pid.remote(), signal.SIGKILL)
                    print(f"  killed {role} after step {done}", flush=True)
                except Exception as exc:  # the previous restart still in progress: the kill moves on a step
                    print(f"  {role} not reachable after step {done} ({type(exc).__name__}), retrying",
                          flush=True)
                    self.pending.insert(0, (done + 1, role))
                    continue
                if role == "trainer":
                    self._killed_at = done
                    return  # this attempt ends; the next one resumes from the checkpoint
            await asyncio.Event().wait()
        finally:
            self.restarts += controller.supervisor.restarts


def run(cfg, kills: list[tuple[int, str]]) -> tuple[list[dict], float, Faults]:
    """Run `cfg` on Ray, killing the scheduled actors; returns (metrics rows, wall seconds, the faults)."""
    from asyncrl.launch import run_with_ray

    faults = Faults(kills)
    t0 = time.time()
    rows = run_with_ray(cfg, beside=faults)
    wall = time.time() - t0
    trained = [r for r in rows if "trainer/samples" in r]
    if len(trained) != cfg.trainer.total_steps:
        raise RuntimeError(f"{len(trained)} of {cfg.trainer.total_steps} steps trained")
    if faults.pending:
        raise RuntimeError(f"kills not made: {faults.pending}")
    return rows, wall, faults


def lost_groups(rows: list[dict], run_dir: Path) -> int:
    """Accepted groups neither trained nor stored at the end, plus groups the ledger lists more than once."""
    last = [r for r in rows if "trainer/samples" in r][-1]
    unaccounted = last["buffer/accepted"] - last["buffer/consumed"] - last["buffer/train_depth"]
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    ids = [g[0] for r in ledger for g in r["groups"]]
    return int(unaccounted) + len(ids) - len(set(ids))


def plot_rewards(clean: list[dict], faulted: list[dict], out: Path) -> Path | None:
    """The training reward per step of both runs in one PNG; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reward curves             (matplotlib not installed: pip install -e .[plot])")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for rows, label in ((clean, "clean"), (faulted, "faulted (9 kills)")):
        points = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--steps", type=int, default=None, help="train steps (default: the config's)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 12 steps of a tiny model")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (key=value)")
    ap.add_argument("--png", type=Path, default=None, help="reward curves of both runs (default: in the runs' folder)")
    args = ap.parse_args(argv)

    import ray

    from asyncrl.config import load_config
    from asyncrl.launch import start_ray

    root = Path(tempfile.mkdtemp(prefix="faults-"))
    sets = ["trainer.eval_every=0", "run.save_checkpoint=false", "logging.live=false",
            f"cluster.max_restarts={GENERATOR_KILLS + SCORER_KILLS}", f"run.max_resumes={TRAINER_KILLS}",
            f"run.save_every={SAVE_EVERY}", "cluster.num_cpus=4",
            'cluster.scorer_placement="actor"', *args.set]  # scorer actors to kill (by default: in the buffer)
    if args.quick:
        sets += ["trainer.prompts_per_step=4", "rollout.group_size=4", "rollout.concurrency=4",
                 "weight_sync.timeout_s=30", "trainer.micro_batch_size=16", "model.build_tiny.hidden_size=32",
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
        clean_rows, clean_s, _ = run(clean_cfg, [])
        print(f"faulted run: {steps} steps, kills after steps {kills}", flush=True)
        rows, faulted_s, faults = run(config("faulted"), kills)
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
    print(f"restarts                  {faults.restarts} of {GENERATOR_KILLS + SCORER_KILLS} generator and "
          f"scorer kills")
    print(f"resumes                   {faults.attempts - 1} of {TRAINER_KILLS} trainer kill(s), "
          f"{faults.redone} step(s) trained again")
    print(f"accepted groups lost      {lost} (target 0)")
    print(f"wall time                 clean {clean_s:.1f}s, faulted {faulted_s:.1f}s "
          f"(overhead {faulted_s / clean_s - 1:+.1%})")
    png = plot_rewards(clean_rows, rows, args.png or root / "faults.png")
    if png is not None:
        print(f"reward curves             {png}")
    result = {"benchmark": "faults", "value": lost, "unit": "groups", "baseline": 0,
              "ratio": round(faulted_s / clean_s, 3), "target": 0}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["value"] == 0 else 1)
