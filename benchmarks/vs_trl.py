"""asyncrl against TRL's GRPOTrainer on the same job, judged by one shared evaluator.

    python benchmarks/vs_trl.py                            # the README job (examples/smollm_arith), seeds 0 1 2
    python benchmarks/vs_trl.py --job reasoning --seeds 0  # the long-reply example (examples/smollm_reasoning)
    python benchmarks/vs_trl.py --settings                 # print the TRL settings the job maps to; run nothing
    python benchmarks/vs_trl.py --seeds 0 --set trainer.total_steps=2   # a config override, for both frameworks
    python benchmarks/vs_trl.py --job reasoning --frameworks asyncrl     # one framework's runs only

TRL is not a dependency of the project: it is installed into an environment of its own (--trl-venv, default
runs/trl-venv; made on first use: torch==2.13.0 first, then trl, and the transformers and reasoning-gym versions
this environment has) and trains there, in its own process; asyncrl trains with `asyncrl launch`, as a user runs
it. The two run one after the other, never side by side, on every core of the machine.

The same job for both (`trl_settings`): the model folder, the train rows (TRL's conversational form, rendered by the
model's chat template in both) in the same order (`prompt_order`: asyncrl's for the seed, so step s trains on the
same prompts in both and a seed compares the frameworks on the same data), the reward function (reward.fn, called
with each row's fields), prompts per step x group size, one optimizer step per step (over gradient-accumulated
micro-batches where asyncrl's config micro-batches: `micro_batch`), the learning rate and its constant schedule,
AdamW's betas and weight decay, gradient clipping, steps, max new tokens, the sampling temperature, the clip
epsilon, no KL term, the loss aggregation (token-mean is TRL's "dapo"), group-normalised advantages, bf16 autocast
where asyncrl's config asks for it (the LM head's product in float32 in both: trainer.lm_head_fp32, TRL's logprob
kernel), torch threads. What differs is the frameworks: TRL generates with HF `generate` and trains strictly
on-policy, step after step; asyncrl generates with its own engine, overlapped with training at the config's
max_staleness. Neither evaluates during the run (asyncrl's trainer.eval_every is set to 0), and both write the final
model only (asyncrl's export; its durable checkpoint after the last step, run.save_every_s, is off: TRL's
save_strategy is "no").

The shared evaluator (`evaluate`): HF `generate` in this environment, in float32, on the job's held-out rows, all
at once with left padding: greedy, and sampled at T = 1 with a fixed seed; each completion scored by the job's
reward. It judges the base model once and each final model (asyncrl's export, TRL's saved model).

Figures per framework and seed: wall (the process, launch to exit), start-up (launch to the first step: asyncrl's
summary.json startup_s; TRL's on_train_begin), s/step (mean over steps after the first), held-out greedy and
sampled reward, the trainer's peak resident memory, and the policy's token entropy on its training samples at the
first and the last step (asyncrl's trainer/entropy, TRL's logged entropy: how far each run narrowed). The last
line is JSON: value = asyncrl's mean wall, baseline = TRL's (seconds), ratio = baseline / value (lower is better:
the speed-up; target 2.0); "greedy"/"sampled" carry
both frameworks' held-out rewards, seed by seed.

Each judged run keeps its figures in its folder (`OUT/<framework>-<seed>/result.json`, with the commit and time
it was measured at), and a later call with the same job, overrides, seed and evaluation reuses them instead of
running again (`--rerun`: run again): a long job's seeds can be measured over several sittings, one framework
at a time (`--frameworks`), and the table then holds every kept seed. A reused run is marked "kept" with its
date in its line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"readme": ROOT / "examples/smollm_arith/config.toml",
        "reasoning": ROOT / "examples/smollm_reasoning/config.toml"}
PREPARE = {"readme": "examples.smollm_arith.prepare", "reasoning": "examples.smollm_reasoning.prepare"}
TRL_VERSION = "1.16.0"
# asyncrl's loss aggregation -> TRL's loss_type of the same normalisation
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def trl_settings(cfg: Any) -> dict[str, Any]:
    """The GRPOConfig keyword arguments of asyncrl config `cfg`'s job; ValueError for a job TRL cannot mirror."""
    a, t, r = cfg.algorithm, cfg.trainer, cfg.rollout
    problems = [what for what, bad in (
        ("algorithm.advantage must be 'grpo'", a.advantage != "grpo"),
        ("algorithm.policy_loss must be 'ppo_clip'", a.policy_loss != "ppo_clip"),
        (f"algorithm.loss_agg must be one of {sorted(LOSS_TYPES)}", a.loss_agg not in LOSS_TYPES),
        ("algorithm.kl_mode must be 'off'", a.kl_mode != "off"),
        ("trainer.mini_batches and trainer.epochs must be 1", t.mini_batches != 1 or t.epochs != 1),
        ("trainer.lr_scheduler must be 'constant'", t.lr_scheduler != "constant"),
        ("rollout.top_p must be 1 and rollout.top_k 0", r.top_p != 1.0 or r.top_k > 0),
    ) if bad]
    if problems:
        raise ValueError("TRL's GRPOTrainer cannot run this job the same way: " + "; ".join(problems))
    batch = t.prompts_per_step * r.group_size
    longest = cfg.data.max_prompt_len + r.max_new_tokens
    micro = micro_batch(batch, t.micro_batch_size, t.max_tokens_per_micro_batch, longest)
    return {
        "learning_rate": t.lr, "lr_scheduler_type": "constant", "weight_decay": t.weight_decay,
        "adam_beta1": t.betas[0], "adam_beta2": t.betas[1], "max_grad_norm": t.grad_clip,
        "max_steps": t.total_steps, "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": batch // micro, "num_generations": r.group_size, "num_iterations": 1,
        "max_completion_length": r.max_new_tokens, "temperature": r.temperature, "top_p": 1.0, "top_k": 0,
        "beta": 0.0, "epsilon": a.clip_eps, "loss_type": LOSS_TYPES[a.loss_agg], "scale_rewards": "group",
        "bf16": t.mixed_precision == "bf16", "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "use_cpu": True, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "dataloader_num_workers": 0, "shuffle_dataset": False,  # the rows come in asyncrl's order (`prompt_order`)
    }


