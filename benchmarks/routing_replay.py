"""Rollout routing replay on a mixture of experts: the problem (engine and trainer route tokens differently), the cure
(the trainer replays the engine's routing), and what recording and replaying cost.

    python benchmarks/routing_replay.py                 # 2 staleness x 4 settings x 30 steps, then the recording
                                                        # micro-benchmark: about 4 minutes on 2 cores
    python benchmarks/routing_replay.py --staleness 0   # k = 0 only
    python benchmarks/routing_replay.py --analyse       # the tables again from the kept runs (--out); runs nothing

The job is examples/first_digit_moe (a tiny random-initialised Qwen3-MoE: 2 layers, 4 experts, top-2; GRPO on the
first digit of a digit string), each run `asyncrl launch --local` of it with the engine in bfloat16 and the trainer
in float32 — the precision split of a real deployment, where routing flips — for each max_staleness k:

  dense      the dense example (examples/first_digit: the same shape with one 128-wide MLP per layer): the gap a
             model without routing has between the bf16 engine and the fp32 trainer
  moe-off    the MoE, algorithm.routing_replay = "off": nothing recorded
  measure    the engine records its routing; the trainer compares its own with it (routing/agreement), replays nothing
  rollout    the engine records, the trainer replays (routing replay)

Figures per run, means over its train steps (docs/metrics.md):

  agreement     `routing/agreement`: the share of (token, MoE layer) decisions where the trainer's router picks the
                engine's experts (measure and rollout only)
  gap           `trainer/logprob_gap`: mean |trainer - engine| logprob over the tokens sampled with the weights the
                trainer holds (k = 0: every token; k >= 1: the steps' few on-policy tokens, often none)
  diff          `trainer/logprob_diff`: the same over every trained token, stale ones included (what the importance
                ratio sees)
  ratio max     the largest importance ratio trainer / engine of a step (`trainer/ratio_max`), mean over steps
  gen tok/s     `generation/tokens_per_s`;  T s: the trainer's busy seconds per step;  greedy: final held-out reward

Then the recording micro-benchmark: the native engine (bf16) decoding the same tiny MoE with and without
`record_routing` (16 prompts x 8 samples x 32 new tokens, rounds alternated, median of each), and the bytes a
trajectory carries for its routing (int16: layers x top_k per position) beside its msgpack size.

The last line is JSON: value = the replayed run's gap at k = 0, baseline = the dense run's (target: ratio <= 1),
with the recording's cost (target <= 5% of generation time) and every run's figures beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MOE = "examples/first_digit_moe/config.toml"
DENSE = "examples/first_digit/config.toml"
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "dense": (DENSE, []),
    "moe-off": (MOE, ['algorithm.routing_replay="off"']),
    "measure": (MOE, ['algorithm.routing_replay="measure"']),
    "rollout": (MOE, ['algorithm.routing_replay="rollout"']),
}


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def run_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its metrics rows (the train steps; the evaluation of the last one)."""
    steps = [r for r in rows if "time/step_s" in r and "reward/mean" in r]
    if not steps:
        raise ValueError("the run wrote no training step")
    evals = [r for r in rows if "eval/greedy_reward" in r]
    gap_rows = [r for r in steps if r.get("trainer/logprob_gap_tokens", 0) > 0]
    return {
        "steps": len(steps),
        "agreement": _mean([r["routing/agreement"] for r in steps if "routing/agreement" in r]),
        "gap": _mean([r["trainer/logprob_gap"] for r in gap_rows]),
        "gap_steps": len(gap_rows),
        "diff": _mean([r["trainer/logprob_diff"] for r in steps]),
        "ratio_max": _mean([r["trainer/ratio_max"] for r in steps]),
        "step_s": _mean([r["time/step_s"] for r in steps]),
        "trainer_s": _mean([r.get("trainer/busy_share", 0.0) * r["time/step_s"] for r in steps]),
        "tokens_per_s": _mean([r["generation/tokens_per_s"] for r in steps if "generation/tokens_per_s" in r]),
        "train_reward": _mean([r["reward/mean"] for r in steps]),
        "greedy": evals[-1]["eval/greedy_reward"] if evals else float("nan"),
    }


def run_setting(name: str, k: int, args: argparse.Namespace) -> dict[str, Any]:
    config, sets = SETTINGS[name]
    out = args.out / f"k{k}" / name
    overrides = [*sets, f"staleness.max_staleness={k}", f"trainer.total_steps={args.steps}",
                 f"trainer.eval_every={args.steps}", 'rollout.dtype="bfloat16"', f"run.seed={args.seed}",
                 f'run.output_dir="{out}"', "logging.live=false", "run.save_checkpoint=false", *args.set]
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", config, "--local"]
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise SystemExit(f"{name} (k = {k}) failed:\n{proc.stderr[-3000:]}")
    (out / "wall_s").write_text(f"{time.perf_counter() - start:.1f}")
    return load_run(out)


