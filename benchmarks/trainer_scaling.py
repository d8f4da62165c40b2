"""Trainer scaling: train-step throughput of 1 and 2 trainer ranks (`trainer.num_ranks`) for DDP and FSDP2 on the
same batch, and the weight send after it.

    python benchmarks/trainer_scaling.py              # Llama 4 layers hidden 256 (3.5M), 5 rounds: ~5 minutes
    python benchmarks/trainer_scaling.py --rounds 9   # more rounds: steadier medians on a shared machine
    python benchmarks/trainer_scaling.py --quick      # tiny smoke run (the test); says nothing about the target

Issue 19's goal: scaling efficiency = (2-rank tokens/s) / (2 x 1-rank tokens/s) >= 0.8, where the 1-rank baseline
is one process with 1 torch thread and each of the 2 ranks has 1 torch thread (the same threads per process).

The code timed is the trainer's own: `Learner.update` with a `DataParallel` (asyncrl/training/parallel.py: each
rank trains its half of every mini-batch, gradients summed over the ranks in the last micro-batch's backward),
and for the send `Learner.state_dict_for_sync` on every rank (FSDP2: an all-gather of every parameter) followed by
rank 0's `CollectiveSender.send` over a gloo weight-sync group to one receiver process (a generator's stand-in).

Processes (spawned once, 1 torch thread each): trainer rank 0, trainer rank 1 and the receiver. Every rank builds
the same random Llama from the same seed and trains the same batch: G groups x S samples, every sample a prompt of
P tokens and a response of R tokens (all of one length, so each rank's half is exactly half the work and no
padding is trained). The work per configuration, each in `--rounds` rounds (the order rotated from round to round,
so a drift of the machine's speed hits every configuration alike):

| configuration | what runs |
|---|---|
| 1 rank, 1 thread (baseline) | rank 0 alone: `Learner.update` over the whole batch; rank 1 waits in a barrier |
| 1 rank, 2 threads | the same with `torch.set_num_threads(2)`: on 2 cores, the other way to use both |
| ddp / fsdp2, 2 ranks | (a) compute alone: each rank runs a one-process `Learner.update` over its half of the batch, |
| | both ranks at once, no collective; (b) the 2-rank `Learner.update` over the whole batch; (a) and (b) |
| | alternate step by step, so a change in the machine's load hits both alike |

A step's time runs from a barrier of the ranks to the end of the update, and counts the slowest rank's.
tokens/s = the batch's tokens (prompt + response, G x S x (P + R)) / the median step time, pooled over the rounds
(the first `--warmup` steps of every configuration and round excluded). Inside (b) the benchmark's DataParallel
subclass times, per rank, each micro-batch's forward + backward (the synchronising one, whose backward reduces the
gradients, and the local ones) and the other collectives of the step (prepare's row gathers, the statistics'
reductions, the finite check). "communication and overhead" = (b) - (a): what the second rank costs beyond its
own compute (the reductions, waiting for the slower rank, the wrappers' own work).

Send: after the steps, `--sends` times: a barrier, `state_dict_for_sync()` on every rank (the gather), then rank
0 sends (the receiver holds the bytes when it returns). 1 rank vs 2 ranks of each mode.

The last line of output is one JSON object: value = DDP's scaling efficiency (the default `trainer.parallel`),
baseline 1.0 (perfect scaling), ratio = value, target 0.8; FSDP2's efficiency, the efficiencies against the
1-rank 2-thread run and the send times are extra keys.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config.schema import AlgorithmConfig, TrainerConfig, WeightSyncConfig
from asyncrl.messages import Group, Trajectory
from asyncrl.training.learner import Learner
from asyncrl.training.parallel import DataParallel, SingleProcess
from transports import CollectiveReceiver, CollectiveSender, create_store, join_group, plan_buckets

TARGET = 0.8
TIMEOUT_S = 1800.0  # rank 1 waits in a barrier while rank 0 runs the 1-rank configurations alone
HOST = "127.0.0.1"
WORLD = 2  # trainer ranks
CONFIGS = ("1 rank, 1 thread", "1 rank, 2 threads", "ddp, 2 ranks", "fsdp2, 2 ranks")


@dataclass(frozen=True)
class Settings:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    groups: int
    group_size: int
    prompt_len: int
    response_len: int
    micro_batch_size: int
    warmup: int
    steps: int
    sends: int
    rounds: int
    port: int = 0

    @property
    def tokens(self) -> int:
        """Tokens of one step's batch (prompt + response of every sample)."""
        return self.groups * self.group_size * (self.prompt_len + self.response_len)

    def schedule(self) -> list[str]:
        """Every process runs the configurations in this order: round r starts at configuration r."""
        return [CONFIGS[(r + i) % len(CONFIGS)] for r in range(self.rounds) for i in range(len(CONFIGS))]


