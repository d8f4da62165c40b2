"""Rollout routing replay on a mixture of experts: the problem (engine and trainer route tokens differently), the cure
(the trainer replays the engine's routing), and what recording and replaying cost.

    python benchmarks/routing_replay.py                 # the paired part, then 2 staleness x 4 settings x 30 steps:
                                                        # about 7 minutes on 2 cores
    python benchmarks/routing_replay.py --staleness 0   # k = 0 only
    python benchmarks/routing_replay.py --staleness     # the paired part only
    python benchmarks/routing_replay.py --experts 4 --top-k 2 --expert-width 64   # the example's own MoE
    python benchmarks/routing_replay.py --analyse       # the tables again from the kept runs (--out); runs nothing

The job is examples/first_digit_moe (GRPO on the first digit of a digit string) on a tiny random-initialised
Qwen3-MoE shaped like the real ones: many narrow experts, several per token (by default 16 experts of width 32, top-4,
2 layers; the example's own 4 x 64, top-2, has so few near-ties that bf16 almost never flips its routing), each run
`asyncrl launch --local` with the engine in bfloat16 and the trainer in float32 — the precision split of a real
deployment, where routing flips — for each max_staleness k:

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

First the paired part, on one set of samples: the native engine (bf16) samples the MoE (32 prompts x 8 samples x 24
new tokens) recording its routing, and the float32 trainer's first pass over those samples (the engine's weights,
k = 0) gives the logprob gap without replay ("measure") and with it ("rollout"); the dense model's gap on its own
samples is the baseline. The same generate with and without `record_routing`, in alternated rounds (ABBA), gives
the recording's cost (the median of the rounds' ratios), and a trajectory's routing bytes (int16: layers x top_k per
position) beside its msgpack size.

The last line is JSON: value = the paired gap with replay, baseline = the dense model's (target: ratio <= 1; lower is
better), with the gap without replay, the recording's cost (target <= 5% of generation time) and every run's figures
beside it.
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


def _mean(values: list[float]) -> float | None:
    """None for no values: the JSON line stays strict JSON (no NaN)."""
    return statistics.mean(values) if values else None


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
        "greedy": evals[-1]["eval/greedy_reward"] if evals else None,
    }


def moe_shape(args: argparse.Namespace) -> list[str]:
    """The overrides that give the MoE settings the benchmark's model (built on first use, in a folder of its own)."""
    return [f'model.path="runs/models/tiny-qwen3moe-e{args.experts}k{args.top_k}w{args.expert_width}-digits"',
            f"model.build_tiny.num_experts={args.experts}", f"model.build_tiny.experts_per_token={args.top_k}",
            f"model.build_tiny.intermediate_size={args.expert_width}"]