def prompt_order(cfg: Any, seed: int) -> list[dict[str, Any]]:
    """The train rows in the order asyncrl's generators prompt with them at run.seed = `seed` (its PromptStream,
    seeded as asyncrl/deploy/build.py seeds it), enough for the run's steps twice over: TRL reads them in this
    order (shuffle_dataset off), so both frameworks train step s on the same prompts. At max_staleness 0 asyncrl
    consumes its groups in admission order, P per step; at k > 0 a step may take groups admitted a version or
    more earlier, still in this order."""
    import msgspec

    from asyncrl.data.prompts import PromptEncoder, prompt_rows
    from asyncrl.data.rows import PromptStream
    from asyncrl.deploy.build import derive_seed
    from engines.hf import load_tokenizer

    # the rows as the generators screen them (data.overlong), unrendered: TRL renders them with the same template
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, seed=seed))
    rows, _ = prompt_rows(cfg, "train", PromptEncoder(load_tokenizer(cfg.model.path), cfg.data))
    stream = PromptStream(rows, seed=derive_seed(seed, "data"), shuffle=cfg.data.shuffle)
    return [stream.row(i) for i in range(2 * cfg.trainer.total_steps * cfg.trainer.prompts_per_step)]


def micro_batch(batch: int, micro_batch_size: int, token_budget: int, longest: int) -> int:
    """TRL's samples per forward for asyncrl's micro-batching: `micro_batch_size`, or under a token budget as many
    samples of the longest possible length (prompt + reply) as fit in it: TRL pads to the longest and cannot group
    by length, so its micro-batches are sized for the worst case. The largest divisor of the step's batch at most
    that (gradient accumulation over the rest: one optimizer step on the whole batch, its tokens normalised
    together by TRL's "dapo" loss as by asyncrl's token-mean)."""
    cap = max(1, token_budget // longest) if token_budget > 0 else micro_batch_size
    return max(d for d in range(1, batch + 1) if batch % d == 0 and d <= cap)


def row_fields(fn: Any, row: dict[str, Any]) -> dict[str, Any]:
    """The row's fields `fn` takes (all of them if it takes **kwargs), as asyncrl passes them to a reward."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return {k: v for k, v in row.items() if k != "prompt"}
    names = {p.name for p in params} - {"prompt", "completion"}
    return {k: v for k, v in row.items() if k in names}


def trl_python(venv: Path) -> Path:
    """TRL's environment's interpreter, made on first use."""
    python = venv / "bin" / "python"
    check = f"import trl; assert trl.__version__ == {TRL_VERSION!r}"
    if python.exists() and subprocess.run([python, "-c", check], capture_output=True).returncode == 0:
        return python
    print(f"making TRL's environment in {venv} (trl {TRL_VERSION}; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel first: trl's requirements then keep it
    subprocess.run([*pip, f"trl=={TRL_VERSION}", f"transformers=={metadata.version('transformers')}",
                    f"reasoning-gym=={metadata.version('reasoning-gym')}"], check=True)
    return python


def trl_worker(spec: dict[str, Any]) -> None:
    """In TRL's environment: train the job with GRPOTrainer, save the final model, write the timings."""
    import importlib

    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    module, name = spec["reward"].split(":")
    reward = getattr(importlib.import_module(module), name)
    dataset = load_dataset("json", data_files=spec["train"], split="train")  # in asyncrl's prompt order
    fields = [c for c in dataset.column_names if c != "prompt"]

    def reward_fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        out = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
            row = {f: columns[f][i] for f in fields if f in columns}
            out.append(float(reward(question, text, **row_fields(reward, row))))
        return out

    times: dict[str, Any] = {"steps": []}

    class Times(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            times["train_begin"] = time.time()

        def on_step_begin(self, args, state, control, **kwargs):
            times["step_begin"] = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            times["steps"].append(time.time() - times["step_begin"])

    args = GRPOConfig(output_dir=spec["out"], seed=spec["seed"], **spec["settings"])
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward_fn, args=args, train_dataset=dataset,
                          callbacks=[Times()])
    trainer.train()
    trainer.save_model(str(Path(spec["out"]) / "final"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    entropy = [h["entropy"] for h in trainer.state.log_history if "entropy" in h]
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    Path(spec["out"], "times.json").write_text(json.dumps({**times, "train_rewards": rewards, "train_entropy": entropy,
                                                           "peak_gb": peak_gb}))


def evaluate(model_dir: Path, tokenizer_dir: Path, rows: list[dict[str, Any]], reward: Any, max_new_tokens: int,
             seed: int) -> dict[str, float]:
    """The shared evaluator: mean reward of greedy and of sampled (T = 1) completions on `rows`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: dict[str, float] = {}
    for mode, kwargs in (("greedy", {"do_sample": False}),
                         ("sampled", {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0})):
        torch.manual_seed(seed)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad, **kwargs)
        replies = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        scores = [float(reward(r["prompt"][-1]["content"], c, **row_fields(reward, r))) for r, c in zip(rows, replies)]
        out[mode] = sum(scores) / len(scores)
    return out


def cached_judge(path: Path, judge: Any, model: Path, rows: list[dict[str, Any]], max_new_tokens: int,
                 seed: int) -> dict[str, Any]:
    """The base model's held-out rewards, kept in `path` and reused while the model folder, the rows, the token
    limit and the seed are the same (a 256-token evaluation takes minutes on 2 cores)."""
    key = {"model": str(model.resolve()), "rows": len(rows), "first_row": rows[0] if rows else None,
           "max_new_tokens": max_new_tokens, "eval_seed": seed}
    if path.exists():
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            return kept
    result = {**judge(model), "key": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def kept_run(folder: Path, key: dict[str, Any], run: Any = None, rerun: bool = False) -> dict[str, Any] | None:
    """A judged run's figures: `folder`/result.json where it holds the same `key` (and not `rerun`), else `run()`'s
    (a dict of figures), written there with the commit and time of the measurement; None without a kept one and
    without `run`."""
    path = folder / "result.json"
    if path.exists() and not rerun:
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            return {**kept, "kept": True}
    if run is None:
        return None
    result = {**run(), "key": key, "measured_at": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit()}
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return result


def _commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def run_asyncrl(config: Path, sets: list[str], seed: int, out: Path) -> dict[str, Any]:
    cmd = ["asyncrl", "launch", str(config), *[a for s in sets for a in ("--set", s)], "--set", f"run.seed={seed}",
           "--set", f'run.output_dir="{out}"', "--set", "trainer.eval_every=0", "--set", "logging.live=false",
           "--set", "run.save_every_s=0"]  # the final model only, as TRL's run here: no durable checkpoint
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [r["time/step_s"] for r in rows if "reward/mean" in r]
    padded = [r["trainer/padded_share"] for r in rows if "trainer/padded_share" in r]
    return {"wall_s": wall, "startup_s": summary["startup_s"], "step_s": statistics.mean(steps[1:] or steps),
            "peak_gb": summary.get("memory/trainer_peak_gb"),
            "padded_share": statistics.mean(padded) if padded else None,
            "train_rewards": [r["reward/mean"] for r in rows if "reward/mean" in r],
            "train_entropy": [r["trainer/entropy"] for r in rows if "trainer/entropy" in r],
            "model": out / "checkpoint"}


def run_trl(python: Path, spec: dict[str, Any]) -> dict[str, Any]:
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    subprocess.run([str(python), __file__, "--trl-worker", json.dumps(spec)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    times = json.loads((out / "times.json").read_text())
    steps = times["steps"]
    return {"wall_s": wall, "startup_s": times["train_begin"] - t0, "step_s": statistics.mean(steps[1:] or steps),
            "peak_gb": times["peak_gb"], "padded_share": None, "train_rewards": times["train_rewards"],
            "train_entropy": times.get("train_entropy", []), "model": out / "final"}


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="readme")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trl-venv", type=Path, default=ROOT / "runs" / "trl-venv")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "vs_trl")
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the job, both frameworks (e.g. trainer.total_steps=2)")
    parser.add_argument("--settings", action="store_true", help="print the TRL settings of the job; run nothing")
    parser.add_argument("--frameworks", nargs="+", choices=["asyncrl", "trl"], default=["asyncrl", "trl"],
                        help="which frameworks run (the table also shows the other's kept seeds)")
    parser.add_argument("--rerun", action="store_true",
                        help="run again where a seed's judged figures are kept (OUT/<framework>-<seed>/result.json)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return
    os.chdir(ROOT)  # the example configs' folders are relative to the repository root
    sys.path.insert(0, str(ROOT))  # and their reward functions import from it (`asyncrl launch` gets PYTHONPATH)

    import importlib

    from asyncrl.config import load_config
    from asyncrl.registry import import_path

    cfg = load_config(JOBS[args.job], args.set)
    settings = trl_settings(cfg)
    if args.settings:
        print(json.dumps(settings, indent=1))
        return
    if not Path(cfg.data.path).exists() or not Path(cfg.data.eval_path).exists():
        importlib.import_module(PREPARE[args.job]).main()
    threads = int(cfg.cluster.torch_threads) if cfg.cluster.torch_threads != "auto" else os.cpu_count() or 1
    python = functools.cache(lambda: trl_python(args.trl_venv))  # made (or checked) where TRL runs
    reward = import_path(cfg.reward.fn)
    held_out = [json.loads(line) for line in Path(cfg.data.eval_path).open()][: cfg.trainer.eval_prompts]
    model = Path(cfg.model.path)

    def judge(path: Path) -> dict[str, float]:
        return evaluate(path, model, held_out, reward, cfg.rollout.max_new_tokens, args.eval_seed)

    base = cached_judge(args.out / "base.json", judge, model, held_out, cfg.rollout.max_new_tokens, args.eval_seed)
    print(f"base model: held-out greedy {base['greedy']:.3f}, sampled {base['sampled']:.3f} "
          f"({len(held_out)} rows)", flush=True)
    results: dict[str, list[dict[str, Any]]] = {"asyncrl": [], "trl": []}
    for seed in args.seeds:
        ordered = args.out / f"trl-{seed}" / "train.jsonl"   # the train rows in asyncrl's order for this seed

        def trl_run(seed: int = seed, ordered: Path = ordered) -> dict[str, Any]:
            ordered.parent.mkdir(parents=True, exist_ok=True)
            ordered.write_text("".join(json.dumps(r) + "\n" for r in prompt_order(cfg, seed)))
            return run_trl(python(), {"out": str(args.out / f"trl-{seed}"), "seed": seed, "threads": threads,
                                      "settings": settings, "model": str(model), "train": str(ordered),
                                      "reward": cfg.reward.fn})

        runs = (("asyncrl", lambda: run_asyncrl(JOBS[args.job], args.set, seed, args.out / f"asyncrl-{seed}")),
                ("trl", trl_run))
        for name, run in runs if seed % 2 == 0 else reversed(runs):  # alternate which goes first
            key = {"job": args.job, "sets": args.set, "seed": seed, "eval": base["key"],
                   "version": TRL_VERSION if name == "trl" else None, "prompts": "asyncrl's order"}

            def judged(run: Any = run) -> dict[str, Any]:
                result = run()
                return {**result, **judge(result.pop("model"))}

            runs_here = name in args.frameworks  # the other framework: its kept seeds only
            result = kept_run(args.out / f"{name}-{seed}", key, judged if runs_here else None,
                              rerun=args.rerun and runs_here)
            if result is None:
                continue
            results[name].append(result)
            when = f"  (kept: {result['measured_at']}, {result['commit']})" if result.get("kept") else ""
            print(f"seed {seed} {name:8s} wall {result['wall_s']:6.1f} s  start-up {result['startup_s']:5.1f} s  "
                  f"{result['step_s']:5.2f} s/step  held-out greedy {result['greedy']:.3f} sampled "
                  f"{result['sampled']:.3f}  peak {result['peak_gb'] or 0:.2f} GB  policy entropy "
                  f"{_ends(result.get('train_entropy'))}{when}", flush=True)

    print(f"\n{args.job} job, seeds {args.seeds}: mean ± sd over the seeds each framework has")
    print("| framework | seeds | wall s | start-up s | s/step | held-out greedy | held-out sampled | trainer peak GB |"
          " padded share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        padded = [r["padded_share"] for r in rs if r["padded_share"] is not None]
        cells = [_spread([r[k] for r in rs if r[k] is not None]) for k in
                 ("wall_s", "startup_s", "step_s", "greedy", "sampled", "peak_gb")]
        print(f"| {name} | {', '.join(str(r['key']['seed']) for r in rs) or '-'} | {' | '.join(cells)} | "
              f"{_spread(padded)} |")
    print(f"| base model | | | | | {base['greedy']:.3f} | {base['sampled']:.3f} | | |")
    walls = {n: statistics.mean(r["wall_s"] for r in rs) if rs else None for n, rs in results.items()}
    ours, theirs = walls["asyncrl"], walls["trl"]
    print(json.dumps({"benchmark": f"vs_trl_{args.job}", "value": _round(ours, 1), "unit": "s",
                      "baseline": _round(theirs, 1), "ratio": _round(theirs / ours, 3) if ours and theirs else None,
                      "target": 2.0,
                      "greedy": {n: [round(r["greedy"], 3) for r in rs] for n, rs in results.items()},
                      "sampled": {n: [round(r["sampled"], 3) for r in rs] for n, rs in results.items()},
                      "seeds": {n: [r["key"]["seed"] for r in rs] for n, rs in results.items()}}))


def _ends(values: list[float] | None) -> str:
    """A per-step series' first -> last value (the policy's entropy over the run), '-' where none was kept."""
    return f"{values[0]:.2f} -> {values[-1]:.2f}" if values else "-"


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


if __name__ == "__main__":
    main()
