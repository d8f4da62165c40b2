"""Generation tokens/s and train-step time of a Qwen2-0.5B-shaped model on one GPU, with and without colocation.

    python benchmarks/gpu_throughput.py [--device cuda] [--batch 64] [--new-tokens 256] [--prompt-len 128]
                                        [--repeats 3] [--micro-batch 16] [--quick]

Issue 18: what one GPU gives asyncrl's own engine and learner, measured in one run (.device/check.sh runs it
on a lent H200). The model is a random-initialised Qwen2 of Qwen2-0.5B's shape (hidden 896, 24 layers, 14
heads / 2 KV heads, MLP 4864, vocab 151936, embedding tied to the LM head: 494M parameters), written offline
into a temporary folder with the character tokenizer of engines/hf.py, and loaded from there in bfloat16
like any checkpoint.

What is timed, in this order:

A. generation: `TorchEngine.generate` of B prompts (`--prompt-len` random ids each), `--new-tokens` sampled
   per prompt with `ignore_eos` (so every sequence has exactly that many), at batch B and at batch 1 (the
   baseline). Tokens / wall time of one call, prefill included; median of R calls after a warm-up call (which
   captures the CUDA graphs); `torch.cuda.synchronize()` before the clock stops.
B. train step, colocated: `Learner.update` over the B completions of A (GRPO, PPO-clip, groups of
   `--group-size`, rewards drawn 0/1) with the engine alive in this process on the same GPU. Where the engine
   has `sleep()` and `wake()`, it sleeps before the step and wakes after it (both timed); then `load_weights`
   hands the new weights to the engine (the in-process hand-over, timed), and the engine generates the next
   batch (timed: after a sleep, that call allocates the cache and captures the graphs again; compare it with
   A's figure). Median of R cycles after a warm-up step.
   (An in-process run whose engine has the trainer's device and dtype wraps the trainer's module instead,
   asyncrl/deploy/local.py: no hand-over at all; the engine here owns a copy, as with mixed precision or another dtype.)
C. train step, trainer alone: the same steps once the engine is closed and its memory freed (the
   disaggregated case: the trainer has the GPU to itself). Median of R steps.

The learner is built as asyncrl/deploy/build.py `build_learner` builds it for GRPO (no critic, no reference):
`Learner(model, algorithm, trainer, pad_token_id, max_new_tokens, device)` over the model loaded in bfloat16
(parameters and AdamW state in bfloat16); `--mixed-precision` loads it in float32 instead and trains with
`trainer.mixed_precision = "bf16"` (float32 master weights and AdamW state, forwards under bfloat16 autocast).
Peak GPU memory of each section is printed (`torch.cuda.max_memory_allocated`).

The last line of output is one JSON object: value = generation tokens/s at batch B, baseline = the same
engine's tokens/s at batch 1 in the same run, ratio = value / baseline. Target 32: decoding a 0.5B model on a
GPU is bound by reading the weights and by per-step overheads, not by arithmetic, so a decode step of 64 rows
should cost at most twice a step of one row; 64 rows in at most 2x the time is 32x the tokens/s.
`--quick` runs a 2-layer hidden-32 model on the CPU (a smoke run for tests/unit/test_gpu_throughput_benchmark.py;
its figures say nothing about the target).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.config.schema import AlgorithmConfig, TrainerConfig
from asyncrl.messages import Completion, Group, SamplingParams, Trajectory
from asyncrl.training.learner import Learner
from engines import hf
from engines.torch_engine import TorchEngine

TARGET = 32.0
VOCAB_TEXT = "0123456789+-*=?, abcdefghijklmnopqrstuvwxyz"  # the tokenizer's; the model's vocab is larger


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


QWEN2_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
QUICK = Shape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=256)


def write_model(path: Path, shape: Shape, device: str, dtype: torch.dtype) -> None:
    """A random Qwen2 of `shape` (tied embedding, as Qwen2-0.5B) and the character tokenizer, into `path`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" is clutter in a benchmark's output

    def write(tmp: Path) -> None:
        config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                             num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                             num_key_value_heads=shape.kv_heads, max_position_embeddings=32768,
                             tie_word_embeddings=True, pad_token_id=hf.PAD_ID, bos_token_id=hf.BOS_ID,
                             eos_token_id=hf.EOS_ID)
        torch.manual_seed(0)
        with torch.device(device):  # initialising 494M parameters is seconds on a GPU, a minute on a CPU
            model = Qwen2ForCausalLM(config).to(dtype)
        model.generation_config = GenerationConfig(eos_token_id=hf.EOS_ID, pad_token_id=hf.PAD_ID,
                                                   bos_token_id=hf.BOS_ID)
        model.to("cpu").save_pretrained(tmp)
        hf.build_char_tokenizer(VOCAB_TEXT).save_pretrained(tmp)

    hf.write_model_folder(path, write)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call(result):
    """The value of an engine method that may be sync or async (sleep / wake, whoever adds them)."""
    return asyncio.run(result) if inspect.isawaitable(result) else result