def run_setting(name: str, k: int, args: argparse.Namespace) -> dict[str, Any]:
    config, sets = SETTINGS[name]
    out = args.out / f"k{k}" / name
    shape = moe_shape(args) if config == MOE else []
    overrides = [*sets, *shape, f"staleness.max_staleness={k}", f"trainer.total_steps={args.steps}",
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


def _sample(model_dir: Path, record: bool, prompts: list[list[int]], n: int, tokens: int,
            seed: int) -> tuple[list[Any], float]:
    """One generate of the native engine (bf16) on `model_dir`: (its groups of completions, its seconds)."""
    from asyncrl.messages import SamplingParams
    from engines.torch_engine import TorchEngine

    engine = TorchEngine(str(model_dir), dtype="bfloat16", eos_token_ids=[], seed=0, record_routing=record)
    try:
        start = time.perf_counter()
        out = asyncio.run(engine.generate(prompts, SamplingParams(n=n, max_new_tokens=tokens, seed=seed)))
        return out, time.perf_counter() - start
    finally:
        asyncio.run(engine.close())


def _group(completions: list[Any], group_id: int) -> Any:
    from asyncrl.messages import Group, Trajectory

    trajs = [Trajectory(seq_id=group_id * len(completions) + i, group_id=group_id, group_size=len(completions),
                        prompt_ids=c.prompt_ids, response_ids=c.response_ids, loss_mask=[True] * len(c.response_ids),
                        behavior_logprobs=c.logprobs, versions=c.versions, min_version=0, max_version=0,
                        finish_reason=c.finish_reason, reward=float(i % 2), routed_experts=c.routed_experts,
                        routing_shape=c.routing_shape)
             for i, c in enumerate(completions)]
    return Group(group_id=group_id, min_version=0, trajectories=trajs)


def _trainer_gap(model_dir: Path, groups: list[Any], replay: str) -> dict[str, float]:
    """The float32 trainer's first pass over the engine's samples (weights = the engine's): the on-policy gap
    |trainer - engine| logprob, and with routing the agreement (`Learner.update`'s diagnostics)."""
    from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
    from asyncrl.training.learner import Learner
    from engines import hf

    learner = Learner(hf.load_model(model_dir, dtype="float32"), algorithm=AlgorithmConfig(routing_replay=replay),
                      trainer=TrainerConfig(micro_batch_size=64), pad_token_id=hf.PAD_ID)
    m = learner.update(groups)
    return {"gap": m["trainer/logprob_gap"], "tokens": m["trainer/logprob_gap_tokens"],
            "agreement": m.get("routing/agreement")}


def paired(moe_dir: Path, dense_dir: Path, rounds: int, prompts: int, n: int, tokens: int) -> dict[str, float]:
    """On the same samples of the bf16 engine (k = 0, before any update): the float32 trainer's logprob gap without
    and with replay, the dense model's gap on its own samples, the engine's generate time without and with
    recording (medians of alternated rounds) and the routing bytes a trajectory carries."""
    import msgspec
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    batch = [[(7 * i + 3 * j) % 10 + 1 for j in range(6)] for i in range(prompts)]
    times: dict[bool, list[float]] = {False: [], True: []}
    recorded = None
    for r in range(rounds + 1):  # round 0 warms up and is not counted; the order alternates (ABBA)
        for record in ((False, True) if r % 2 else (True, False)):
            out, seconds = _sample(moe_dir, record, batch, n, tokens, seed=r)
            if r:
                times[record].append(seconds)
            if record:
                recorded = out
    assert recorded is not None
    groups = [_group(g, i) for i, g in enumerate(recorded)]  # the last round's recorded samples
    dense = [_group(g, i) for i, g in enumerate(_sample(dense_dir, False, batch, n, tokens, seed=0)[0])]
    off, on, flat = _trainer_gap(moe_dir, groups, "measure"), _trainer_gap(moe_dir, groups, "rollout"), \
        _trainer_gap(dense_dir, dense, "off")
    traj = groups[0].trajectories[0]
    plain = len(msgspec.msgpack.encode(msgspec.structs.replace(traj, routed_experts=b"", routing_shape=[])))
    without, recording = statistics.median(times[False]), statistics.median(times[True])
    ratios = [on / off for on, off in zip(times[True], times[False])]  # round by round: the machine's drift cancels
    return {"gap_off": off["gap"], "gap_on": on["gap"], "gap_dense": flat["gap"], "agreement": off["agreement"],
            "tokens": off["tokens"], "generate_s": without, "generate_recording_s": recording,
            "recording_cost": statistics.median(ratios) - 1,
            "recording_cost_rounds": [round(x - 1, 4) for x in ratios],
            "positions": len(traj.prompt_ids) + len(traj.response_ids) - 1, "routing_bytes": len(traj.routed_experts),
            "trajectory_bytes": plain, "trajectory_bytes_routed": len(msgspec.msgpack.encode(traj))}


def report(results: dict[int, dict[str, dict[str, Any]]], pair: dict[str, float] | None) -> dict[str, Any]:
    line: dict[str, Any] = {"benchmark": "routing_replay", "unit": "logprob gap", "target": 1.0}
    if pair:
        print(f"\npaired, k = 0 (the bf16 engine's samples, the fp32 trainer's first pass, {pair['tokens']:.0f} "
              f"tokens): routing agreement {pair['agreement']:.4f}; logprob gap without replay {pair['gap_off']:.3e}, "
              f"with replay {pair['gap_on']:.3e}, dense model {pair['gap_dense']:.3e}")
        print(f"recording (native engine, bf16): generate {pair['generate_s']:.2f} s without, "
              f"{pair['generate_recording_s']:.2f} s with (medians): {100 * pair['recording_cost']:+.1f}% (the median "
              f"of the rounds' {', '.join(f'{100 * x:+.1f}%' for x in pair.get('recording_cost_rounds', []))}; "
              f"target <= +5%); "
              f"{pair['routing_bytes']} routing bytes for {pair['positions']} positions, a trajectory of "
              f"{pair['trajectory_bytes']} -> {pair['trajectory_bytes_routed']} bytes (msgpack)")
        line.update(value=float(f"{pair['gap_on']:.4e}"), baseline=float(f"{pair['gap_dense']:.4e}"),
                    ratio=round(pair["gap_on"] / pair["gap_dense"], 3), gap_off=float(f"{pair['gap_off']:.4e}"),
                    agreement=round(pair["agreement"], 4), recording_cost=round(pair["recording_cost"], 4),
                    recording_target=0.05,
                    routing_bytes_per_position=round(pair["routing_bytes"] / pair["positions"], 1))
    if results:
        print("\nruns (30 steps each; means over the steps):\n")
        print("| k | setting | agreement | gap (steps) | diff | ratio max | s/step | T s | gen tok/s | train reward |"
              " held-out greedy |")
        print("|---|" + "---|" * 10)
    for k, runs in results.items():
        for name, r in runs.items():
            agree = "-" if r["agreement"] is None else f"{r['agreement']:.3f}"
            gap = "-" if not r["gap_steps"] else f"{r['gap']:.2e} ({r['gap_steps']})"
            print(f"| {k} | {name} | {agree} | {gap} | {r['diff']:.2e} | {r['ratio_max']:.2f} | {r['step_s']:.2f} | "
                  f"{r['trainer_s']:.2f} | {r['tokens_per_s'] or 0:.0f} | {r['train_reward']:.3f} | "
                  f"{'-' if r['greedy'] is None else format(r['greedy'], '.2f')} |")
    line["runs"] = {f"k{k}/{name}": {key: (round(v, 6) if isinstance(v, float) else v) for key, v in r.items()}
                    for k, runs in results.items() for name, r in runs.items()}
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--staleness", nargs="*", type=int, default=[0, 2], help="none: the paired part only")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=32, help="each expert's intermediate size")
    parser.add_argument("--rounds", type=int, default=5, help="alternated generate rounds of the paired part")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "routing_replay")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    parser.add_argument("--analyse", action="store_true", help="report the kept runs in --out; run nothing")
    args = parser.parse_args()
    args.out = args.out.resolve()
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    pair_file = args.out / "paired.json"
    if not args.analyse:
        from asyncrl.config import load_config
        from engines.hf import ensure_model

        moe_dir = ensure_model(load_config(ROOT / MOE, moe_shape(args)).model)
        dense_dir = ensure_model(load_config(ROOT / DENSE).model)
        pair = paired(moe_dir, dense_dir, args.rounds, prompts=32, n=8, tokens=24)
        pair_file.parent.mkdir(parents=True, exist_ok=True)
        pair_file.write_text(json.dumps(pair))
        print(f"paired: gap without replay {pair['gap_off']:.3e}, with {pair['gap_on']:.3e}, dense "
              f"{pair['gap_dense']:.3e}; recording {100 * pair['recording_cost']:+.1f}%", flush=True)
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for k in args.staleness:
        for name in args.settings:
            out = args.out / f"k{k}" / name
            if args.analyse:
                if (out / "wall_s").exists():
                    results.setdefault(k, {})[name] = load_run(out)
                continue
            r = results.setdefault(k, {})[name] = run_setting(name, k, args)
            print(f"k = {k} {name}: {r['wall_s']:.0f} s, gap {r['gap'] or 0:.2e}, diff {r['diff']:.2e}, agreement "
                  f"{r['agreement'] or 0:.3f}, held-out greedy {r['greedy'] or 0:.2f}", flush=True)
    pair = json.loads(pair_file.read_text()) if pair_file.exists() else None
    print(json.dumps(report(results, pair)))


if __name__ == "__main__":
    main()
