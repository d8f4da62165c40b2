"""asyncrl against the plain synchronous GRPO loop users write: wall time to a reward target, same workload.

    python benchmarks/vs_sync_loop.py            # 3 seeds each: sync loop, `asyncrl launch` (Ray), `--local`
    python benchmarks/vs_sync_loop.py --no-ray   # sync loop and `asyncrl launch --local` only
    python benchmarks/vs_sync_loop.py --quick    # 1 seed, 3 steps, no target (the smoke test)

Place in the dataflow: none — a script outside the package that runs `asyncrl launch` as a subprocess (reading
its RUN_DIR/metrics.jsonl) beside a loop written here, on the README's first example
(examples/first_digit/config.toml: the tiny random Qwen2 built offline, the first-digit task, prefix_match,
GRPO + PPO-clip with token-mean aggregation, 16 prompts x 8 samples per step, 2 new tokens, AdamW lr 3e-3).

The sync loop (`SyncLoop`) is the best plain loop this workload allows, written without asyncrl (which only
builds the same model folder and gives the task's rows and reward rule): HF `model.generate(do_sample=True,
temperature=1, max_new_tokens=2)` of the step's 16 prompts x 8 in one batched call, the reward on the decoded
completions, GRPO advantages (r - group mean) / (unbiased group std + 1e-6) (0 for an all-equal group), one
forward of the 128 sequences, PPO-clip (eps 0.2) with token-mean aggregation, gradient clipping at 1.0, AdamW
(lr, betas and weight decay from the config), every phase on the same torch threads: --threads, by default
the faster of 1 and all cores as timed in the loop's warm-up (the issue asks for all cores; on a busy machine
all cores can be many times slower than one, and the best plain loop would not pick that).
Its old policy is the current one: with one mini-batch and one epoch, on-policy, the ratio is exactly 1 and
PPO's old logprobs are the training forward's own, detached — the same loss and gradient as the sampler's
behaviour logprobs would give, without asking `generate` for its logits (the fastest exact choice).

The target (both sides, the same rule): the moving mean of the training reward (`reward/mean` on the asyncrl
side: the mean reward of the samples each step trained on) over the last --window steps (default 5) reaches
--target (default 0.4). Steps to target is the first step where it does; wall to target the summed step
times up to it, from the first step's start (setup excluded: model loading, Ray, actors, the version-0
evaluation). asyncrl's steps are its Controller's windows (`time/step_s`: they tile the loop) and its
held-out evaluation runs only at the last step (trainer.eval_every = --steps), after the target in the runs
that reach it; the sync loop's held-out greedy reward (the first `trainer.eval_prompts` eval rows, greedy,
2 tokens, as asyncrl's evaluator) is measured after its timed steps and printed as a check that it learns.

The floor (printed per run): G_alone = one step's generation (16 prompts x 8) by asyncrl's own engine
(`TorchEngine`) alone in this process, T_alone = asyncrl's `Learner.update` of one step's groups alone, each
at its role's torch threads (`cluster.torch_threads`; "auto" as asyncrl/deploy/auto.py decides it), each the median
of --floor-reps timed calls after a warm-up. An asynchronous step cannot be shorter than max(G_alone, T_alone);
the run's median step time as a multiple of it (target <= 1.1) says how much per-step overhead the runtime adds.
Beside it, for asyncrl's runs, the CPU floor (`cpu_floor`): the CPU seconds every process of the run spent in a
step (the sum of the row's `<process>/cpu_cores` times `time/step_s`: trainer, generators, buffer, scorers, the
driver; in process the one process's), over the cores the run may use, median over the steps after the first. A
step cannot be shorter either: `step / CPU floor` near 1 says the run keeps the cores busy and its step is bound
by all the work its processes do (the roles' own and the runtime's), not by waiting.

The JSON line: value = the median wall to target of `asyncrl launch` on Ray (with --no-ray, of --local),
baseline = the sync loop's, ratio = sync / asyncrl, target 1.5 (asyncrl in <= 0.67x the sync loop's time);
`step_over_cpu_floor`: that side's median step / CPU floor. A
run that misses the target within --steps counts as infinitely slow in the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "first_digit" / "config.toml"


# ------------------------------------------------------------------------------------------ the target


def to_target(rewards: list[float], step_s: list[float], target: float, window: int) -> tuple[int | None, float | None]:
    """(steps, wall seconds) until the moving mean of the last `window` rewards first reaches `target`;
    (None, None) when it never does. Before `window` steps the mean is over the steps so far."""
    for k in range(1, len(rewards) + 1):
        last = rewards[max(0, k - window):k]
        if sum(last) / len(last) >= target:
            return k, sum(step_s[:k])
    return None, None


def median_or_inf(values: list[float | None]) -> float:
    """The median, a missed target (None) counting as infinitely slow."""
    return statistics.median([math.inf if v is None else v for v in values]) if values else math.nan


# ------------------------------------------------------------------------------------------ the sync loop


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[B] rewards of consecutive groups -> [B] (r - group mean) / (unbiased group std + eps); 0 for a group
    whose rewards are all equal (no learning signal, and no ±1 out of rounding)."""
    r = rewards.double().view(-1, group_size)
    mean, std = r.mean(dim=1, keepdim=True), r.std(dim=1, keepdim=True)
    adv = (r - mean) / (std + eps)
    informative = (r.amax(dim=1, keepdim=True) > r.amin(dim=1, keepdim=True))
    return torch.where(informative, adv, torch.zeros_like(adv)).view(-1).float()


