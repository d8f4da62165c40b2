"""Native `TorchEngine` vs Hugging Face `generate`: tokens/s, arrivals over time, one in-flight weight swap.

    python benchmarks/engine_throughput.py [--quick] [--threads N] [--repeats R] [--model bench|example]
                                           [--device cpu|cuda] [--no-cuda-graphs]

Goals: the native engine at least 2x HF `generate` at batch 32 on a CPU (issue 21), 3x on an accelerator
(issue 3), its decode step within 1.5x of its floor (`decode_floor`). The script measures, in one run:

| section | native engine | baseline |
|---|---|---|
| A. batches 1, 8, 32, 64 | one `generate` call of B prompts | one HF `generate` of the same prompts |
| B. 64 requests over time | a concurrent `generate` per request, at its arrival | a static batcher over HF `generate` |
| C. weight-update stall | `load_weights` from a thread mid-way through a batch-32 decode | mean decode step time |

Fairness rules (a benchmark that measures the wrong thing is a defect):
* One tiny random fp32 model, its size printed, written offline with `engines.hf.build_tiny_model`;
  each side loads its own copy from that folder. Same `torch.set_num_threads(N)` for both.
* Same prompts: random ids of a fixed length that exclude the special ids. Same sampling: temperature
  1 over the full vocabulary (HF top_k=None, top_p=1; native top_k=-1, top_p=1).
* Equal token counts by ignoring EOS on both sides: HF `eos_token_id=None` (no stopping criterion, the
  distribution is untouched, unlike `min_new_tokens`), native engine built with `eos_token_ids=[]`.
  The counts are checked equal and printed; an unequal count aborts the run.
* HF `generate` runs as a user would batch it: left padding, attention mask, `use_cache=True` (its
  default DynamicCache), under `torch.inference_mode()` like the engine.
* A warm-up run of each side at each shape is excluded; each timed figure is the median of R runs, and
  HF and native runs alternate so background load hits both alike.
* Workload B's baseline is what a static batcher must do: take the requests that have arrived (arrival
  order, up to 32), pad them, run all to the batch's longest max_new_tokens, then take the next batch.
  Only requested tokens count as useful; both sides' clocks start at the first arrival.

On a CUDA device (`--device cuda`) both sides run there, in fp32, and every timed call ends with
`torch.cuda.synchronize()`; the native engine replays one CUDA graph per decode step (its default on
CUDA; `--no-cuda-graphs` measures it launching every kernel, as HF does).

The last line of output is one JSON object: native tok/s at batch 32 vs HF at batch 32 (target 2.0 on a
CPU, 3.0 on an accelerator), with the batch-32 decode step, its floor, their ratio and `ratio_at_floor`
(the ratio were every decode step at its floor, the time outside the decode steps unchanged).
Attributes that only the continuous-batching engine has (decode batch sizes, step times, swap pauses)
are read with getattr, on the engine or its `scheduler`; without them the script falls back to
counters and wall time and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncrl.config.schema import TinyModelConfig
from asyncrl.messages import SamplingParams
from engines import hf
from engines.torch_engine import TorchEngine

TEMPERATURE = 1.0


@dataclass(frozen=True)
class Settings:
    model: TinyModelConfig
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int           # L: tokens generated per sequence in sections A and C
    requests: int             # section B
    prompt_range: tuple[int, int]
    new_range: tuple[int, int]
    mean_gap_s: float         # mean inter-arrival time of section B's Poisson arrivals
    static_batch: int         # section B baseline: most requests per HF generate call
    swap_batch: int           # section C


FULL = Settings(
    model=TinyModelConfig(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=512,
                          max_positions=512, init_std=0.02),
    batches=(1, 8, 32, 64), prompt_len=32, new_tokens=64,
    requests=64, prompt_range=(8, 64), new_range=(8, 128), mean_gap_s=0.01, static_batch=32, swap_batch=32,
)
# The model the learning examples train (examples/first_digit/config.toml: 2 layers, hidden 64), with the
# default character vocabulary: the size asyncrl's own CPU runs generate with.
EXAMPLE = Settings(
    model=TinyModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
                          max_positions=512, init_std=0.02),
    batches=FULL.batches, prompt_len=FULL.prompt_len, new_tokens=FULL.new_tokens, requests=FULL.requests,
    prompt_range=FULL.prompt_range, new_range=FULL.new_range, mean_gap_s=FULL.mean_gap_s,
    static_batch=FULL.static_batch, swap_batch=FULL.swap_batch,
)
QUICK = Settings(
    model=TinyModelConfig(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64),
    batches=(1, 2), prompt_len=8, new_tokens=4,
    requests=4, prompt_range=(4, 8), new_range=(2, 6), mean_gap_s=0.002, static_batch=2, swap_batch=2,
)


def engine_attr(engine, name: str):
    """An attribute of the continuous-batching engine (on it or its scheduler), or None."""
    for owner in (engine, getattr(engine, "scheduler", None)):
        if owner is not None and hasattr(owner, name):
            return getattr(owner, name)
    return None


def random_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    first = len(hf.SPECIAL_TOKENS)  # ids below this are <pad>, <bos>, <eos>, <unk>
    return [[rng.randrange(first, vocab) for _ in range(length)] for _ in range(count)]


# ---- the two sides --------------------------------------------------------------------------------------

def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> list[int]:
    """Left-padded HF generate with EOS ignored; returns the number of new tokens of each row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), hf.PAD_ID, dtype=torch.long)
    device = model.device
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=TEMPERATURE,
            top_k=None, top_p=1.0, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=hf.PAD_ID, use_cache=True,
        )
    return [out.shape[1] - width] * len(prompts)


