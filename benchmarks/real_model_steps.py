"""Sections B (train step) and C (weight sync) of benchmarks/real_model.py, on SmolLM2-135M-Instruct.

Place in the dataflow: none; this times the trainer's two costs per step with asyncrl's own parts. The
train step is `Learner.update` (GRPO, PPO-clip, token-mean: the example's algorithm; one mini-batch, one
micro-batch of 32) on completions the native engine sampled from the example's prompts, with random 0/1
rewards; beside it, alternating, the bare forward + backward + AdamW step of the same padded batch (the
same model and optimizer: what a hand-written loop pays). The weight sync sends the Learner's
`state_dict_for_sync()` through `CollectiveSender` (rank 0, this process) to a `CollectiveReceiver` in a
spawned process (rank 1) over gloo, as the trainer and a generator do, and that process then loads the
tensors into its `TorchEngine`; each transfer starts after both ranks leave a barrier and is timed on the
receiver, to holding the tensors. A raw broadcast of the same bytes as one flat buffer over the same group
alternates with it. Both ranks run 1 torch thread, as benchmarks/weight_sync.py's do.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from weight_sync import crc

from asyncrl.config.schema import AlgorithmConfig, TrainerConfig, WeightSyncConfig
from asyncrl.messages import Group, Trajectory
from asyncrl.training.batch import collate
from asyncrl.training.learner import Learner
from transports import CollectiveReceiver, CollectiveSender, create_store, join_group, plan_buckets

TIMEOUT_S = 300.0
# The example's trainer (examples/smollm_arith/config.toml) and algorithm (examples/base.toml), in fp32 (the example
# itself trains under bf16 autocast: benchmarks/train_step.py --model small --mixed-precision bf16 times that).
TRAINER = dict(mini_batches=1, micro_batch_size=32, lr=3e-5, grad_clip=1.0)
ALGORITHM = dict(advantage="grpo", policy_loss="ppo_clip", loss_agg="token-mean", clip_eps=0.2)


def _learner(path: Path) -> tuple[Learner, int]:
    from engines import hf

    tokenizer = hf.load_tokenizer(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model = hf.load_model(path, dtype="float32")
    return Learner(model, algorithm=AlgorithmConfig(**ALGORITHM), trainer=TrainerConfig(**TRAINER),
                   pad_token_id=pad), pad


def sampled_groups(s, path: Path, tokenizer_prompts: list[list[int]]) -> list[Group]:
    """The native engine's completions of the prompts (`s.train_samples` each, `s.train_new_tokens` long, EOS
    ignored), as scored groups with seeded random 0/1 rewards."""
    from real_model import sampling

    from engines.torch_engine import TorchEngine

    engine = TorchEngine(str(path), dtype="float32", max_prompt_len=max(map(len, tokenizer_prompts)), seed=0)
    try:
        out = asyncio.run(engine.generate(tokenizer_prompts, sampling(s.train_new_tokens, n=s.train_samples)))
    finally:
        asyncio.run(engine.close())
    rng, groups = random.Random(0), []
    for g, comps in enumerate(out):
        trajs = [Trajectory(seq_id=g * len(comps) + j, group_id=g, group_size=len(comps), prompt_ids=c.prompt_ids,
                            response_ids=c.response_ids, loss_mask=[True] * len(c.response_ids),
                            behavior_logprobs=c.logprobs, versions=c.versions, min_version=0, max_version=0,
                            finish_reason=c.finish_reason, reward=float(rng.random() < 0.5))
                 for j, c in enumerate(comps)]
        groups.append(Group(group_id=g, min_version=0, trajectories=trajs))
    return groups


def bare_step(learner: Learner, trajs: list[Trajectory]):
    """The plain loop's step of the same batch: one padded forward, the policy-gradient loss over response
    tokens (gather minus logsumexp), backward, AdamW. Returns a closure that runs one."""
    adv = torch.tensor([t.reward - 0.5 for t in trajs])
    b = collate(trajs, adv, learner.pad_token_id)
    model, opt = learner.model, learner.optimizer
    targets, mask = b.input_ids[:, 1:], b.response_mask[:, 1:].float()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits[:, :-1]
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        loss = -(logp * b.advantages[:, 1:] * mask).sum() / mask.sum()
        loss.backward()
        opt.step()

    return step, b.input_ids.shape


def train_step(s, path: Path, threads: int) -> dict[str, float]:
    """Median seconds of `Learner.update` and of the bare step on one step's samples, at `threads` threads."""
    from real_model import chat_prompts

    from engines import hf

    torch.set_num_threads(threads)
    prompts, _ = chat_prompts(hf.load_tokenizer(path), s.train_prompts)
    groups = sampled_groups(s, path, prompts)
    learner, _ = _learner(path)
    trajs = [t for g in groups for t in g.trajectories]
    bare, shape = bare_step(learner, trajs)
    upd, plain = [], []
    for r in range(s.repeats + 1):  # r = 0: warm-up of each; then alternating, so load hits both alike
        t0 = time.perf_counter()
        learner.update(groups)
        t1 = time.perf_counter()
        bare()
        t2 = time.perf_counter()
        if r:
            upd.append(t1 - t0)
            plain.append(t2 - t1)
    u, p = statistics.median(upd), statistics.median(plain)
    print(f"\nB. train step at {threads} thread(s): {len(groups)} prompts x {len(groups[0].trajectories)} samples, "
          f"padded batch {tuple(shape)} (prompt {len(trajs[0].prompt_ids)}-ish + {s.train_new_tokens} response "
          f"tokens), median of {s.repeats}: Learner.update {u:.3f} s, bare forward+backward+AdamW {p:.3f} s, "
          f"update/bare {u / p:.2f}")
    del learner
    return {"update_s": u, "bare_s": p}