class SyncLoop:
    """generate -> score -> one forward/backward/AdamW step, every phase on the same torch threads (the faster
    of `threads` in the warm-up)."""

    def __init__(self, cfg, seed: int, threads: list[int]) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.data.rows import load_rows
        from asyncrl.rewards import call_reward
        from asyncrl.rewards.rules import RULES

        torch.set_num_threads(threads[0])
        self.cfg, t = cfg, cfg.trainer
        self.tok = AutoTokenizer.from_pretrained(cfg.model.path)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=tuple(t.betas),
                                     weight_decay=t.weight_decay)
        rule = RULES.get(cfg.reward.fn)(cfg.reward.answer_key)
        self.reward = lambda row, text: float(call_reward(rule, row["prompt"], text, row))
        self.rows = load_rows(cfg.data, "train", seed)
        random.Random(seed).shuffle(self.rows)
        self.eval_rows = load_rows(cfg.data, "eval", seed)[:t.eval_prompts]
        self.eos = self.tok.eos_token_id
        self.cursor = 0
        self.threads = self.warm_up(threads)
        torch.set_num_threads(self.threads)
        torch.manual_seed(seed)  # after the warm-up: the run's samples do not depend on it

    def _generate(self, model, prompts: list[str], n: int, greedy: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Left-padded prompts, each repeated n times -> (sequences [B, P + new], attention mask, P)."""
        self.tok.padding_side = "left"
        enc = self.tok([p for p in prompts for _ in range(n)], return_tensors="pt", padding=True,
                       add_special_tokens=False)
        r = self.cfg.rollout
        with torch.no_grad():
            seqs = model.generate(**enc, do_sample=not greedy, temperature=None if greedy else r.temperature,
                                       top_k=None, top_p=None, max_new_tokens=r.max_new_tokens,
                                       eos_token_id=self.eos, pad_token_id=self.tok.pad_token_id)
        return seqs, enc["attention_mask"], enc["input_ids"].shape[1]

    def _responses(self, seqs: torch.Tensor, plen: int) -> tuple[torch.Tensor, list[str]]:
        """The loss mask [B, new] (response tokens up to and including the first eos) and the decoded texts."""
        resp = seqs[:, plen:]
        is_eos = resp == self.eos
        after_eos = (is_eos.cumsum(dim=1) - is_eos.int()) > 0
        mask = ~after_eos
        texts = [self.tok.decode(ids[m], skip_special_tokens=True) for ids, m in zip(resp, mask)]
        return mask, texts

    def warm_up(self, candidates: list[int], reps: int = 3) -> int:
        """Untimed steps on a copy of the model (forgotten after): the first `generate`, backward and AdamW
        step of a process pay one-time costs (lazy imports, allocator growth) that are setup, as asyncrl's
        are. With several thread counts, `reps` steps at each and the fastest is returned: the best plain
        loop picks its threads (on a busy machine all cores can be many times slower than one)."""
        model = copy.deepcopy(self.model)
        opt = torch.optim.AdamW(model.parameters(), lr=self.cfg.trainer.lr)
        rows = self.rows[:self.cfg.trainer.prompts_per_step]
        self._train_step(model, opt, rows)
        if len(candidates) == 1:
            return candidates[0]
        times = {}
        for n in candidates:
            torch.set_num_threads(n)
            times[n] = statistics.median(self._train_step(model, opt, rows)["step_s"] for _ in range(reps))
        return min(times, key=times.__getitem__)

    def step(self) -> dict[str, float]:
        """One train step on the next prompts; its reward and the seconds of generation + scoring and of training."""
        k = self.cfg.trainer.prompts_per_step
        rows = [self.rows[(self.cursor + i) % len(self.rows)] for i in range(k)]
        self.cursor += k
        return self._train_step(self.model, self.opt, rows)

    def _train_step(self, model, opt, rows: list[dict]) -> dict[str, float]:
        t, n = self.cfg.trainer, self.cfg.rollout.group_size
        t0 = time.perf_counter()
        seqs, prompt_mask, plen = self._generate(model, [r["prompt"] for r in rows], n, greedy=False)
        mask, texts = self._responses(seqs, plen)
        rewards = torch.tensor([self.reward(rows[i // n], text) for i, text in enumerate(texts)])
        t1 = time.perf_counter()
        adv = grpo_advantages(rewards, n)
        attn = torch.cat([prompt_mask, mask.long()], dim=1)
        logits = model(input_ids=seqs, attention_mask=attn).logits[:, plen - 1:-1].float()
        logits = logits / self.cfg.rollout.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, plen:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # on-policy: the old policy is this one (module docstring)
        eps = self.cfg.algorithm.clip_eps
        a = adv[:, None]
        loss_tok = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        loss = (loss_tok * mask).sum() / mask.sum().clamp(min=1)  # token-mean
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        t2 = time.perf_counter()
        return {"reward": float(rewards.mean()), "gen_s": t1 - t0, "train_s": t2 - t1, "step_s": t2 - t0}

    def evaluate(self) -> float:
        """Held-out greedy reward, as asyncrl's evaluator measures it."""
        seqs, _, plen = self._generate(self.model, [r["prompt"] for r in self.eval_rows], 1, greedy=True)
        _, texts = self._responses(seqs, plen)
        return statistics.mean(self.reward(r, text) for r, text in zip(self.eval_rows, texts))


def run_sync(cfg, seed: int, args: argparse.Namespace) -> dict:
    loop = SyncLoop(cfg, seed, args.threads)
    steps = []
    for _ in range(args.steps):
        steps.append(loop.step())
        k, _ = to_target([s["reward"] for s in steps], [s["step_s"] for s in steps], args.target, args.window)
        if k is not None and not args.full:
            break  # the target is what is timed; --full trains every step (for the curve)
    out = summarise([s["reward"] for s in steps], [s["step_s"] for s in steps], args)
    out["gen_s"] = statistics.median(s["gen_s"] for s in steps)
    out["train_s"] = statistics.median(s["train_s"] for s in steps)
    out["eval_greedy"] = loop.evaluate()
    out["threads"] = loop.threads
    return out


def summarise(rewards: list[float], step_s: list[float], args: argparse.Namespace) -> dict:
    k, wall = to_target(rewards, step_s, args.target, args.window)
    return {"steps_to_target": k, "wall_to_target": wall, "step_s": statistics.median(step_s),
            "steps": len(step_s), "final_reward": statistics.mean(rewards[-args.window:])}


# ------------------------------------------------------------------------------------------ asyncrl launch


def launch_overrides(args: argparse.Namespace, model_dir: Path, seed: int) -> list[str]:
    return [f"model.path={json.dumps(str(model_dir))}", f"run.seed={seed}", f"trainer.total_steps={args.steps}",
            f"trainer.eval_every={args.steps}", "run.save_checkpoint=false", "run.save_every_s=0", "logging.live=false",
            *args.sets]


def run_launch(args: argparse.Namespace, root: Path, model_dir: Path, seed: int, local: bool) -> dict:
    """`asyncrl launch` (Ray, or --local) as a subprocess; its metrics.jsonl summarised."""
    name = f"{'local' if local else 'ray'}-{seed}"
    run_dir = root / name
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", str(EXAMPLE)]
    for o in [*launch_overrides(args, model_dir, seed), f"run.output_dir={json.dumps(str(run_dir))}"]:
        cmd += ["--set", o]
    if local:
        cmd.append("--local")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "RAY_worker_niceness": "0"}  # Ray's workers at the driver's priority (see overlap.py)
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if isinstance(r.get("reward/mean"), (int, float))]
    out = summarise([r["reward/mean"] for r in steps], [r["time/step_s"] for r in steps], args)
    from asyncrl.deploy.auto import available_cpus

    out["cpu_floor"] = cpu_floor(steps, len(available_cpus()))
    evals = [r["eval/greedy_reward"] for r in rows if "eval/greedy_reward" in r]
    out["eval_greedy"] = evals[-1] if evals else math.nan
    out["command_s"] = time.time() - t0
    return out