def build_model(s: Settings) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=s.prompt_len + s.response_len, tie_word_embeddings=False))


def make_batch(s: Settings) -> list[Group]:
    """One step's groups: random tokens, rewards 0/1 that differ within each group (non-zero advantages),
    behaviour logprobs near a uniform policy's."""
    gen = torch.Generator().manual_seed(1)
    uniform = -float(torch.log(torch.tensor(float(s.vocab))))
    groups = []
    for g in range(s.groups):
        trajs = []
        for i in range(s.group_size):
            trajs.append(Trajectory(
                seq_id=g * s.group_size + i, group_id=g, group_size=s.group_size,
                prompt_ids=torch.randint(1, s.vocab, (s.prompt_len,), generator=gen).tolist(),
                response_ids=torch.randint(1, s.vocab, (s.response_len,), generator=gen).tolist(),
                loss_mask=[True] * s.response_len,
                behavior_logprobs=(uniform + 0.1 * torch.randn(s.response_len, generator=gen)).tolist(),
                versions=[0] * s.response_len, min_version=0, max_version=0, finish_reason="length",
                reward=float(i % 2)))
        groups.append(Group(group_id=g, min_version=0, trajectories=trajs))
    return groups


def make_learner(s: Settings, parallel: SingleProcess | None = None) -> Learner:
    trainer = TrainerConfig(lr=1e-5, prompts_per_step=s.groups, mini_batches=1, micro_batch_size=s.micro_batch_size)
    return Learner(build_model(s), algorithm=AlgorithmConfig(), trainer=trainer, pad_token_id=0,
                   max_new_tokens=s.response_len, parallel=parallel)


