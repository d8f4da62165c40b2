"""Asynchronous against synchronous training on the long tail: the long-reply example, five settings, one evaluator.

    python benchmarks/long_tail.py                       # 5 settings x 10 steps, seed 0: about 50 minutes on 2 cores
    python benchmarks/long_tail.py --settings sync async # two of them
    python benchmarks/long_tail.py --steps 20 --seed 1   # the example's own step count, another seed
    python benchmarks/long_tail.py --analyse             # the tables again from the kept runs (--out); runs nothing

The job is examples/smollm_reasoning (SmolLM2-135M-Instruct, reasoning-gym arithmetic worked step by step, up to
256 new tokens: most replies stop near 50 tokens, a few run to the limit). Each setting is one `asyncrl launch` of
the example with a few overrides, one after the other, each with every core of the machine:

  sync           staleness.max_staleness = 0: generation, then training, each phase with every core (torch threads
                 "auto" give both roles all of them: the phases alternate)
  async          the example as shipped: max_staleness = 1, weights swapped in flight (partial rollouts: a reply
                 in progress goes on under the new version)
  async-whole    max_staleness = 1, rollout.weight_update = "between_requests": replies finish at their version
  k2             max_staleness = 2, in flight
  k2-whole       max_staleness = 2, between requests

Every run has the same seed, steps and data; no evaluation during the run (trainer.eval_every = 0) and the final
model only, as in vs_trl.py, whose shared evaluator (HF `generate` in float32, greedy and sampled at T = 1 on the
held-out rows) judges each final model. Figures per run, the first --warmup steps left out of the per-step ones:

  train s        the summed `time/step_s` of every step: first generation to the last update, start-up and the
                 final save left out (`wall s` has them)
  s/step         mean `time/step_s`
  G, T           the generators' and the trainer's busy seconds per step (`generator/busy_share`,
                 `trainer/busy_share` x `time/step_s`: decoding, swaps; updates, weight sends)
  wait           the trainer's idle wait for its groups per step (`trainer/gate_wait_s`)
  ideal          the step were generation and training perfectly overlapped on the cores the run gave them:
                 max(G, T) (for sync, whose phases cannot overlap, G + T); "of ideal" = ideal / s/step
  occupancy      `generation/occupancy`: the engine's decode batch over the sequences it may hold, mean over the
                 steps and step by step (the tail: the batch drains to its last long replies)
  multi-version  `rollout/multi_version_share`: trained replies whose tokens came from two versions (partial
                 rollouts); staleness: `staleness/token_mean`

The speed-up of a setting is sync's train s / its train s; its bound from the phase times, sync's step over the
setting's ideal. The last line is JSON for the shipped setting ("async"): value = its s/step, baseline = sync's,
ratio = the speed-up, target 1.3, with every setting's figures beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/smollm_reasoning/config.toml"
SETTINGS: dict[str, list[str]] = {
    "sync": ["staleness.max_staleness=0"],
    "async": [],
    "async-whole": ['rollout.weight_update="between_requests"'],
    "k2": ["staleness.max_staleness=2"],
    "k2-whole": ["staleness.max_staleness=2", 'rollout.weight_update="between_requests"'],
}


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def phase_figures(rows: list[dict[str, Any]], warmup: int, overlapped: bool) -> dict[str, Any]:
    """The per-step figures of one run's metrics rows (the rows that trained a step, in order)."""
    steps = [r for r in rows if "time/step_s" in r and "reward/mean" in r]
    if not steps:
        raise ValueError("the run wrote no training step")
    measured = steps[warmup:] or steps
    step = [r["time/step_s"] for r in measured]
    gen = [r.get("generator/busy_share", 0.0) * r["time/step_s"] for r in measured]
    train = [r.get("trainer/busy_share", 0.0) * r["time/step_s"] for r in measured]
    g, t, s = _mean(gen), _mean(train), _mean(step)
    ideal = max(g, t) if overlapped else g + t
    occupancy = [r.get("generation/occupancy") for r in steps]
    return {
        "steps": len(steps), "train_s": sum(r["time/step_s"] for r in steps), "step_s": s, "G": g, "T": t,
        "wait_s": _mean([r.get("trainer/gate_wait_s", 0.0) for r in measured]), "ideal_s": ideal,
        "of_ideal": ideal / s if s else float("nan"),
        "occupancy": _mean([o for o in occupancy if o is not None]),
        "occupancy_by_step": [None if o is None else round(o, 3) for o in occupancy],
        "multi_version": _mean([r.get("rollout/multi_version_share", 0.0) for r in measured]),
        "staleness": _mean([r.get("staleness/token_mean", 0.0) for r in measured]),
        "train_reward": _mean([r["reward/mean"] for r in steps]),
        "response_len": _mean([r["trainer/response_len"] for r in steps if "trainer/response_len" in r]),
    }