def cpu_floor(rows: list[dict], cores: int) -> float:
    """The CPU seconds all of a run's processes spent in a step (each row's `<process>/cpu_cores` summed, times its
    `time/step_s`) over `cores`: median over the rows after the first (the processes' first reports only set
    their marks). NaN without such rows."""
    per_step = [sum(v for k, v in r.items() if k.count("/") == 1 and k.endswith("/cpu_cores")) * r["time/step_s"]
                for r in rows[1:] if "controller/cpu_cores" in r]
    return statistics.median(per_step) / cores if per_step else math.nan


# ------------------------------------------------------------------------------------------ the floor


def role_threads(cfg) -> tuple[int, int]:
    """The generator's and the trainer's torch threads in a Ray run of `cfg` on this machine (cluster.torch_threads;
    "auto": asyncrl/deploy/auto.py, on the CPUs the automatic affinity gives each role)."""
    from asyncrl.deploy.auto import available_cpus, decide_threads, resolve_ray

    placed = resolve_ray(cfg)
    return tuple(decide_threads(placed, len(getattr(placed.cluster.affinity, role)) or len(available_cpus()), role)
                 for role in ("generator", "trainer"))


def measure_floor(cfg, reps: int) -> dict[str, float]:
    """G_alone, T_alone: asyncrl's engine and Learner on one step's batch, each alone at its role's threads."""
    from asyncrl.data.rows import load_rows
    from asyncrl.deploy.auto import set_torch_threads
    from asyncrl.deploy.build import build_learner, derive_seed, training_sampling
    from asyncrl.messages import Group, Trajectory
    from asyncrl.rewards import call_reward
    from asyncrl.rewards.rules import RULES
    from engines.base import create_engine
    from engines.hf import load_model, load_tokenizer

    gen_threads, train_threads = role_threads(cfg)
    set_torch_threads(gen_threads)  # the engine's loop keeps the count it is created with
    tok = load_tokenizer(cfg.model.path)
    engine = create_engine("torch", model_path=cfg.model.path, dtype=cfg.model.dtype,
                           max_prompt_len=cfg.data.max_prompt_len, seed=derive_seed(cfg.run.seed, "floor"))
    set_torch_threads(train_threads)  # this thread runs the updates
    learner = build_learner(cfg, load_model(cfg.model.path, dtype=cfg.model.dtype), tok.pad_token_id or 0)
    reward = RULES.get(cfg.reward.fn)(cfg.reward.answer_key)
    rows = load_rows(cfg.data, "train", cfg.run.seed)[:cfg.trainer.prompts_per_step]
    prompts = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    params = training_sampling(cfg)

    def groups_of(out) -> list[Group]:
        groups = []
        for g, (row, comps) in enumerate(zip(rows, out)):
            trajs = [Trajectory(seq_id=g * params.n + j, group_id=g, group_size=params.n, prompt_ids=c.prompt_ids,
                                response_ids=c.response_ids, loss_mask=[True] * len(c.response_ids),
                                behavior_logprobs=c.logprobs, versions=c.versions, min_version=0, max_version=0,
                                finish_reason=c.finish_reason, temperature=params.temperature,
                                reward=float(call_reward(reward, row["prompt"],
                                                         tok.decode(c.response_ids, skip_special_tokens=True), row)))
                     for j, c in enumerate(comps)]
            groups.append(Group(group_id=g, min_version=0, trajectories=trajs))
        return groups

    gen_times, train_times = [], []
    for i in range(reps + 1):  # the first of each is a warm-up
        t0 = time.perf_counter()
        out = asyncio.run(engine.generate(prompts, params))
        t1 = time.perf_counter()
        groups = groups_of(out)
        t2 = time.perf_counter()
        learner.update(groups)
        t3 = time.perf_counter()
        if i:
            gen_times.append(t1 - t0)
            train_times.append(t3 - t2)
    g, t = statistics.median(gen_times), statistics.median(train_times)
    return {"G_alone": g, "T_alone": t, "floor": max(g, t)}