def peak_gb(device: torch.device) -> str:
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else "n/a (CPU)"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---- A. generation ---------------------------------------------------------------------------------------

def generate(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[Completion]]:
    """(seconds, completions) of one call; every completion has exactly `new_tokens` tokens."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    groups = asyncio.run(engine.generate(prompts, params))
    sync(engine.device)
    seconds = time.perf_counter() - t0
    completions = [c for group in groups for c in group]
    if any(len(c.response_ids) != new_tokens for c in completions):
        raise RuntimeError(f"a completion has not {new_tokens} tokens: the figures would be wrong")
    return seconds, completions


def generation(engine: TorchEngine, prompts: list[list[int]], new_tokens: int,
               repeats: int) -> tuple[dict[int, float], list[Completion]]:
    """{batch: median tokens/s} at len(prompts) and 1; the completions of the last full-batch call."""
    results: dict[int, float] = {}
    completions: list[Completion] = []
    print(f"\nA. generation: {new_tokens} new tokens per prompt of {len(prompts[0])} tokens, ignore_eos, "
          f"temperature 1; median of {repeats} after a warm-up")
    print(f"{'batch':>6} | {'tokens':>7} | {'median s':>9} | {'tokens/s':>10} | decode step (engine record)")
    for batch in (len(prompts), 1):
        part = prompts[:batch]
        generate(engine, part, new_tokens)  # warm-up: captures the CUDA graphs of this batch's buckets
        times = []
        decodes0 = engine.num_decode_forwards
        for _ in range(repeats):
            seconds, done = generate(engine, part, new_tokens)
            times.append(seconds)
            if batch == len(prompts):
                completions = done
        decodes = engine.num_decode_forwards - decodes0  # the step record keeps the last 4096 steps
        step_times = list(engine.scheduler.step_times_s)[-decodes:] if decodes else []
        step = f"{statistics.median(step_times) * 1e3:.2f} ms" if step_times else "n/a"
        tokens = batch * new_tokens
        results[batch] = tokens / statistics.median(times)
        print(f"{batch:>6} | {tokens:>7} | {statistics.median(times):>9.3f} | {results[batch]:>10.0f} | {step}")
    return results, completions


# ---- B and C. train steps --------------------------------------------------------------------------------

def train_groups(completions: list[Completion], group_size: int, seed: int) -> list[Group]:
    """The completions as scored groups of `group_size` (rewards drawn 0/1, so advantages are not all 0)."""
    rng = random.Random(seed)
    groups = []
    for gid, start in enumerate(range(0, len(completions), group_size)):
        members = []
        for i, c in enumerate(completions[start : start + group_size]):
            members.append(Trajectory(
                seq_id=start + i, group_id=gid, group_size=group_size, prompt_ids=c.prompt_ids,
                response_ids=c.response_ids, loss_mask=[True] * len(c.response_ids), behavior_logprobs=c.logprobs,
                versions=c.versions, min_version=min(c.versions), max_version=max(c.versions),
                finish_reason=c.finish_reason, truncated=c.finish_reason == "length", temperature=1.0,
                reward=float(rng.random() < 0.5)))
        groups.append(Group(group_id=gid, min_version=min(t.min_version for t in members), trajectories=members))
    return groups


def build_learner(path: str, device: torch.device, dtype: str, micro_batch: int, new_tokens: int,
                  mixed_precision: bool) -> Learner:
    """As asyncrl/deploy/build.py builds the policy learner for GRPO (no critic, reference or multiplier); with
    `mixed_precision` the model loads in float32 (master weights) and trains under bfloat16 autocast."""
    model = hf.load_model(path, dtype="float32" if mixed_precision else dtype, device=device)
    trainer = TrainerConfig(lr=1e-6, micro_batch_size=micro_batch, grad_clip=1.0,
                            mixed_precision="bf16" if mixed_precision else "no")
    algorithm = AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip", loss_agg="token-mean")
    return Learner(model, algorithm=algorithm, trainer=trainer, pad_token_id=hf.PAD_ID, max_new_tokens=new_tokens,
                   device=device)


def step(learner: Learner, groups: list[Group]) -> float:
    sync(learner.device)
    t0 = time.perf_counter()
    learner.update(groups)
    sync(learner.device)
    return time.perf_counter() - t0


def colocated_steps(learner: Learner, engine: TorchEngine, groups: list[Group], repeats: int,
                    prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Colocated cycles with the engine alive beside the learner: sleep, step, wake, hand the weights over, and
    the next batch's generation (after a sleep it allocates the cache and captures its graphs again)."""
    sleeps = hasattr(engine, "sleep") and hasattr(engine, "wake")
    times: dict[str, list[float]] = {"sleep": [], "step": [], "wake": [], "load_weights": [], "generate": []}
    for _ in range(repeats):
        if sleeps:
            t0 = time.perf_counter()
            call(engine.sleep())
            sync(engine.device)
            times["sleep"].append(time.perf_counter() - t0)
        times["step"].append(step(learner, groups))
        if sleeps:
            t0 = time.perf_counter()
            call(engine.wake())
            sync(engine.device)
            times["wake"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.load_weights(learner.state_dict_for_sync(), version=learner.version)
        sync(engine.device)
        times["load_weights"].append(time.perf_counter() - t0)
        times["generate"].append(generate(engine, prompts, new_tokens)[0])
    if not sleeps:
        print("   (this engine has no sleep()/wake(): its weights and KV cache stay in memory during the step)")
    return {k: statistics.median(v) for k, v in times.items() if v}


def training(path: str, engine: TorchEngine, completions: list[Completion], args: argparse.Namespace,
             device: torch.device, prompts: list[list[int]]) -> tuple[float, float]:
    """(colocated median step s, alone median step s); closes the engine."""
    groups = train_groups(completions, args.group_size, seed=0)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)
    learner = build_learner(path, device, args.dtype, args.micro_batch, args.new_tokens, args.mixed_precision)
    numerics = ("float32 master weights and AdamW state, bfloat16 autocast (trainer.mixed_precision = 'bf16')"
                if args.mixed_precision else f"{args.dtype} parameters and AdamW state")
    print(f"\nB. train step, colocated: {len(completions)} samples in {len(groups)} groups, {tokens} tokens, "
          f"micro-batches of {args.micro_batch}, {numerics}; median of {args.repeats} after a warm-up step")
    reset_peak(device)
    warm = step(learner, groups)
    colocated = colocated_steps(learner, engine, groups, args.repeats, prompts, args.new_tokens)
    print(f"   warm-up step {warm:.3f} s; " + ", ".join(f"{k} {v:.3f} s" for k, v in colocated.items())
          + f"; peak GPU memory {peak_gb(device)}")
    asyncio.run(engine.close())
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"   engine closed: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB still allocated (the learner)")
    reset_peak(device)
    alone = [step(learner, groups) for _ in range(args.repeats)]
    print(f"\nC. train step, trainer alone: median {statistics.median(alone):.3f} s "
          f"({tokens / statistics.median(alone):.0f} tokens/s); peak GPU memory {peak_gb(device)}")
    return colocated["step"], statistics.median(alone)