def load_run(out: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return {**run_figures(rows), "wall_s": float((out / "wall_s").read_text())}


def recording_cost(model_dir: Path, rounds: int, prompts: int, n: int, tokens: int) -> dict[str, float]:
    """The native engine's generate time on `model_dir` with and without record_routing (medians of alternated
    rounds), and the routing bytes per trajectory."""
    import msgspec
    import torch

    from asyncrl.messages import SamplingParams, Trajectory
    from engines.torch_engine import TorchEngine

    torch.set_num_threads(os.cpu_count() or 1)
    batch = [[(3 * i + j) % 10 + 1 for j in range(6)] for i in range(prompts)]
    engines = {rec: TorchEngine(str(model_dir), dtype="bfloat16", eos_token_ids=[], seed=0, record_routing=rec)
               for rec in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    last = None
    for r in range(rounds + 1):  # the first round warms both up and is not counted
        for rec, engine in engines.items():
            start = time.perf_counter()
            out = asyncio.run(engine.generate(batch, SamplingParams(n=n, max_new_tokens=tokens, seed=r)))
            if r:
                times[rec].append(time.perf_counter() - start)
            if rec:
                last = out
    for engine in engines.values():
        asyncio.run(engine.close())
    assert last is not None
    c = last[0][0]
    traj = Trajectory(seq_id=0, group_id=0, group_size=n, prompt_ids=c.prompt_ids, response_ids=c.response_ids,
                      loss_mask=[True] * len(c.response_ids), behavior_logprobs=c.logprobs, versions=c.versions,
                      min_version=0, max_version=0, finish_reason=c.finish_reason, reward=1.0)
    plain = len(msgspec.msgpack.encode(traj))
    routed = len(msgspec.msgpack.encode(msgspec.structs.replace(traj, routed_experts=c.routed_experts,
                                                                routing_shape=c.routing_shape)))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"generate_s": off, "generate_recording_s": on, "recording_cost": on / off - 1,
            "positions": len(c.prompt_ids) + len(c.response_ids) - 1, "routing_bytes": len(c.routed_experts),
            "trajectory_bytes": plain, "trajectory_bytes_routed": routed}


def report(results: dict[int, dict[str, dict[str, Any]]], cost: dict[str, float] | None) -> dict[str, Any]:
    print("\n| k | setting | agreement | gap (steps) | diff | ratio max | s/step | T s | gen tok/s | train reward |"
          " held-out greedy |")
    print("|---|" + "---|" * 10)
    for k, runs in results.items():
        for name, r in runs.items():
            agree = "-" if r["agreement"] != r["agreement"] else f"{r['agreement']:.3f}"
            gap = "-" if not r["gap_steps"] else f"{r['gap']:.2e} ({r['gap_steps']})"
            print(f"| {k} | {name} | {agree} | {gap} | {r['diff']:.2e} | {r['ratio_max']:.2f} | {r['step_s']:.2f} | "
                  f"{r['trainer_s']:.2f} | {r['tokens_per_s']:.0f} | {r['train_reward']:.3f} | {r['greedy']:.2f} |")
    line: dict[str, Any] = {"benchmark": "routing_replay", "unit": "logprob gap", "target": 1.0}
    k0 = results.get(0, {})
    if "rollout" in k0 and "dense" in k0:
        line.update(value=float(f"{k0['rollout']['gap']:.3e}"), baseline=float(f"{k0['dense']['gap']:.3e}"),
                    ratio=round(k0["rollout"]["gap"] / k0["dense"]["gap"], 3))
    if cost:
        print(f"\nrecording (native engine, bf16): generate {cost['generate_s']:.3f} s without, "
              f"{cost['generate_recording_s']:.3f} s with: {100 * cost['recording_cost']:+.1f}% (target <= +5%); "
              f"{cost['routing_bytes']} routing bytes for {cost['positions']} positions, a trajectory of "
              f"{cost['trajectory_bytes']} -> {cost['trajectory_bytes_routed']} bytes (msgpack)")
        line["recording_cost"] = round(cost["recording_cost"], 4)
        line["recording_target"] = 0.05
        line["routing_bytes_per_position"] = round(cost["routing_bytes"] / cost["positions"], 1)
    line["runs"] = {f"k{k}/{name}": {key: (round(v, 6) if isinstance(v, float) else v) for key, v in r.items()}
                    for k, runs in results.items() for name, r in runs.items()}
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--staleness", nargs="+", type=int, default=[0, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of the recording micro-benchmark")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "routing_replay")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    parser.add_argument("--analyse", action="store_true", help="report the kept runs in --out; run nothing")
    args = parser.parse_args()
    args.out = args.out.resolve()
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for k in args.staleness:
        for name in args.settings:
            out = args.out / f"k{k}" / name
            if args.analyse:
                if (out / "wall_s").exists():
                    results.setdefault(k, {})[name] = load_run(out)
                continue
            r = results.setdefault(k, {})[name] = run_setting(name, k, args)
            print(f"k = {k} {name}: {r['wall_s']:.0f} s, gap {r['gap']:.2e}, diff {r['diff']:.2e}, agreement "
                  f"{r['agreement']:.3f}, held-out greedy {r['greedy']:.2f}", flush=True)
    cost_file = args.out / "recording.json"
    if not args.analyse:
        from asyncrl.config import load_config

        model_dir = Path(load_config(ROOT / MOE).model.path)  # built by the runs above
        cost = recording_cost(model_dir, args.rounds, prompts=16, n=8, tokens=32)
        cost_file.parent.mkdir(parents=True, exist_ok=True)
        cost_file.write_text(json.dumps(cost))
    cost = json.loads(cost_file.read_text()) if cost_file.exists() else None
    print(json.dumps(report(results, cost)))


if __name__ == "__main__":
    main()