async def native_generate(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> list[int]:
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=new_tokens)
    groups = await engine.generate(prompts, params)
    return [len(c.response_ids) for group in groups for c in group]


def timed(fn, *args) -> tuple[float, int]:
    """(seconds, tokens) of one call; fn returns per-row token counts (or a coroutine of them)."""
    t0 = time.perf_counter()
    out = fn(*args)
    if asyncio.iscoroutine(out):
        out = asyncio.run(out)  # loop start-up is ~0.1 ms, far below any run here
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # nothing of the call may still be running on the GPU
    return time.perf_counter() - t0, sum(out)


# ---- the floor of a decode step -------------------------------------------------------------------------

def _median_s(fn, repeats: int, inner: int) -> float:
    """Median over `repeats` rounds of the mean time of `inner` calls of fn (after one warm-up round)."""
    rounds = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if r:
            rounds.append((time.perf_counter() - t0) / inner)
    return statistics.median(rounds)


def decode_floor(model, batch: int, width: int, repeats: int = 5, inner: int = 20) -> dict[str, float]:
    """Seconds of the matrix products of one decode step of `model` at `batch` rows attending over `width`
    cache positions, timed alone at their shapes with fresh weights in the model's dtype (no norms, rotary,
    cache writes, sampling or Python around them): per layer one q|k|v product (with the model's bias), the
    attention products over contiguous K/V (q·K^T, softmax, ·V, query heads of a KV head folded into one
    product, the cheapest of the ways tried on CPU), the o product, one gate|up product and the down
    product; then the LM head.
    `floor_s` runs them in the step's order (so weights and K/V compete for the caches as in the step);
    `linears_s` and `attention_s` time each kind alone (K/V then stay cache-resident: attention is cheaper
    there than in any real step). The floor is what the step cannot go below without changing the arithmetic.
    Each figure is the median of `repeats` rounds of `inner` calls."""
    cfg = model.config
    hidden, heads, kvh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or hidden // heads
    inter, layers, vocab = cfg.intermediate_size, cfg.num_hidden_layers, model.get_input_embeddings().num_embeddings
    qkv_bias = bool(getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2")
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype  # the model's own dtype
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    ws = [dict(qkv=rand((heads + 2 * kvh) * hd, hidden), qkv_b=rand((heads + 2 * kvh) * hd) if qkv_bias else None,
               o=rand(hidden, heads * hd), gate_up=rand(2 * inter, hidden), down=rand(hidden, inter),
               k=rand(batch * kvh, width, hd), v=rand(batch * kvh, width, hd)) for _ in range(layers)]
    head = rand(vocab, hidden)
    x, q = rand(batch, hidden), rand(batch * kvh, heads // kvh, hd)
    a, act = rand(batch, heads * hd), rand(batch, inter)

    def linear_products(w):
        F.linear(x, w["qkv"], w["qkv_b"])
        F.linear(a, w["o"])
        F.linear(x, w["gate_up"])
        F.linear(act, w["down"])

    def attention_products(w):
        torch.bmm(torch.bmm(q, w["k"].transpose(1, 2)).softmax(-1), w["v"])

    def step():  # in the step's order: each layer's weights and K/V stream through the caches as they do there
        for w in ws:
            linear_products(w)
            attention_products(w)
        F.linear(x, head)

    def linears():
        for w in ws:
            linear_products(w)
        F.linear(x, head)

    def attention():
        for w in ws:
            attention_products(w)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        floor = _median_s(lambda: (step(), sync()), repeats, inner)
        lin = _median_s(lambda: (linears(), sync()), repeats, inner)
        att = _median_s(lambda: (attention(), sync()), repeats, inner)
    return {"linears_s": lin, "attention_s": att, "floor_s": floor}


# ---- A. fixed batches -----------------------------------------------------------------------------------

def fixed_batches(s: Settings, model, engine, vocab: int, repeats: int) -> dict[int, dict[str, float]]:
    rng = random.Random(0)
    results = {}
    width = s.prompt_len + s.new_tokens // 2  # the mean number of cache positions a decode step attends
    print(f"\nA. fixed batches: prompt {s.prompt_len} tokens, {s.new_tokens} new tokens, median of {repeats}; "
          f"step = native decode step (forward + sampling + bookkeeping, median), floor = its matrix products "
          f"alone at width {width} (decode_floor); rest = a native call's time outside its decode steps (prefill, "
          f"admission), median; ratio@floor = the ratio were every decode step at its floor (the rest unchanged)")
    print(f"{'batch':>6} | {'tokens':>7} | {'HF tok/s':>9} | {'native tok/s':>12} | {'ratio':>6} | {'tok/fw':>6} | "
          f"{'step ms':>7} | {'floor ms':>8} | {'step/floor':>10} | {'rest ms':>7} | {'ratio@floor':>11}")
    steps = engine_attr(engine, "step_times_s")
    for batch in s.batches:
        prompts = random_prompts(rng, batch, s.prompt_len, vocab)
        timed(hf_generate, model, prompts, s.new_tokens)  # warm-up, excluded
        timed(native_generate, engine, prompts, s.new_tokens)
        hf_times, nat_times, step_s, rest_s, steps_per_call = [], [], [], [], []
        fw0, tok0 = engine.num_forwards, engine.tokens_generated
        for _ in range(repeats):  # alternate, so background load hits both sides alike
            t, hf_tokens = timed(hf_generate, model, prompts, s.new_tokens)
            hf_times.append(t)
            dec0 = engine_attr(engine, "num_decode_forwards")
            t, nat_tokens = timed(native_generate, engine, prompts, s.new_tokens)
            nat_times.append(t)
            k = engine_attr(engine, "num_decode_forwards") - dec0 if dec0 is not None else 0
            mine = list(steps)[-k:] if steps is not None and k else []
            step_s += mine
            if mine:
                rest_s.append(t - sum(mine))
                steps_per_call.append(k)
        if hf_tokens != nat_tokens or hf_tokens != batch * s.new_tokens:
            raise RuntimeError(f"batch {batch}: unequal token counts (HF {hf_tokens}, native {nat_tokens})")
        per_fw = (engine.tokens_generated - tok0) / max(1, engine.num_forwards - fw0)
        hf_tps, nat_tps = hf_tokens / statistics.median(hf_times), nat_tokens / statistics.median(nat_times)
        floor = decode_floor(model, batch, width, repeats=max(3, repeats))["floor_s"]
        step = statistics.median(step_s) if step_s else float("nan")
        rest = statistics.median(rest_s) if rest_s else float("nan")
        at_floor = statistics.median(hf_times) / (rest + statistics.median(steps_per_call) * floor) if rest_s \
            else float("nan")
        results[batch] = {"hf": hf_tps, "native": nat_tps, "step_s": step, "floor_s": floor, "rest_s": rest,
                          "ratio_at_floor": at_floor}
        print(f"{batch:>6} | {nat_tokens:>7} | {hf_tps:>9.0f} | {nat_tps:>12.0f} | {nat_tps / hf_tps:>6.2f} | "
              f"{per_fw:>6.1f} | {step * 1e3:>7.2f} | {floor * 1e3:>8.2f} | {step / floor:>10.2f} | "
              f"{rest * 1e3:>7.1f} | {at_floor:>11.2f}")
    return results


# ---- B. mixed lengths, staggered arrivals ---------------------------------------------------------------

@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: list[int]
    new_tokens: int


def arrivals(s: Settings, vocab: int) -> list[Arrival]:
    rng = random.Random(1)
    out, clock = [], 0.0
    for _ in range(s.requests):
        prompt = random_prompts(rng, 1, rng.randint(*s.prompt_range), vocab)[0]
        out.append(Arrival(clock, prompt, rng.randint(*s.new_range)))
        clock += rng.expovariate(1.0 / s.mean_gap_s)
    return out


def hf_static_batcher(model, reqs: list[Arrival], max_batch: int) -> tuple[int, float, list[float]]:
    """(useful tokens, wall s, latencies): arrived requests in batches, each run to its longest request."""
    pending, useful, latencies = deque(reqs), 0, []
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if pending[0].at_s > now:
            time.sleep(pending[0].at_s - now)
            now = time.perf_counter() - t0
        batch = []
        while pending and len(batch) < max_batch and pending[0].at_s <= now:
            batch.append(pending.popleft())
        hf_generate(model, [r.prompt for r in batch], max(r.new_tokens for r in batch))
        done = time.perf_counter() - t0
        useful += sum(r.new_tokens for r in batch)  # tokens past a request's own max_new_tokens are waste
        latencies += [done - r.at_s for r in batch]
    return useful, time.perf_counter() - t0, latencies


async def native_arrivals(engine: TorchEngine, reqs: list[Arrival]) -> tuple[int, float, list[float]]:
    t0 = time.perf_counter()

    async def one(r: Arrival) -> tuple[int, float]:
        await asyncio.sleep(max(0.0, r.at_s - (time.perf_counter() - t0)))
        (n,) = await native_generate(engine, [r.prompt], r.new_tokens)
        return n, time.perf_counter() - t0 - r.at_s

    done = await asyncio.gather(*(one(r) for r in reqs))
    return sum(n for n, _ in done), time.perf_counter() - t0, [lat for _, lat in done]


def staggered(s: Settings, model, engine, vocab: int) -> None:
    reqs = arrivals(s, vocab)
    wanted = sum(r.new_tokens for r in reqs)
    print(f"\nB. {len(reqs)} requests over {reqs[-1].at_s:.2f} s (Poisson, mean gap {s.mean_gap_s * 1e3:.0f} ms), "
          f"prompts {s.prompt_range}, new tokens {s.new_range}: {wanted} requested tokens")
    hf_tokens, hf_s, hf_lat = hf_static_batcher(model, reqs, s.static_batch)
    dec0, sizes = engine_attr(engine, "num_decode_forwards"), engine_attr(engine, "decode_batch_sizes")
    fw0, tok0 = engine.num_forwards, engine.tokens_generated
    nat_tokens, nat_s, nat_lat = asyncio.run(native_arrivals(engine, reqs))
    if not hf_tokens == nat_tokens == wanted:
        raise RuntimeError(f"workload B: unequal useful tokens (HF {hf_tokens}, native {nat_tokens}, wanted {wanted})")
    print(f"{'':>22} | {'useful tok/s':>12} | {'wall s':>7} | {'mean latency s':>14}")
    for name, tokens, wall, lat in (("HF static batcher", hf_tokens, hf_s, hf_lat),
                                    ("native, concurrent", nat_tokens, nat_s, nat_lat)):
        print(f"{name:>22} | {tokens / wall:>12.0f} | {wall:>7.2f} | {statistics.mean(lat):>14.2f}")
    print(f"ratio native/HF: {hf_s / nat_s:.2f}; native tokens per forward (prefill + decode): "
          f"{(engine.tokens_generated - tok0) / max(1, engine.num_forwards - fw0):.1f}")
    if dec0 is not None and sizes is not None:
        steps = engine_attr(engine, "num_decode_forwards") - dec0
        recent = list(sizes)[-steps:] if steps else []
        print(f"native mean decode batch: {statistics.mean(recent) if recent else 0:.1f} over {steps} decode steps")
    else:
        print("native mean decode batch: not exposed by this engine")


# ---- C. in-flight weight update -------------------------------------------------------------------------

def weight_swap(s: Settings, model, engine, vocab: int, label: str) -> None:
    prompts = random_prompts(random.Random(2), s.swap_batch, s.prompt_len, vocab)
    timed(native_generate, engine, prompts, s.new_tokens)  # warm-up, excluded
    with torch.no_grad():  # staged before timing: the perturbed copy a trainer broadcast would deliver
        gen = torch.Generator().manual_seed(3)
        staged = {n: p + 1e-3 * torch.randn(p.shape, generator=gen).to(p.device) for n, p in model.named_parameters()}
    steps = engine_attr(engine, "step_times_s")
    dec0, fw0 = engine_attr(engine, "num_decode_forwards"), engine.num_forwards
    ref_s, _ = timed(native_generate, engine, prompts, s.new_tokens)  # the same batch without a swap
    k = engine_attr(engine, "num_decode_forwards") - dec0 if dec0 is not None else 0
    if steps is not None and k > 0:
        step_s, step_how = statistics.mean(list(steps)[-k:]), "engine step record"
    else:
        step_s, step_how = ref_s / max(1, engine.num_forwards - fw0), "wall / forwards, prefill included"

    pauses0 = len(engine_attr(engine, "swap_pauses_s") or [])
    target, finished, blocked = engine.num_forwards + s.new_tokens // 2, threading.Event(), []

    def swapper() -> None:  # lands mid-decode: waits for half the batch's forwards
        while engine.num_forwards < target and not finished.is_set():
            time.sleep(step_s / 4)  # rare polls: a busy poller would take the GIL from the engine thread
        t0 = time.perf_counter()
        engine.load_weights(staged, version=engine.version + 1)
        blocked.append(time.perf_counter() - t0)

    async def run() -> tuple[float, set[int]]:
        thread = threading.Thread(target=swapper)
        thread.start()
        t0 = time.perf_counter()
        groups = await engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=s.new_tokens))
        wall = time.perf_counter() - t0
        finished.set()
        await asyncio.to_thread(thread.join)
        return wall, {v for g in groups for c in g for v in c.versions}

    swap_s, versions = asyncio.run(run())
    pauses = list(engine_attr(engine, "swap_pauses_s") or [])[pauses0:]  # a deque (the last swaps)
    print(f"\nC. in-flight weight update, {label}: batch {s.swap_batch}, {s.new_tokens} new tokens, "
          f"{sum(t.numel() for t in staged.values()):,} parameters swapped mid-decode")
    print(f"mean decode step: {step_s * 1e3:.2f} ms ({step_how})")
    if pauses:
        print(f"swap pause: {max(pauses) * 1e3:.2f} ms = {max(pauses) / step_s:.1f} decode steps "
              f"(engine swap_pauses_s); total stall {sum(pauses) * 1e3:.2f} ms")
    else:
        print(f"swap pause: not exposed by this engine; load_weights blocked {blocked[0] * 1e3:.2f} ms "
              f"= {blocked[0] / step_s:.1f} steps (it waits for the running batch)")
    print(f"load_weights blocked its caller {blocked[0] * 1e3:.2f} ms; batch wall {swap_s:.3f} s with the swap "
          f"vs {ref_s:.3f} s without ({(swap_s - ref_s) * 1e3:+.0f} ms, noisy); token versions {sorted(versions)}")