class TimedParallel(DataParallel):
    """The trainer's DataParallel, timing this rank's share of a step: each micro-batch's forward + backward
    (inside `sync_gradients`, by whether it synchronises) and the step's other collectives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.times: dict[str, list[float]] = defaultdict(list)

    def take(self) -> dict[str, list[float]]:
        out, self.times = dict(self.times), defaultdict(list)
        return out

    @contextlib.contextmanager
    def sync_gradients(self, model: torch.nn.Module, sync: bool) -> Iterator[None]:
        t0 = time.perf_counter()
        with super().sync_gradients(model, sync):
            yield
        self.times["sync micro-batch" if sync else "local micro-batch"].append(time.perf_counter() - t0)

    def _timed(self, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        self.times["other collectives"].append(time.perf_counter() - t0)
        return out

    def all_gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._timed(super().all_gather_rows, rows)

    def reduce_stats(self, stats: Any, only: tuple[str, ...] | None = None) -> None:
        return self._timed(super().reduce_stats, stats, only)

    def all_finite(self, model: torch.nn.Module) -> str | None:
        return self._timed(super().all_finite, model)

    def full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return self._timed(super().full_norm, norm)


def _step(learner: Learner, groups: list[Group], barrier: Any) -> float:
    barrier()
    t0 = time.perf_counter()
    learner.update(groups)
    return time.perf_counter() - t0


class Rank:
    """Trainer rank `rank`: runs its part of every configuration of the schedule; records its times."""

    def __init__(self, rank: int, s: Settings) -> None:
        self.rank, self.s = rank, s
        self.store = dist.TCPStore(HOST, s.port, WORLD + 1, is_master=False, timeout=_seconds(TIMEOUT_S))
        self.dp = TimedParallel.join("ddp", store=self.store, rank=rank, world_size=WORLD, timeout_s=TIMEOUT_S)
        self.weights = join_group(host=HOST, port=s.port, rank=0, world_size=2, backend="gloo",
                                  timeout_s=TIMEOUT_S, store=self.store) if rank == 0 else None
        self.batch = make_batch(s)
        half = s.groups // WORLD  # mini_batches = 1: a rank's half of the samples is its half of the groups
        self.shard = self.batch[rank * half:(rank + 1) * half]
        self.learners: dict[str, Learner] = {}
        self.sender: CollectiveSender | None = None
        self.version = 0
        self.times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def barrier(self) -> None:
        dist.barrier(group=self.dp.group)

    def learner(self, key: str) -> Learner:
        """The configuration's Learner, built the first time (both ranks build in the same order: DDP's
        wrap broadcasts rank 0's parameters)."""
        if key not in self.learners:
            if key in ("ddp", "fsdp2"):
                parallel = TimedParallel(key, self.dp.group, self.rank, WORLD, torch.device("cpu"))  # type: ignore[arg-type]
                self.learners[key] = make_learner(self.s, parallel)
            else:
                self.learners[key] = make_learner(self.s)
        return self.learners[key]

    def run(self) -> dict[str, dict[str, list[float]]]:
        for config in self.s.schedule():
            if config.startswith("1 rank"):
                if self.rank == 0:
                    self.single(config, threads=int(config.split(", ")[1][0]))
                self.barrier()  # rank 1 waits here meanwhile
            else:
                self.parallel(config, config.split(",")[0])
        return {k: dict(v) for k, v in self.times.items()}

    def single(self, config: str, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            learner = self.learner(config)
            for i in range(self.s.warmup + self.s.steps):
                seconds = _step(learner, self.batch, lambda: None)
                if i >= self.s.warmup:
                    self.times[config]["step"].append(seconds)
            self.send(config, learner, barrier=lambda: None)
        finally:
            torch.set_num_threads(1)

    def parallel(self, config: str, mode: str) -> None:
        alone = self.learner(f"alone {self.rank}")  # one process over this rank's half: no collective
        learner = self.learner(mode)
        dp = learner.dp
        assert isinstance(dp, TimedParallel)
        for i in range(self.s.warmup + self.s.steps):
            # alone and together alternate step by step: a change in the machine's load hits both alike
            alone_s = _step(alone, self.shard, self.barrier)
            seconds = _step(learner, self.batch, self.barrier)
            parts = dp.take()
            if i >= self.s.warmup:
                self.times[config]["compute alone"].append(alone_s)
                self.times[config]["step"].append(seconds)
                for name, values in parts.items():
                    self.times[config][name] += values if "micro-batch" in name else [sum(values)]
        self.send(config, learner, barrier=self.barrier)

    def send(self, config: str, learner: Learner, barrier: Any) -> None:
        """1 warm-up + `sends` times: gather the weights on every rank, rank 0 sends them to the receiver."""
        for i in range(1 + self.s.sends):
            barrier()
            t0 = time.perf_counter()
            tensors = learner.state_dict_for_sync()
            t1 = time.perf_counter()
            if self.rank == 0:
                assert self.weights is not None
                if self.sender is None:
                    self.sender = CollectiveSender(self.weights, plan_buckets(tensors, _bucket_bytes()))
                self.sender.send(tensors, self.version)
                self.version += 1
            if i:
                self.times[config]["gather"].append(t1 - t0)
                self.times[config]["send"].append(time.perf_counter() - t1)

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()
        self.dp.close()


def _seconds(s: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=s)


def _bucket_bytes() -> int:
    return int(WeightSyncConfig().bucket_mb * 2**20)


def _rank_main(rank: int, s: Settings, out: Any) -> None:
    torch.set_num_threads(1)
    if rank == WORLD:
        _receiver_main(s, out)
        return
    r = Rank(rank, s)
    try:
        out.put((rank, r.run()))
        r.barrier()
    finally:
        r.close()


def _receiver_main(s: Settings, out: Any) -> None:
    """The generator's stand-in: receives every send of the schedule (it holds the bytes, then lets them go)."""
    store = dist.TCPStore(HOST, s.port, WORLD + 1, is_master=False, timeout=_seconds(TIMEOUT_S))
    group = join_group(host=HOST, port=s.port, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S,
                       store=store)
    meta = plan_buckets(SingleProcess().full_state_dict(build_model(s)), _bucket_bytes())
    receiver = CollectiveReceiver(group, meta)
    try:
        for _ in range(len(s.schedule()) * (1 + s.sends)):
            staged, _, _ = receiver.receive(armed=True)
            del staged
        out.put((WORLD, {}))
    finally:
        group.close()


def run(s: Settings) -> dict[str, dict[str, list[float]]]:
    """Spawn the 2 ranks and the receiver; -> per configuration and quantity, the slowest rank's times."""
    store, port = create_store(WORLD + 1, TIMEOUT_S)  # the master lives here; every process connects to it
    s = Settings(**{**s.__dict__, "port": port})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, s, out)) for r in range(WORLD + 1)]
    for p in procs:
        p.start()
    try:
        results = dict(_collect(out, procs, len(procs)))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    del store
    merged: dict[str, dict[str, list[float]]] = {}
    for config, quantities in results[0].items():
        merged[config] = {}
        for name, values in quantities.items():
            other = results[1].get(config, {}).get(name)
            merged[config][name] = values if other is None else [max(a, b) for a, b in zip(values, other)]
    return merged


