"""The first example on a GPU, in one process: part (b) of .device/check.sh.

    python3 .device/first_digit.py RUN_DIR [--set KEY=VALUE ...] [--cpu] [--min-eval 0.5]

Runs examples/first_digit/config.toml with `asyncrl launch --local` (every role in this process; no Ray, which
the GPU machine does not have), the trainer and the generator on CUDA and colocated:
cluster.placement = "colocated", cluster.trainer_gpus = 0.5, cluster.generator_gpus = 0.5 (in process, a
role with GPUs runs on cuda:0, and the colocated engine wraps the trainer's module). Then prints the reward
curve's start and end from RUN_DIR/metrics.jsonl and the GPU memory the run allocated in this process (0
would mean the roles ran on the CPU after all).

Exit status: the launch's own when it failed; 3 when nothing was allocated on the GPU; 4 when the held-out
greedy reward of the last evaluation is below --min-eval (the README's CPU runs reach 0.87-0.94). `--cpu`
leaves the GPU overrides out, to try this script where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

CONFIG = "examples/first_digit/config.toml"
# colocated roles share one GPU, so their GPUs add up to at most 1 (a config check says so otherwise)
ON_GPU = ['cluster.placement="colocated"', "cluster.trainer_gpus=0.5", "cluster.generator_gpus=0.5"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--cpu", action="store_true", help="without the GPU overrides (try the script on a CPU)")
    ap.add_argument("--min-eval", type=float, default=0.5, help="lowest acceptable final held-out greedy reward")
    args = ap.parse_args(argv)
    import torch

    from asyncrl.cli import main as asyncrl

    run_dir = Path(args.run_dir)
    overrides = [*([] if args.cpu else ON_GPU), f"run.output_dir={json.dumps(str(run_dir))}",
                 f"model.path={json.dumps(str(run_dir.parent / 'models' / 'tiny-qwen2-digits'))}", *args.overrides]
    print(f"asyncrl launch {CONFIG} --local " + " ".join(f"--set {o}" for o in overrides), flush=True)
    rc = asyncrl(["launch", CONFIG, "--local", *(x for o in overrides for x in ("--set", o))])
    if rc != 0:
        return rc
    gpu_mib = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    print(f"\nGPU memory allocated by the run in this process (peak): {gpu_mib:.1f} MiB; "
          f"Ray imported: {sys.modules.get('ray') is not None}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    evals = [(r["step"], r["eval/greedy_reward"]) for r in rows if "eval/greedy_reward" in r]
    first, last = train[:5], train[-5:]
    print(f"train reward (mean of 5 steps): steps {first[0][0]}-{first[-1][0]}: "
          f"{statistics.mean(v for _, v in first):.3f} -> steps {last[0][0]}-{last[-1][0]}: "
          f"{statistics.mean(v for _, v in last):.3f}")
    print("held-out greedy reward by step: " + ", ".join(f"{s}: {v:.2f}" for s, v in evals))
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        print("summary: " + ", ".join(f"{k} {s[k]:.4g}" for k in ("steps", "wall_s", "train_s", "step_s/mean",
                                                            "generation/stall_s", "overlap_ratio") if k in s))
    if not args.cpu and gpu_mib == 0:
        print("FAILED: nothing was allocated on the GPU: the roles ran on the CPU (is cluster.*_gpus wired?)")
        return 3
    if not evals or evals[-1][1] < args.min_eval:
        print(f"FAILED: the last held-out greedy reward is below {args.min_eval}: it did not learn")
        return 4
    print(f"ok: learned (last held-out greedy reward {evals[-1][1]:.2f} >= {args.min_eval})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