# ---- main -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2-layer hidden-32 model, batch 4, 8 tokens, on the CPU")
    ap.add_argument("--device", default=None, help="cuda[:i] or cpu (default: cuda, or cpu with --quick)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, default=None, help="prompts per generate call and samples per step (64)")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (128)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (256)")
    ap.add_argument("--group-size", type=int, default=None, help="samples per GRPO group in the train batch (8)")
    ap.add_argument("--micro-batch", type=int, default=None, help="samples per forward/backward (16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls / steps per figure (median; 3)")
    ap.add_argument("--mixed-precision", action="store_true",
                    help="train with trainer.mixed_precision = 'bf16' (float32 master weights) instead of bf16 ones")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = dict(batch=4, prompt_len=8, new_tokens=8, group_size=2, micro_batch=2, repeats=1) if quick else \
        dict(batch=64, prompt_len=128, new_tokens=256, group_size=8, micro_batch=16, repeats=3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device or ("cpu" if quick else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_throughput: no CUDA device here; use --quick (CPU) or run it on a GPU machine")
    shape = QUICK if quick else QWEN2_05B
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as tmp:
        path = str(Path(tmp) / "model")
        t0 = time.perf_counter()
        write_model(Path(path), shape, str(device), hf.torch_dtype(args.dtype))
        engine = TorchEngine(path, dtype=args.dtype, device=str(device), max_prompt_len=args.prompt_len, seed=0,
                             max_batch=args.batch)
        params = sum(p.numel() for p in engine.model.parameters())
        print(f"model: random Qwen2, hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / "
              f"{shape.kv_heads} kv heads, MLP {shape.intermediate}, vocab {shape.vocab}: {params:,} "
              f"parameters, {args.dtype}; written and loaded in {time.perf_counter() - t0:.1f} s")
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"device: {where}; torch {torch.__version__}; engine fast path {engine.fast}, decode graphs "
              f"{engine.scheduler.backend.graphs if engine.fast else 'n/a'}")
        rng = random.Random(0)
        first = len(hf.SPECIAL_TOKENS)
        prompts = [[rng.randrange(first, shape.vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        reset_peak(device)
        tps, completions = generation(engine, prompts, args.new_tokens, args.repeats)
        print(f"   peak GPU memory {peak_gb(device)}")
        colocated, alone = training(path, engine, completions, args, device, prompts)

    value, baseline = tps[args.batch], tps[1]
    print(f"\nbatch {args.batch}: {value:.0f} tokens/s vs batch 1: {baseline:.0f} tokens/s = {value / baseline:.1f}x "
          f"(target {TARGET:g}x); train step {colocated:.3f} s colocated, {alone:.3f} s alone "
          f"({colocated / alone:.2f}x)")
    result = {"benchmark": "gpu_throughput" if device.type == "cuda" else "gpu_throughput_cpu",
              "value": round(value, 1), "unit": "tokens/s", "baseline": round(baseline, 1),
              "ratio": round(value / baseline, 3), "target": TARGET}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