def _collect(out: Any, procs: list[Any], n: int) -> Iterator[tuple[int, Any]]:
    """The processes' results; fails as soon as one died instead of waiting out the limit."""
    deadline = time.monotonic() + TIMEOUT_S
    got = 0
    while got < n:
        try:
            item = out.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a benchmark process exited with {dead} (its traceback is above)") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result from the benchmark processes in {TIMEOUT_S} s") from None
            continue
        got += 1
        yield item


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _round_efficiency(s: Settings, times: dict[str, dict[str, list[float]]], config: str) -> list[float]:
    one, two = times[CONFIGS[0]]["step"], times[config]["step"]
    return [_med(one[i:i + s.steps]) / (2 * _med(two[i:i + s.steps])) for i in range(0, len(two), s.steps)]


def report(s: Settings, times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Print the figures; -> the result object (the JSON line)."""
    tps = {c: s.tokens / _med(times[c]["step"]) for c in CONFIGS}
    base1, base2 = tps[CONFIGS[0]], tps[CONFIGS[1]]
    print(f"\nA. train step ({s.tokens} tokens; median of {s.rounds} rounds x {s.steps} steps)")
    print(f"  {'configuration':<20} {'step s':>8} {'tokens/s':>9} {'efficiency':>11} {'vs 1 rank 2 threads':>20}"
          "   step s of each round (median)")
    eff: dict[str, float] = {}
    for c in CONFIGS:
        step = _med(times[c]["step"])
        if c.endswith("2 ranks"):
            eff[c] = tps[c] / (2 * base1)
            extra = f"{eff[c]:>11.3f} {tps[c] / base2:>20.3f}"
        else:
            vs_one = "" if c == CONFIGS[0] else f"({tps[c] / base1:.2f}x 1 thread)"
            extra = f"{'':>11} {vs_one:>20}"
        rounds = [_med(times[c]["step"][i:i + s.steps]) for i in range(0, len(times[c]["step"]), s.steps)]
        print(f"  {c:<20} {step:>8.3f} {tps[c]:>9.0f} {extra}   rounds: {' '.join(f'{r:.3f}' for r in rounds)}")
    print("\nB. where a 2-rank step's time goes (per rank, the slower rank's; medians)")
    for c in CONFIGS[2:]:
        t = times[c]
        step, alone = _med(t["step"]), _med(t["compute alone"])
        sync, local = _med(t.get("sync micro-batch", [])), _med(t.get("local micro-batch", []))
        print(f"  {c}: step {step:.3f} s = compute alone {alone:.3f} s + communication and overhead "
              f"{step - alone:.3f} s ({(step - alone) / step:.0%}); efficiency with no communication at all "
              f"(1-rank step / (2 x compute alone)): {_med(times[CONFIGS[0]]['step']) / (2 * alone):.3f}")
        print(f"    one micro-batch's forward + backward: {local:.3f} s local, {sync:.3f} s synchronising "
              f"(the gradient reduction exposed: {sync - local:+.3f} s); other collectives of the step "
              f"{_med(t.get('other collectives', [])):.3f} s")
    print("\nC. weight send after the step (median; gather = state_dict_for_sync on every rank, send = rank 0's "
          "broadcast to 1 receiver)")
    send = {c: _med(times[c]["gather"]) + _med(times[c]["send"]) for c in CONFIGS}
    for c in CONFIGS:
        print(f"  {c:<20} gather {_med(times[c]['gather']):.4f} s + send {_med(times[c]['send']):.4f} s = "
              f"{send[c]:.4f} s ({send[c] / send[CONFIGS[0]]:.2f}x 1 rank)")
    print("\nD. efficiency within each round (its own 1-rank and 2-rank medians, minutes apart at most: a load that "
          "comes and goes shows here)")
    for c in CONFIGS[2:]:
        print(f"  {c}: " + " ".join(f"{e:.3f}" for e in _round_efficiency(s, times, c)))
    ddp, fsdp2 = eff[CONFIGS[2]], eff[CONFIGS[3]]
    print(f"\nscaling efficiency (2-rank tokens/s / 2 x 1-rank 1-thread tokens/s): ddp {ddp:.3f}, fsdp2 {fsdp2:.3f} "
          f"(target {TARGET}); against 1 rank with 2 threads: ddp {tps[CONFIGS[2]] / base2:.3f}, "
          f"fsdp2 {tps[CONFIGS[3]] / base2:.3f}")
    return {"benchmark": "trainer_scaling", "value": round(ddp, 4),
            "unit": "scaling efficiency, ddp: 2-rank tokens/s / (2 x 1-rank tokens/s)", "baseline": 1.0,
            "ratio": round(ddp, 4), "target": TARGET, "fsdp2": round(fsdp2, 4),
            "ddp_vs_1rank_2threads": round(tps[CONFIGS[2]] / base2, 4),
            "fsdp2_vs_1rank_2threads": round(tps[CONFIGS[3]] / base2, 4),
            "send_s": {c: round(v, 4) for c, v in send.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round, 1 step: a smoke run")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8, help="groups per step (a multiple of 2)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first, per configuration and round")
    ap.add_argument("--sends", type=int, default=3, help="timed weight sends per configuration and round")
    args = ap.parse_args(argv)
    if args.quick:
        s = Settings(hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, vocab=64, groups=2, group_size=2,
                     prompt_len=4, response_len=8, micro_batch_size=1, warmup=1, steps=1, sends=1, rounds=1)
    else:
        s = Settings(hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4, mlp=int(args.hidden * 2.75),
                     vocab=1024, groups=args.groups, group_size=args.group_size, prompt_len=args.prompt_len,
                     response_len=args.response_len, micro_batch_size=args.micro_batch_size, warmup=args.warmup,
                     steps=args.steps, sends=args.sends, rounds=args.rounds)
    if s.groups % WORLD or (s.groups * s.group_size // WORLD) % s.micro_batch_size:
        raise SystemExit(f"--groups must be even and each rank's {s.groups * s.group_size // WORLD} samples a "
                         f"multiple of --micro-batch-size")
    params = sum(p.numel() for p in build_model(s).parameters())
    print(f"model: random Llama, {s.layers} layers, hidden {s.hidden}, MLP {s.mlp}, vocab {s.vocab}: "
          f"{params / 1e6:.2f}M parameters, float32")
    print(f"batch: {s.groups} groups x {s.group_size} samples x ({s.prompt_len} prompt + {s.response_len} response) "
          f"tokens = {s.tokens} tokens; 1 mini-batch, micro-batches of {s.micro_batch_size} "
          f"({s.groups * s.group_size // s.micro_batch_size} on 1 rank, "
          f"{s.groups * s.group_size // WORLD // s.micro_batch_size} per rank on 2)")
    print(f"processes: 2 trainer ranks + 1 receiver, 1 torch thread each; {s.rounds} rounds of {', '.join(CONFIGS)} "
          f"(order rotated), {s.warmup} warm-up + {s.steps} timed steps and 1 + {s.sends} sends each")
    result = report(s, run(s))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