# ---- main -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and workloads: a smoke run of a few seconds")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the same for both sides")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per point (median); default 3, quick 1")
    ap.add_argument("--model", choices=("bench", "example"), default="bench",
                    help="bench: 4 layers, hidden 256 (2.4M parameters); example: the learning examples' model "
                         "(2 layers, hidden 64)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]: both sides run there")
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="on CUDA: the native engine launches every kernel (no graph replay)")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else (EXAMPLE if args.model == "example" else FULL)
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="engine_bench_") as path:
        hf.build_tiny_model(path, s.model)
        model = hf.load_model(path, dtype="float32", device=args.device)
        options = {"cuda_graphs": False} if args.no_cuda_graphs else {}
        engine = TorchEngine(path, dtype="float32", device=args.device, max_prompt_len=s.model.max_positions, seed=0,
                             eos_token_ids=[], **options)
        return run_all(s, path, model, engine, repeats, options)


def run_all(s: Settings, path: str, model, engine: TorchEngine, repeats: int, options: dict | None = None) -> dict:
    options = options or {}
    vocab = model.get_input_embeddings().num_embeddings
    m = s.model
    print(f"model: {m.arch}, fp32, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads / "
          f"{m.num_kv_heads} kv heads, MLP {m.intermediate_size}, vocab {vocab}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters; torch threads {torch.get_num_threads()}; "
          f"native engine {type(engine).__module__} (fast path: {getattr(engine, 'fast', 'n/a')})")
    device = next(model.parameters()).device
    if device.type == "cuda":
        graphs = getattr(getattr(getattr(engine, "scheduler", None), "backend", None), "graphs", "n/a")
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
              f"native decode graphs: {graphs}")
    try:
        table = fixed_batches(s, model, engine, vocab, repeats)
        staggered(s, model, engine, vocab)
        weight_swap(s, model, engine, vocab, "engine defaults")
    finally:
        asyncio.run(engine.close())
    if getattr(engine_attr(engine, "options"), "kv_on_update", None) == "recompute":
        # The default pause includes re-prefilling every unfinished sequence; "keep" shows the copy alone.
        keep = TorchEngine(path, device=str(device), max_prompt_len=s.model.max_positions, seed=0, eos_token_ids=[],
                           kv_on_update="keep", **options)
        try:
            weight_swap(s, model, keep, vocab, "kv_on_update='keep' (old K/V reused, so the pause is the copy)")
        finally:
            asyncio.run(keep.close())

    key = 32 if 32 in table else max(table)  # quick mode has no batch 32
    row = table[key]
    hf_tps, nat_tps = row["hf"], row["native"]
    # Issue 21 asks >= 2x on a CPU; issue 3's 3x stands on an accelerator, where graph replay removes the
    # per-op overhead that the CPU step cannot shed.
    target = 2.0 if device.type == "cpu" else 3.0
    result = {"benchmark": "engine_throughput" if device.type == "cpu" else f"engine_throughput_{device.type}",
              "value": round(nat_tps, 1), "unit": "tokens/s",
              "baseline": round(hf_tps, 1), "ratio": round(nat_tps / hf_tps, 3), "target": target,
              "step_ms": round(row["step_s"] * 1e3, 4), "floor_ms": round(row["floor_s"] * 1e3, 4),
              "step_over_floor": round(row["step_s"] / row["floor_s"], 3),
              "ratio_at_floor": round(row["ratio_at_floor"], 3)}
    print(f"\nbatch {key}: native {nat_tps:.0f} tok/s vs HF generate {hf_tps:.0f} tok/s = {nat_tps / hf_tps:.2f}x "
          f"(target {target}x); decode step {row['step_s'] * 1e3:.2f} ms = {row['step_s'] / row['floor_s']:.2f}x "
          f"its floor {row['floor_s'] * 1e3:.2f} ms (target 1.5x)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