# ---- C. weight sync -------------------------------------------------------------------------------------

def _receiver_main(path: str, port: int, meta, repeats: int, queue) -> None:
    """Rank 1: a generator's receiver and engine; puts ({figure: [s]}, crc of the last tensors) on `queue`."""
    from engines.torch_engine import TorchEngine

    torch.set_num_threads(1)
    engine = TorchEngine(path, dtype="float32", max_prompt_len=64, seed=0)
    group = join_group(host="127.0.0.1", port=port, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    receiver, flat = CollectiveReceiver(group, meta), torch.empty(meta.total_bytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"asyncrl": [], "load": [], "raw": []}
    try:
        for i in range(repeats + 1):  # i = 0: warm-up
            group.barrier()
            t0 = time.perf_counter()
            tensors, version, _ = receiver.receive()
            t1 = time.perf_counter()
            engine.load_weights(tensors, version)
            t2 = time.perf_counter()
            check = crc([tensors[m.name] for m in meta.tensors]) if i == repeats else None
            del tensors  # the engine holds its own copy: the staging memory is reused by the next sync
            group.barrier()
            t3 = time.perf_counter()
            group._broadcast(flat, "raw")  # the same group's broadcast of one flat buffer: the transfer alone
            t4 = time.perf_counter()
            if i:
                times["asyncrl"].append(t1 - t0)
                times["load"].append(t2 - t1)
                times["raw"].append(t4 - t3)
        queue.put((times, check))
    finally:
        group.close()
        asyncio.run(engine.close())


def weight_sync(path: Path, repeats: int) -> dict[str, float]:
    """Median seconds of one sync of the model (rank 0 here, rank 1 spawned), of the receiver's
    `load_weights` and of the raw broadcast; the receiver's last tensors are checked byte-equal (crc32)."""
    torch.set_num_threads(1)
    learner, _ = _learner(path)
    tensors = dict(learner.state_dict_for_sync())
    meta = plan_buckets(tensors, int(WeightSyncConfig().bucket_mb * 2**20))
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    store, port = create_store(2, TIMEOUT_S)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver_main, args=(str(path), port, meta, repeats, queue))
    proc.start()
    group = join_group(host="127.0.0.1", port=port, rank=0, world_size=2, backend="gloo", timeout_s=TIMEOUT_S,
                       store=store)
    try:
        sender = CollectiveSender(group, meta)
        for i in range(repeats + 1):
            group.barrier()
            sender.send(tensors, i + 1)
            group.barrier()
            group._broadcast(flat, "raw")
        times, check = queue.get(timeout=TIMEOUT_S)
    finally:
        group.close()
        proc.join(timeout=TIMEOUT_S)
    if proc.exitcode != 0:
        raise RuntimeError(f"the receiver process exited with code {proc.exitcode}")
    if check != crc([tensors[m.name] for m in meta.tensors]):
        raise RuntimeError("weight sync: the receiver's bytes differ from the sender's")
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = meta.total_bytes / 2**20
    print(f"\nC. weight sync, gloo, 2 processes, 1 thread each: {len(meta.tensors)} tensors, {mb:.0f} MiB in "
          f"{len(meta.buckets)} bucket(s), median of {repeats}: asyncrl send->held {med['asyncrl'] * 1e3:.0f} ms "
          f"({mb / med['asyncrl']:.0f} MiB/s), raw flat broadcast {med['raw'] * 1e3:.0f} ms (raw/asyncrl "
          f"{med['raw'] / med['asyncrl']:.2f}), then TorchEngine.load_weights {med['load'] * 1e3:.0f} ms; bytes equal")
    return {"asyncrl_s": med["asyncrl"], "raw_s": med["raw"], "load_s": med["load"]}