def speedups(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each setting against sync: the speed-up in train s and its bound (sync's step over the setting's ideal)."""
    sync = results["sync"]
    return {name: {"speedup": sync["train_s"] / r["train_s"], "bound": sync["step_s"] / r["ideal_s"]}
            for name, r in results.items()}


def run_setting(name: str, args: argparse.Namespace, judge: Any) -> dict[str, Any]:
    import vs_trl

    out = args.out / name
    sets = [*SETTINGS[name], f"trainer.total_steps={args.steps}", *args.set]
    result = vs_trl.run_asyncrl(CONFIG, sets, args.seed, out)
    result.update(judge(result.pop("model")))
    result.pop("train_rewards")
    (out / "long_tail.json").write_text(json.dumps(result))
    return result


def load_run(name: str, out: Path, warmup: int) -> dict[str, Any]:
    run = out / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return {**json.loads((run / "long_tail.json").read_text()), **phase_figures(rows, warmup, name != "sync")}


def report(results: dict[str, dict[str, Any]], base: dict[str, float] | None) -> dict[str, Any]:
    ups = speedups(results) if "sync" in results else {}
    print("\n| setting | wall s | start-up s | train s | s/step | G s | T s | wait s | of ideal | speed-up (bound) |"
          " occupancy | multi-version | staleness | held-out greedy / sampled | train reward | reply len |"
          " trainer peak GB | padded |")
    print("|---|" + "---|" * 18)
    for name, r in results.items():
        up = ups.get(name)
        speedup = f"{up['speedup']:.2f} ({up['bound']:.2f})" if up else "-"
        print(f"| {name} | {r['wall_s']:.0f} | {r['startup_s']:.1f} | {r['train_s']:.0f} | {r['step_s']:.1f} | "
              f"{r['G']:.1f} | {r['T']:.1f} | {r['wait_s']:.1f} | {r['of_ideal']:.2f} | "
              f"{speedup} | {r['occupancy']:.2f} | "
              f"{r['multi_version']:.2f} | {r['staleness']:.2f} | {r['greedy']:.3f} / {r['sampled']:.3f} | "
              f"{r['train_reward']:.3f} | {r['response_len']:.0f} | {r['peak_gb'] or 0:.2f} | "
              f"{r['padded_share'] if r['padded_share'] is None else round(r['padded_share'], 3)} |")
    if base:
        print(f"| base model | | | | | | | | | | | | | {base['greedy']:.3f} / {base['sampled']:.3f} | | | | |")
    print("\noccupancy step by step (generation/occupancy; - = no decode step in the window):")
    for name, r in results.items():
        print(f"  {name:12s} " + " ".join("-" if o is None else f"{o:.2f}" for o in r["occupancy_by_step"]))
    line: dict[str, Any] = {"benchmark": "long_tail", "unit": "s/step", "target": 1.3}
    if "sync" in results and "async" in results:
        line.update(value=round(results["async"]["step_s"], 2), baseline=round(results["sync"]["step_s"], 2),
                    ratio=round(ups["async"]["speedup"], 3), of_ideal=round(results["async"]["of_ideal"], 3))
    line["settings"] = {name: {"train_s": round(r["train_s"], 1), "step_s": round(r["step_s"], 2),
                               "of_ideal": round(r["of_ideal"], 3), "greedy": round(r["greedy"], 3),
                               "sampled": round(r["sampled"], 3), "occupancy": round(r["occupancy"], 3),
                               **({"speedup": round(ups[name]["speedup"], 3)} if name in ups else {})}
                        for name, r in results.items()}
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the per-step figures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "long_tail")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    parser.add_argument("--analyse", action="store_true", help="report the kept runs in --out; run nothing")
    args = parser.parse_args()
    os.chdir(ROOT)  # the example's folders are relative to the repository root
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))

    base = None
    if not args.analyse:
        import importlib

        import vs_trl

        from asyncrl.config import load_config
        from asyncrl.registry import import_path

        cfg = load_config(CONFIG, args.set)
        if not Path(cfg.data.path).exists() or not Path(cfg.data.eval_path).exists():
            importlib.import_module("examples.smollm_reasoning.prepare").main()
        reward = import_path(cfg.reward.fn)
        held_out = [json.loads(line) for line in Path(cfg.data.eval_path).open()][: cfg.trainer.eval_prompts]

        def judge(path: Path) -> dict[str, float]:
            return vs_trl.evaluate(path, Path(cfg.model.path), held_out, reward, cfg.rollout.max_new_tokens,
                                   args.eval_seed)

        base = vs_trl.cached_judge(args.out / "base.json", judge, Path(cfg.model.path), held_out,
                                   cfg.rollout.max_new_tokens, args.eval_seed)
        print(f"base model: held-out greedy {base['greedy']:.3f}, sampled {base['sampled']:.3f}", flush=True)
        for name in args.settings:
            r = run_setting(name, args, judge)
            print(f"{name}: wall {r['wall_s']:.0f} s, held-out greedy {r['greedy']:.3f} sampled {r['sampled']:.3f}",
                  flush=True)
    elif (args.out / "base.json").exists():
        base = json.loads((args.out / "base.json").read_text())
    results = {name: load_run(name, args.out, args.warmup) for name in args.settings
               if (args.out / name / "long_tail.json").exists()}
    print(json.dumps(report(results, base)))


if __name__ == "__main__":
    main()
