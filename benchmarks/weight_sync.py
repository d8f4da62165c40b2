"""Weight sync: asyncrl's transports against a raw transfer of the same bytes (a `torch.distributed` broadcast;
a copy out of shared memory for the ipc transport).

    python benchmarks/weight_sync.py [--quick] [--layers N] [--dtype bf16|fp32] [--receivers N]
                                     [--repeats R] [--bucket-mb MB] [--no-ray]

Issue 18's goal: asyncrl's transport takes at most 1.25x the time of a raw broadcast of one flat buffer of
the same size (ratio = raw / asyncrl >= 0.8). One run measures, for the same bytes (the tensors of a random
Qwen2-0.5B-shaped model: hidden 896, 24 layers, MLP 4864, vocab 151936, 14 heads / 2 KV heads, embedding
tied so no lm_head; `--layers` scales the depth down):

| method | what is timed (rank 0 sends to `--receivers` ranks, each rank its own process) |
|---|---|
| raw gloo (baseline) | `dist.broadcast` of one preallocated contiguous uint8 buffer over a gloo default group |
| asyncrl gloo | `CollectiveSender.send` / `CollectiveReceiver.receive` over its own gloo group: announce, |
| | header, then per bucket: pack (a copy on the sender), broadcast, unpack (views) |
| Ray object store | `ray.put` of the state dict in a sender actor, `ray.get` in each receiver (put + slowest get) |
| raw / asyncrl NCCL | as the gloo rows, tensors on `cuda:<rank>`: needs one GPU per rank |
| raw shared-memory / CUDA IPC copy | a receiver copies the sender's flat buffer, opened once through a |
| | `torch.multiprocessing` handle (a shared-memory file on the CPU; on CUDA, cuda:0), into its own, preallocated |
| asyncrl ipc | `IpcSender.send` / `IpcReceiver.receive` (transports/ipc.py) on the same device: the sender copies the |
| | tensors into its shared buffer, announces, waits for every receiver's ack; a receiver copies the buffer |
| | into a fresh buffer of its own (views) and acks. The CPU rows always run; the CUDA rows with a GPU |

Fairness rules:
* Ranks are processes (`torch.multiprocessing` spawn), 1 torch thread each, all on 127.0.0.1.
* Before every timed transfer the ranks meet in a barrier; each rank times from leaving it to holding the
  data; a transfer's time is the slowest rank's (the last receiver to hold the weights).
* Raw and asyncrl alternate within the run (warm-up of each first, then raw, asyncrl, raw, ...), so a change
  in the machine's load hits both alike. Each figure is the median of `--repeats` timed transfers.
* Every receiver's bytes are checked against the sender's (crc32) after the timed transfers, outside the clock.

The last line of output is one JSON object: value = asyncrl gloo median seconds, baseline = raw gloo median
seconds, ratio = raw / asyncrl (higher is better), target 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config.schema import WeightSyncConfig
from transports import CollectiveReceiver, CollectiveSender, create_store, join_group, plan_buckets
from transports.bucketing import empty_bucket, pack_bucket
from transports.ipc import join_receiver, join_sender

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TARGET = 0.8  # raw / asyncrl: asyncrl at most 1.25x the raw broadcast's time
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Settings:
    layers: int
    vocab: int
    dtype: str
    world_size: int
    repeats: int
    bucket_bytes: int
    backend: str  # "gloo" or "nccl"
    port: int = 0
    device: str = "cpu"  # the ipc ranks' device: "cpu" (shared memory) or "cuda" (CUDA IPC on cuda:0)


def qwen2_shapes(layers: int, vocab: int, hidden: int = 896, mlp: int = 4864, kv_heads: int = 2,
                 head_dim: int = 64) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2-0.5B's parameter names and shapes (tied embedding: no lm_head), in state-dict order."""
    kv = kv_heads * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (mlp, hidden)), (p + "mlp.up_proj.weight", (mlp, hidden)),
            (p + "mlp.down_proj.weight", (hidden, mlp)),
            (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    return shapes + [("model.norm.weight", (hidden,))]


def build_state(s: Settings, *, random: bool, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The model's tensors: random on the sender, uninitialised on receivers (they only need the plan)."""
    dtype, g = DTYPES[s.dtype], torch.Generator().manual_seed(0)
    make = (lambda shape: torch.randn(shape, generator=g, dtype=dtype)) if random else \
        (lambda shape: torch.empty(shape, dtype=dtype))
    return {name: make(shape).to(device) for name, shape in qwen2_shapes(s.layers, s.vocab)}


def crc(tensors: list[torch.Tensor]) -> int:
    value = 0
    for t in tensors:
        value = zlib.crc32(t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy(), value)
    return value


def _timed(fn, cuda: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _rank_main(rank: int, s: Settings, queue) -> None:
    """One rank: raw broadcasts and asyncrl syncs, alternating; puts (rank, {method: [s]}, crcs) on `queue`."""
    torch.set_num_threads(1)
    cuda = s.backend == "nccl"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", s.port, s.world_size, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    dist.init_process_group(s.backend, store=dist.PrefixStore("raw", store), rank=rank, world_size=s.world_size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    state = build_state(s, random=rank == 0, device=device)
    meta = plan_buckets(state, s.bucket_bytes)
    if rank == 0:  # the baseline sends the very same bytes, already flat
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    else:
        flat = torch.empty(meta.total_bytes, dtype=torch.uint8, device=device)
    group = join_group(host="127.0.0.1", port=s.port, rank=rank, world_size=s.world_size, backend=s.backend,
                       timeout_s=TIMEOUT_S, device=device if cuda else None)
    staged: dict[str, torch.Tensor] = {}
    try:
        if rank == 0:
            sender = CollectiveSender(group, meta)
            sync = lambda version: sender.send(state, version)  # noqa: E731
        else:
            receiver = CollectiveReceiver(group, meta)

            def sync(version: int) -> None:  # as a generator: the last sync's tensors are loaded and let go
                staged.clear()
                staged.update(receiver.receive()[0])

        times: dict[str, list[float]] = {"raw": [], "asyncrl": []}
        for i in range(s.repeats + 1):  # i = 0: warm-up of each
            times["raw"].append(_timed(lambda: dist.broadcast(flat, src=0), cuda))
            times["asyncrl"].append(_timed(lambda: sync(i), cuda))
        crcs = {"raw": crc([flat]), "asyncrl": crc(list(state.values()) if rank == 0 else
                                                   [staged[m.name] for m in meta.tensors])}
        staged.clear()
        queue.put((rank, {k: v[1:] for k, v in times.items()}, crcs, _work_alone(rank, state, meta, s, cuda)))
        dist.barrier()
    finally:
        group.close()
        dist.destroy_process_group()


def _work_alone(rank: int, state: dict[str, torch.Tensor], meta, s: Settings, cuda: bool) -> dict[str, float]:
    """asyncrl's own work per sync, with no transfer: the sender packing every bucket into a new buffer, or a
    receiver filling a new staging buffer per bucket (where the page faults of fresh memory land). Median."""
    def pack_all() -> None:
        for bucket in meta.buckets:
            pack_bucket([state[meta.tensors[i].name] for i in bucket])

    def stage_all() -> None:
        for index in range(len(meta.buckets)):
            empty_bucket(meta, index, state[meta.tensors[0].name].device).view(torch.uint8).fill_(0)

    name, fn = ("sender: pack buckets", pack_all) if rank == 0 else ("receiver: fresh staging buffers", stage_all)
    times = []
    for _ in range(s.repeats):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {name: statistics.median(times)}


def _ipc_rank_main(rank: int, s: Settings, queue, handles) -> None:
    """One host, one device (`s.device`): a raw copy out of the sender's shared flat buffer into a preallocated one,
    and asyncrl's ipc sync of the same tensors, alternating; puts (rank, {method: [s]}, crcs, {}) on `queue`."""
    torch.set_num_threads(1)
    cuda = s.device == "cuda"
    device = "cuda:0" if cuda else "cpu"
    store = dist.TCPStore("127.0.0.1", s.port, s.world_size, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore("ipc", store), rank=rank, world_size=s.world_size)
    state = build_state(s, random=rank == 0, device=device)
    meta = plan_buckets(state, s.bucket_bytes)
    try:
        if rank == 0:
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
            for _ in range(s.world_size - 1):
                handles.put(flat)  # a shared-memory file on the CPU, a CUDA IPC handle on the GPU
            shared, own = flat, flat
            sender = join_sender(store=store, host="127.0.0.1", port=s.port, world_size=s.world_size,
                                 timeout_s=TIMEOUT_S, meta=meta, device=device, group_name="bench")
            sync = lambda version: sender.send(state, version)  # noqa: E731
        else:
            shared = handles.get()  # opens the handle once, as an engine would at startup
            own = torch.empty_like(shared)
            receiver = join_receiver(host="127.0.0.1", port=s.port, rank=rank, world_size=s.world_size,
                                     timeout_s=TIMEOUT_S, meta=meta, store=store, group_name="bench")
            staged: dict[str, torch.Tensor] = {}

            def sync(version: int) -> None:
                staged.clear()  # the engine has loaded the last version: its staging is let go
                staged.update(receiver.receive()[0])

        times: dict[str, list[float]] = {"raw ipc": [], "asyncrl ipc": []}
        for i in range(s.repeats + 1):  # i = 0: warm-up of each
            times["raw ipc"].append(_timed((lambda: None) if rank == 0 else (lambda: own.copy_(shared)), cuda))
            times["asyncrl ipc"].append(_timed(lambda: sync(i), cuda))
        crcs = {"raw ipc": crc([own]), "asyncrl ipc": crc(list(state.values()) if rank == 0 else
                                                          [staged[m.name] for m in meta.tensors])}
        queue.put((rank, {k: v[1:] for k, v in times.items()}, crcs, {}))
        dist.barrier()  # the sender keeps its buffers alive until every receiver is done with them
        (sender if rank == 0 else receiver).close()
    finally:
        dist.destroy_process_group()


def run_ranks(s: Settings, ipc: bool = False) -> tuple[dict[str, list[float]], dict[str, bool], dict[str, float]]:
    """Spawn the ranks; per method, the slowest rank's time of each repeat, whether every crc matched, and the
    work measured alone (`_work_alone`, the slowest rank's)."""
    store, port = create_store(s.world_size, TIMEOUT_S)  # the master lives here; ranks connect as clients
    s = Settings(**{**s.__dict__, "port": port})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if ipc:
        handles = ctx.Queue()
        ctx_procs = [ctx.Process(target=_ipc_rank_main, args=(r, s, queue, handles)) for r in range(s.world_size)]
    else:
        ctx_procs = [ctx.Process(target=_rank_main, args=(r, s, queue)) for r in range(s.world_size)]
    for p in ctx_procs:
        p.start()
    results = [queue.get(timeout=TIMEOUT_S * 4) for _ in ctx_procs]
    for p in ctx_procs:
        p.join(timeout=TIMEOUT_S)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with code {p.exitcode}")
    del store
    by_rank = {rank: (times, crcs) for rank, times, crcs, _ in results}
    alone: dict[str, float] = {}
    for *_, work in results:
        for name, seconds in work.items():
            alone[name] = max(seconds, alone.get(name, 0.0))
    methods = by_rank[0][0].keys()
    slowest = {m: [max(by_rank[r][0][m][i] for r in by_rank) for i in range(s.repeats)] for m in methods}
    matched = {m: all(by_rank[r][1][m] == by_rank[0][1][m] for r in by_rank) for m in methods}
    return slowest, matched, alone


def run_ray(s: Settings, total_bytes: int) -> tuple[list[float], bool] | str:
    """`ray.put` in a sender actor, `ray.get` in each receiver actor; (put + slowest get per repeat, crcs
    matched), or the reason Ray did not run."""
    try:
        import ray
    except ImportError as exc:
        return f"Ray not importable ({exc})"
    os.environ.setdefault("RAY_worker_niceness", "0")  # as overlap.py: Ray's workers at the driver's priority
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, object_store_memory=max(3 * total_bytes, 256 * 2**20))
    except Exception as exc:  # the benchmark goes on without this row
        return f"Ray did not start ({type(exc).__name__}: {exc})"
    try:
        @ray.remote(num_cpus=0)
        class Sender:
            def __init__(self, settings: Settings) -> None:
                torch.set_num_threads(1)
                self.state = build_state(settings, random=True)

            def put(self) -> tuple[list, float]:
                start = time.perf_counter()
                ref = ray.put(self.state)
                return [ref], time.perf_counter() - start  # in a list: the driver must not fetch it

            def crc(self) -> int:
                return crc(list(self.state.values()))

        @ray.remote(num_cpus=0)
        class Receiver:
            def get(self, refs: list) -> tuple[float, int | None]:
                torch.set_num_threads(1)
                start = time.perf_counter()
                state = ray.get(refs[0])
                self.state = state  # held, as a generator would hold its new weights
                return time.perf_counter() - start, crc(list(state.values()))

        sender = Sender.remote(s)
        receivers = [Receiver.remote() for _ in range(s.world_size - 1)]
        times, crcs = [], set()
        for _ in range(s.repeats + 1):
            refs, put_s = ray.get(sender.put.remote())
            gets = ray.get([r.get.remote(refs) for r in receivers])
            del refs
            times.append(put_s + max(g for g, _ in gets))
            crcs.update(c for _, c in gets)
        return times[1:], crcs == {ray.get(sender.crc.remote())}
    finally:
        ray.shutdown()


def _row(name: str, seconds: list[float], nbytes: int, matched: bool) -> float:
    med = statistics.median(seconds)
    runs = ", ".join(f"{t:.3f}" for t in seconds)
    print(f"  {name:<22} {med:8.3f} s  {nbytes / med / 1e9:7.2f} GB/s   runs: {runs}"
          f"{'' if matched else '   BYTES DIFFER'}")
    return med


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, vocab 1024, 1 repeat: a smoke run")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2-0.5B has 24)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--receivers", type=int, default=1, help="receiving ranks (world size = receivers + 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed transfers per method (median); default 3")
    ap.add_argument("--bucket-mb", type=float, default=WeightSyncConfig().bucket_mb,
                    help="asyncrl's bucket size (default: weight_sync.bucket_mb's)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray object-store row")
    args = ap.parse_args(argv)
    vocab = 1024 if args.quick else 151936
    layers = 2 if args.quick else args.layers
    repeats = args.repeats or (1 if args.quick else 3)
    s = Settings(layers=layers, vocab=vocab, dtype=args.dtype, world_size=args.receivers + 1, repeats=repeats,
                 bucket_bytes=int(args.bucket_mb * 2**20), backend="gloo")
    meta = plan_buckets(build_state(s, random=False), s.bucket_bytes)  # empty tensors: only the plan
    nbytes = meta.total_bytes
    print(f"weights: Qwen2-0.5B-shaped, {layers} layers, vocab {vocab}, {args.dtype}: {len(meta.tensors)} tensors, "
          f"{nbytes / 1e9:.3f} GB; asyncrl buckets: {len(meta.buckets)} of <= {args.bucket_mb:g} MiB")
    print(f"ranks: 1 sender + {args.receivers} receiver(s), one process each, 1 torch thread; "
          f"median of {repeats} after 1 warm-up; time = the slowest rank's")

    print("gloo (CPU, 127.0.0.1):")
    times, matched, alone = run_ranks(s)
    raw = _row("raw dist.broadcast", times["raw"], nbytes, matched["raw"])
    ours = _row("asyncrl collective", times["asyncrl"], nbytes, matched["asyncrl"])
    print(f"  asyncrl / raw = {ours / raw:.2f}x the raw broadcast's time; asyncrl's own work measured alone "
          f"(no transfer): " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in alone.items()))

    print("Ray object store:")
    got = "skipped: --no-ray" if args.no_ray else run_ray(s, nbytes)
    if isinstance(got, str):
        print(f"  {got}")
    else:
        _row("ray.put + ray.get", got[0], nbytes, got[1])

    print("IPC (one host; CPU: a shared-memory file):")
    t, ok, _ = run_ranks(s, ipc=True)
    ipc_raw = _row("raw shared-memory copy", t["raw ipc"], nbytes, ok["raw ipc"])
    ipc = _row("asyncrl ipc", t["asyncrl ipc"], nbytes, ok["asyncrl ipc"])
    print(f"  asyncrl ipc / raw copy = {ipc / ipc_raw:.2f}x; asyncrl ipc / raw gloo broadcast = {ipc / raw:.2f}x")
    matched.update({f"cpu {k}": v for k, v in ok.items()})

    print("NCCL / CUDA IPC:")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("  skipped: no CUDA")
    else:
        if gpus >= s.world_size:
            t, ok, _ = run_ranks(Settings(**{**s.__dict__, "backend": "nccl"}))
            _row("raw NCCL broadcast", t["raw"], nbytes, ok["raw"])
            _row("asyncrl NCCL", t["asyncrl"], nbytes, ok["asyncrl"])
        else:
            print(f"  NCCL skipped: {gpus} GPU(s) for {s.world_size} ranks (two NCCL ranks cannot share a GPU)")
        t, ok, _ = run_ranks(Settings(**{**s.__dict__, "device": "cuda"}), ipc=True)
        _row("raw CUDA IPC copy", t["raw ipc"], nbytes, ok["raw ipc"])
        _row("asyncrl ipc (CUDA)", t["asyncrl ipc"], nbytes, ok["asyncrl ipc"])
        matched.update({f"cuda {k}": v for k, v in ok.items()})

    if not all(matched.values()):
        raise SystemExit("a receiver's bytes differ from the sender's")
    result = {"benchmark": "weight_sync", "value": round(ours, 4), "unit": "s", "baseline": round(raw, 4),
              "ratio": round(raw / ours, 3), "target": TARGET}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
