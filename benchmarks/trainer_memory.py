"""The trainer's memory step after step: the Learner on replies of new lengths every step, with and without the
caps a role's process sets on its kernel caches (asyncrl/deploy/native_memory.py).

Place in the dataflow: none, this measures the Trainer role's `Learner.update` alone, as its process runs it in a
launch (RoleActor calls `bound_native_memory()` first thing). Each side is a fresh interpreter (the caps are the
process's, read once): `default` runs as a process does with nothing set, `bounded` calls `bound_native_memory()`
before it builds the model. Both build the same model (SmolLM2-135M's shape, random weights: benchmarks/train_step.py
"small") and train it on the same steps: 32 samples a step whose lengths are drawn anew every step, as a run's are.

    python benchmarks/trainer_memory.py                   # the long-tail example's trainer, 8 steps a side (~5 min)
    python benchmarks/trainer_memory.py --job readme      # the README job's trainer (examples/smollm_arith)
    python benchmarks/trainer_memory.py --steps 12
    python benchmarks/trainer_memory.py --quick           # smoke run: a 1-layer model, 2 steps (used by the test)

Jobs (the examples' trainer settings; prompt and reply lengths like theirs):

  long-tail   examples/smollm_reasoning: prompts of 60-96 tokens, replies log-normal around 55 tokens with 8% at
              the 256-token limit; token budget 2048 a micro-batch, the head fused in 256-token chunks, gradient
              checkpointing, bf16 autocast
  readme      examples/smollm_arith: prompts of 40-64 tokens, replies of 2-12; one micro-batch of 32, bf16 autocast

Figures per step (GiB): `peak`, the process's peak resident set during the step (VmHWM, reset before it), and
`rest`, its resident set after it. The weights, their gradients and AdamW's two moments (fp32 masters: 16 bytes a
parameter) are the issue's yardstick: the target is a peak of at most twice them. The JSON line: value = the bounded
side's largest peak from step 2 on (AdamW's state exists from the first optimizer step), baseline = the default
side's, ratio = baseline / value (how many times lower), target = 2 x (weights + gradients + AdamW) in GiB.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

JOBS: dict[str, dict[str, Any]] = {
    "long-tail": dict(prompt=(60, 96), reply="long-tail", trainer=dict(
        micro_batch_size=32, max_tokens_per_micro_batch=2048, logprob_chunk_tokens=256), checkpointing=True),
    "readme": dict(prompt=(40, 64), reply=(2, 12), trainer=dict(micro_batch_size=32), checkpointing=False),
}
SAMPLES, GROUP = 32, 8


def reply_length(rnd: random.Random, reply: Any) -> int:
    if reply == "long-tail":
        return 256 if rnd.random() < 0.08 else min(256, max(8, int(rnd.lognormvariate(4.0, 0.5))))
    return rnd.randint(*reply)


def step_groups(step: int, job: dict[str, Any], vocab: int, version: int) -> list:
    from asyncrl.messages import Group, Trajectory

    rnd = random.Random(step)
    trajs = []
    for i in range(SAMPLES):
        p, r = rnd.randint(*job["prompt"]), reply_length(rnd, job["reply"])
        trajs.append(Trajectory(
            seq_id=i, group_id=i // GROUP, group_size=GROUP, prompt_ids=[rnd.randint(1, vocab - 1) for _ in range(p)],
            response_ids=[rnd.randint(1, vocab - 1) for _ in range(r)], loss_mask=[True] * r,
            behavior_logprobs=[-10.8] * r, versions=[version] * r, min_version=version, max_version=version,
            finish_reason="stop", reward=float(rnd.random() > 0.5), temperature=1.0))
    return [Group(group_id=g, min_version=version, trajectories=trajs[g * GROUP : (g + 1) * GROUP])
            for g in range(SAMPLES // GROUP)]


def side(name: str, job_name: str, steps: int, quick: bool) -> None:
    """One side in this process: one JSON line per step."""
    if name == "bounded":
        from asyncrl.deploy.native_memory import bound_native_memory

        bound_native_memory()
    import torch

    torch.set_num_threads(2)
    from train_step import MODELS, PAD, build_model

    from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
    from asyncrl.telemetry.memory import host_peak_gb
    from asyncrl.telemetry.metrics import rss_mb
    from asyncrl.training.learner import Learner

    spec, job = MODELS["quick" if quick else "small"], JOBS[job_name]
    model = build_model(spec, seed=0)
    params = sum(p.numel() for p in model.parameters())
    learner = Learner(model, algorithm=AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip", clip_eps=0.2),
                      trainer=TrainerConfig(lr=3e-5, grad_clip=1.0, mini_batches=1, mixed_precision="bf16",
                                            **job["trainer"]),
                      pad_token_id=PAD, gradient_checkpointing=job["checkpointing"])
    for step in range(steps):
        groups = step_groups(step, job, spec["vocab"], learner.version)
        gc.collect()
        host_peak_gb()  # resets the peak: the next reading is this step's
        start = time.perf_counter()
        metrics = learner.update(groups)
        print(json.dumps({"step": step + 1, "s": time.perf_counter() - start, "peak": host_peak_gb(),
                          "rest": rss_mb() / 1024, "state_gib": params * 16 / 2**30,
                          "padded": metrics.get("trainer/padded_share", 0.0)}), flush=True)


def run_side(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--side", name, "--job", args.job, "--steps", str(args.steps)]
    proc = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"the {name} side failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="long-tail")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--side", choices=["default", "bounded"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 2
    if args.side:
        side(args.side, args.job, args.steps, args.quick)
        return {}
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the figure is from step 2 on)")
    rows = {name: run_side(name, args) for name in ("default", "bounded")}
    state = rows["default"][0]["state_gib"]
    print(f"job {args.job}, {args.steps} steps of {SAMPLES} samples of new lengths; weights + gradients + AdamW "
          f"{state:.2f} GiB (target: peak <= {2 * state:.2f})")
    print("| step | default peak | default rest | default s | bounded peak | bounded rest | bounded s | padded |")
    print("|---|---|---|---|---|---|---|---|")
    for d, b in zip(rows["default"], rows["bounded"]):
        print(f"| {d['step']} | {d['peak']:.2f} | {d['rest']:.2f} | {d['s']:.1f} | {b['peak']:.2f} | {b['rest']:.2f} "
              f"| {b['s']:.1f} | {b['padded']:.3f} |")
    worst = {name: max(r["peak"] for r in side_rows[1:]) for name, side_rows in rows.items()}
    pace = {name: sum(r["s"] for r in side_rows[1:]) / (len(side_rows) - 1) for name, side_rows in rows.items()}
    print(f"largest peak from step 2: default {worst['default']:.2f} GiB, bounded {worst['bounded']:.2f} GiB; "
          f"mean step from step 2: default {pace['default']:.1f} s, bounded {pace['bounded']:.1f} s")
    result = {"benchmark": "trainer_memory", "value": round(worst["bounded"], 3), "unit": "GiB",
              "baseline": round(worst["default"], 3), "ratio": round(worst["default"] / worst["bounded"], 3),
              "target": float(f"{2 * state:.4g}"), "job": args.job, "steps": args.steps,
              "step_s": {k: round(v, 2) for k, v in pace.items()},
              "rest_last": {name: round(side_rows[-1]["rest"], 3) for name, side_rows in rows.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
