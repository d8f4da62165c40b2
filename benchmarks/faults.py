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

Graded by ids, not by the buffer's counters. A group id is the index of its prompt in the prompt stream, and
RUN_DIR/admissions.jsonl records every id the gate handed out in every attempt, the killed one included,
with what became of it (accepted, or released with its reason and why; docs/checkpoints.md). Against the final
RUN_DIR/ledger.jsonl every drawn id must be trained exactly once, or released with a cause (a dead actor's
groups: "failed: generator/0 died"), or still in flight when the run ended (neither, and after every trained
id). A resume undoes what its checkpoint had not settled: those ids must be drawn again by a later attempt
(the same ids, so the same prompts) and end as above; the groups the killed attempt accepted after its last
checkpoint and that were trained once after the resume are counted as regenerated. A violation is an id
trained twice, trained but released, never drawn or never accepted, released without a cause, neither trained
nor released before the last trained id, or skipped by the prompt stream (`grade`,
tests/unit/test_faults_grading.py).

Printed: trajectories generated and trained, restarts, resumes and the steps trained again, then the faulted
run's ids: drawn, trained once, released by cause, regenerated after the resume, in flight at the end and
violations (the clean run's on one line), and both wall times. `--png FILE` (default faults.png in the runs'
temporary folder) draws the reward curve of both runs. The last line is the result JSON: value = violations
(both runs; target 0), ratio = the faulted run's wall time over the clean run's (the overhead of the faults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.telemetry.admissions import ADMISSIONS, Attempt, read_attempts

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
    from asyncrl.deploy.launch import run_with_ray

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


UNDONE, RUNNING, ACCEPTED = "undone", "running", "accepted"  # an id's fate, or (reason, why) once released


@dataclass
class Grade:
    """Every group id drawn from the prompt stream (RUN_DIR/admissions.jsonl, every attempt) against the final
    RUN_DIR/ledger.jsonl. `value` counts the ids that break the rule: trained exactly once, or released with its
    cause, or still in flight when the run ended (after every trained id)."""

    admitted: int = 0  # distinct ids drawn, every attempt
    attempts: int = 0
    trained_once: int = 0
    failed: Counter = field(default_factory=Counter)  # released with a cause: "reason: why" -> ids
    unfinished: int = 0  # neither trained nor released, after the last trained id: in flight at the end
    undone: int = 0  # accepted by an attempt after the checkpoint that the next attempt resumed from
    regenerated: int = 0  # of those, drawn again after the resume and trained once
    violations: Counter = field(default_factory=Counter)  # kind -> ids
    examples: dict = field(default_factory=dict)  # kind -> the first few ids

    @property
    def value(self) -> int:
        return sum(self.violations.values())

    def violate(self, kind: str, gid: int) -> None:
        self.violations[kind] += 1
        self.examples.setdefault(kind, [])
        if len(self.examples[kind]) < 5:
            self.examples[kind].append(gid)


def fates(attempts: list[Attempt]) -> tuple[dict[int, object], set[int], set[int]]:
    """Each id's fate after the last attempt: RUNNING, ACCEPTED, (reason, why) when released, or UNDONE (a resume
    went back to before it was settled, and no later attempt drew it again). Also the ids a resume undid after
    they were accepted, and the ids drawn again after a resume undid them."""
    fate: dict[int, object] = {}
    undone_accepted: set[int] = set()
    redrawn: set[int] = set()
    for i, a in enumerate(attempts):
        if i:  # a resume: what its checkpoint had not settled (running then, or drawn after it) is undone
            regenerate = set(a.regenerate)
            for gid, f in fate.items():
                if gid in regenerate or gid >= a.next_id:
                    if f == ACCEPTED:
                        undone_accepted.add(gid)
                    fate[gid] = UNDONE
            fate.update(dict.fromkeys(a.stored, ACCEPTED))
        for gid in a.admitted:  # within one attempt an id is admitted once, before it is accepted or released
            if fate.get(gid) == UNDONE:
                redrawn.add(gid)
            fate[gid] = RUNNING
        fate.update(dict.fromkeys(a.accepted, ACCEPTED))
        fate.update({gid: (reason, why) for gid, reason, why in a.released})
    return fate, undone_accepted, redrawn


def grade(attempts: list[Attempt], ledger: list[dict]) -> Grade:
    """Grade the ids of `attempts` (read_attempts of admissions.jsonl) against `ledger` (ledger.jsonl's rows)."""
    fate, undone_accepted, redrawn = fates(attempts)
    trained = Counter(g[0] for row in ledger for g in row["groups"])
    last_trained = max(trained, default=-1)
    g = Grade(admitted=len(fate), attempts=len(attempts), undone=len(undone_accepted))
    for gid in sorted(set(fate) | set(trained)):
        n, f = trained[gid], fate.get(gid)
        if f is None:
            g.violate("trained, never drawn", gid)
        elif n > 1:
            g.violate("trained more than once", gid)
        elif n == 1 and f != ACCEPTED:
            g.violate("trained and released" if isinstance(f, tuple) else "trained, not accepted on record", gid)
        elif n == 1:
            g.trained_once += 1
            g.regenerated += gid in undone_accepted and gid in redrawn
        elif isinstance(f, tuple) and f[1].strip():
            g.failed[f"{f[0]}: {re.sub(r'#[0-9]+', '', f[1])}"] += 1  # "generator/0#2 died": any incarnation
        elif isinstance(f, tuple):
            g.violate("released without a cause", gid)
        elif gid > last_trained:
            g.unfinished += 1
        else:
            g.violate("neither trained nor released", gid)
    for gid in sorted(set(range(max(fate, default=-1) + 1)) - set(fate)):
        g.violate("skipped by the prompt stream", gid)
    return g


def grade_run(run_dir: Path) -> Grade:
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    return grade(read_attempts(run_dir / ADMISSIONS), ledger)


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


def measure(argv: list[str] | None = None) -> tuple[dict, Grade]:
    """Run the clean and the faulted run, print the figures; returns the result JSON and the faulted run's
    grade."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--steps", type=int, default=None, help="train steps (default: the config's)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run: 12 steps of a tiny model")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (key=value)")
    ap.add_argument("--png", type=Path, default=None, help="reward curves of both runs (default: in the runs' folder)")
    args = ap.parse_args(argv)

    import ray

    from asyncrl.config import load_config
    from asyncrl.deploy.launch import start_ray

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
    clean, graded = grade_run(root / "clean"), grade_run(root / "faulted")
    print(f"trajectories generated    {int(last['buffer/admitted']) * group_size}")
    print(f"trajectories trained      {int(last['buffer/consumed']) * group_size}")
    print(f"restarts                  {faults.restarts} of {GENERATOR_KILLS + SCORER_KILLS} generator and "
          f"scorer kills")
    print(f"resumes                   {faults.attempts - 1} of {TRAINER_KILLS} trainer kill(s), "
          f"{faults.redone} step(s) trained again")
    print_grade(graded)
    print(f"clean run                 {clean.admitted} prompts drawn, {clean.trained_once} trained once, "
          f"{sum(clean.failed.values())} released, {clean.unfinished} in flight at the end, "
          f"{clean.value} violations")
    print(f"wall time                 clean {clean_s:.1f}s, faulted {faulted_s:.1f}s "
          f"(overhead {faulted_s / clean_s - 1:+.1%})")
    png = plot_rewards(clean_rows, rows, args.png or root / "faults.png")
    if png is not None:
        print(f"reward curves             {png}")
    result = {"benchmark": "faults", "value": graded.value + clean.value, "unit": "groups", "baseline": 0,
              "ratio": round(faulted_s / clean_s, 3), "target": 0}
    print(json.dumps(result))
    return result, graded


def print_grade(g: Grade) -> None:
    """The faulted run's ids, graded (`grade`)."""
    print(f"prompts drawn (ids)       {g.admitted} over {g.attempts} attempt(s)")
    print(f"trained exactly once      {g.trained_once}")
    print(f"released with a cause     {sum(g.failed.values())}: "
          + (", ".join(f"{n} {cause}" for cause, n in g.failed.most_common()) or "none"))
    print(f"regenerated after resume  {g.regenerated} of the {g.undone} groups the killed attempt accepted after "
          f"its last checkpoint, drawn again and trained once")
    print(f"in flight at the end      {g.unfinished} (after the last trained id: the run had ended)")
    kinds = "; ".join(f"{n} {kind} (e.g. {g.examples[kind]})" for kind, n in g.violations.items())
    print(f"violations                {g.value} (target 0){': ' + kinds if kinds else ''}")


def main(argv: list[str] | None = None) -> dict:
    """Both runs, graded; returns the result JSON (also printed, last)."""
    return measure(argv)[0]


if __name__ == "__main__":
    sys.exit(0 if main()["value"] == 0 else 1)