# ------------------------------------------------------------------------------------------ main


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(results: dict[str, list[dict]]) -> None:
    print("| side | seed | steps to target | wall to target s | s/step (median) | step / floor | CPU floor s | "
          "step / CPU floor | final moving reward | held-out greedy | gen s | train s | threads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for side, runs in results.items():
        for seed, r in enumerate(runs):
            cpu = r.get("cpu_floor", math.nan)
            print(f"| {side} | {r['seed']} | {fmt(r['steps_to_target'], 'd')} | {fmt(r['wall_to_target'])} | "
                  f"{r['step_s']:.3f} | {r['step_s'] / r['floor']:.2f} | {fmt(cpu, '.3f')} | "
                  f"{fmt(r['step_s'] / cpu if cpu > 0 else math.nan)} | {r['final_reward']:.2f} | "
                  f"{fmt(r['eval_greedy'])} | {fmt(r.get('gen_s'), '.3f')} | {fmt(r.get('train_s'), '.3f')} | "
                  f"{r.get('threads', '-')} |")
    print()
    for side, runs in results.items():
        print(f"{side}: median steps to target {fmt(median_or_inf([r['steps_to_target'] for r in runs]), '.0f')}, "
              f"median wall to target {fmt(median_or_inf([r['wall_to_target'] for r in runs]))} s, "
              f"median s/step {statistics.median(r['step_s'] for r in runs):.3f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="runs per side (run.seed 0..N-1)")
    ap.add_argument("--steps", type=int, default=80, help="train steps at most (asyncrl's trainer.total_steps)")
    ap.add_argument("--target", type=float, default=0.4, help="moving-mean training reward to reach")
    ap.add_argument("--window", type=int, default=5, help="steps in the moving mean")
    ap.add_argument("--threads", default="auto",
                    help="torch threads of the sync loop: a number, or auto (the faster of 1 and all cores, "
                    "timed in its warm-up)")
    ap.add_argument("--floor-reps", type=int, default=7, help="timed calls per floor figure (median)")
    ap.add_argument("--no-ray", dest="ray", action="store_false", help="leave out the Ray runs")
    ap.add_argument("--full", action="store_true", help="the sync loop trains all --steps (default: stops at target)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 3 steps, target 0: a smoke run, no figures")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every side, e.g. trainer.lr=1e-3 (repeatable)")
    ap.add_argument("--out", default=None, help="keep the model and run directories here")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.target, args.window, args.floor_reps = 1, 3, 0.0, 1, 1
    if args.seeds < 1 or args.steps < 1 or args.window < 1 or args.floor_reps < 1:
        ap.error("--seeds, --steps, --window and --floor-reps must be >= 1")
    cores = os.cpu_count() or 1
    if args.threads == "auto":
        args.threads = sorted({1, cores})
    elif args.threads.isdigit() and int(args.threads) >= 1:
        args.threads = [int(args.threads)]
    else:
        ap.error(f"--threads {args.threads!r}: give a number >= 1 or auto")
    from asyncrl.config import load_config
    from engines.hf import ensure_model

    threads = torch.get_num_threads()
    results: dict[str, list[dict]] = {"sync": []}
    if args.ray:
        results["asyncrl-ray"] = []
    results["asyncrl-local"] = []
    floors: list[dict[str, float]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="vs-sync-") as tmp:
            root = Path(args.out or tmp).resolve()
            root.mkdir(parents=True, exist_ok=True)
            model_dir = root / "model"
            base = load_config(EXAMPLE, launch_overrides(args, model_dir, 0))
            ensure_model(base.model)
            for seed in range(args.seeds):  # the sides alternate within a seed: a drift of the machine's speed
                cfg = load_config(EXAMPLE, launch_overrides(args, model_dir, seed))  # favours none of them
                # the floor beside each seed's runs: on a shared machine it moved 0.05-0.17 s within minutes
                floor = measure_floor(cfg, args.floor_reps)
                floors.append(floor)
                results["sync"].append({"seed": seed, **floor, **run_sync(cfg, seed, args)})
                torch.set_num_threads(threads)
                if args.ray:
                    results["asyncrl-ray"].append({"seed": seed, **floor,
                                                   **run_launch(args, root, model_dir, seed, False)})
                results["asyncrl-local"].append({"seed": seed, **floor,
                                                 **run_launch(args, root, model_dir, seed, True)})
    finally:
        torch.set_num_threads(threads)
    print(f"workload: {EXAMPLE.relative_to(ROOT)} ({base.trainer.prompts_per_step} prompts x "
          f"{base.rollout.group_size} samples, {base.rollout.max_new_tokens} new tokens per step); up to "
          f"{args.steps} steps; target: moving mean of the training reward over {args.window} steps >= {args.target}; "
          f"sync loop threads: the faster of {args.threads} in its warm-up (per run below), asyncrl roles on "
          f"cluster.torch_threads = {base.cluster.torch_threads} (generator, trainer: {role_threads(base)})"
          + (f"; overrides {args.sets}" if args.sets else ""))
    for seed, f in enumerate(floors):
        print(f"floor (seed {seed}): G_alone {f['G_alone']:.3f} s, T_alone {f['T_alone']:.3f} s, "
              f"max(G_alone, T_alone) = {f['floor']:.3f} s (median of {args.floor_reps})")
    print()
    print_table(results)
    side = "asyncrl-ray" if args.ray else "asyncrl-local"
    value = median_or_inf([r["wall_to_target"] for r in results[side]])
    baseline = median_or_inf([r["wall_to_target"] for r in results["sync"]])
    ratio = baseline / value if value > 0 and math.isfinite(value) else 0.0
    over_cpu = statistics.median(r["step_s"] / r["cpu_floor"] if r["cpu_floor"] > 0 else math.nan
                                 for r in results[side])
    print(f"{side} median of step / floor: {statistics.median(r['step_s'] / r['floor'] for r in results[side]):.2f} "
          f"(target <= 1.1), of step / CPU floor: {over_cpu:.2f}; sync / {side} wall to target: {ratio:.2f} "
          f"(target >= 1.5)")
    result = {"benchmark": "vs_sync_loop", "value": round(value, 3) if math.isfinite(value) else None, "unit": "s",
              "baseline": round(baseline, 3) if math.isfinite(baseline) else None, "ratio": round(ratio, 3),
              "target": 1.5, "step_over_cpu_floor": round(over_cpu, 3) if math.isfinite(over_cpu) else None}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
