"""The weight-sync group's NCCL path on ONE GPU: two processes, both on cuda:0, as two NCCL "hosts".

NCCL refuses two ranks of one communicator on the same device of the same host ("Duplicate GPU detected").
It tells hosts apart by a hash of the hostname and boot id, which the environment variable NCCL_HOSTID
replaces: two processes with different NCCL_HOSTID values are two hosts to NCCL, which then connects them
through its socket transport (here over loopback) and lets both keep cuda:0. So the NCCL broadcast of
transports/collective.py (`join_group`, `CollectiveSender`, `CollectiveReceiver`: header, announcements,
double-buffered packing, staging buffers on the receiver's device) is exercised on the single GPU a check
machine has (.device/check.sh), not only on two.

Each rank is a spawned process (CUDA cannot be forked); the store's master lives in this process. The
source sends several versions of a bucketed model state dict (bf16 and fp32 tensors, an int64 one, sizes
that are not multiples of anything, one tensor larger than a bucket), as they are or planned in bfloat16
(the engines' dtype: the source converts its fp32 tensors while packing, as with mixed precision); the
receiver checks that every tensor it got is on its GPU and bit-identical to the state it rebuilds from the
same seed (converted the same way), and both ranks report a SHA-256 per tensor, compared here. The same
ranks run over gloo on the CPU (the test below the NCCL one), so this harness is checked on every machine.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import traceback
from typing import Any

import pytest
import torch

from transports import CollectiveReceiver, CollectiveSender, create_store, join_group, plan_buckets
from transports.bucketing import wire_dtype

TIMEOUT_S = 120.0
VERSIONS = (1, 2, 3, 4)
BUCKET_BYTES = 64 * 1024  # the embedding (fp32, 256 KB) gets a bucket of its own; the rest share several
# NCCL settings for two "hosts" on one machine: the socket transport over loopback, nothing that looks for
# a fabric (InfiniBand, NVLink SHARP, multi-node NVLink) that would try to pair the two ranks' same GPU
NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_MNNVL_ENABLE": "0"}


def model_state(version: int, device: str) -> dict[str, torch.Tensor]:
    """A Qwen2-like state dict whose values depend on `version` (every rank rebuilds the same one)."""
    g = torch.Generator().manual_seed(1000 + version)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return {
        "model.embed_tokens.weight": rand(1001, 64),                           # 256,256 B > one bucket
        "model.layers.0.input_layernorm.weight": rand(63),                      # fp32, 252 B
        "model.layers.0.self_attn.qkv_proj.weight": rand(193, 64, dtype=torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.bias": rand(193, dtype=torch.bfloat16),  # 386 B: odd size
        "model.layers.0.mlp.down_proj.weight": rand(64, 301, dtype=torch.bfloat16),
        "model.layers.1.input_layernorm.weight": rand(63),                      # back to fp32: a new bucket
        "model.layers.1.mlp.up_proj.weight": rand(301, 64, dtype=torch.bfloat16),
        "model.norm.weight": rand(64),
        "lm_head.weight": rand(517, 64, dtype=torch.bfloat16),
        "model.position_ids": torch.randint(0, 1 << 40, (37,), generator=g).to(device),  # int64: never converted
    }


def on_the_wire(state: dict[str, torch.Tensor], wire: str | None) -> dict[str, torch.Tensor]:
    """`state` as the receivers get it when the buckets are planned in `wire` (None: as it is)."""
    target = getattr(torch, wire) if wire else None
    return {n: t.to(wire_dtype(t.dtype, target)) for n, t in state.items()}


def checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            for name, t in state.items()}


def rank_main(rank: int, port: int, backend: str, device: str, wire: str | None, env: dict[str, str], out: Any,
              done: Any) -> None:
    """One member of the weight-sync group, in its own process: rank 0 sends VERSIONS, rank 1 receives them.
    Puts (rank, version, report) per version, or (rank, None, traceback) on any error. Rank 0 closes its group
    only once rank 1 set `done`: a broadcast is complete on its root when the bytes have left it, not when they
    arrived, and an aborted communicator would drop what is still on the way."""
    os.environ.update(env)  # before the first NCCL call, which reads them
    torch.set_num_threads(1)
    group = None
    try:
        group = join_group(host="127.0.0.1", port=port, rank=rank, world_size=2, backend=backend,
                           timeout_s=TIMEOUT_S, device=device)
        meta = plan_buckets(model_state(0, device), BUCKET_BYTES, dtype=getattr(torch, wire) if wire else None)
        if rank == 0:
            sender = CollectiveSender(group, meta)
            for version in VERSIONS:
                state = model_state(version, device)
                stats = sender.send(state, version)
                sent = checksums(on_the_wire(state, wire))
                out.put((rank, version, {"sums": sent, "buckets": stats["sync/buckets"]}))
            done.wait(TIMEOUT_S)
        else:
            receiver = CollectiveReceiver(group, meta)
            for version in VERSIONS:
                staged, got, stats = receiver.receive(armed=version > VERSIONS[0])
                expected = on_the_wire(model_state(version, device), wire)
                out.put((rank, version, {
                    "version": got, "sums": checksums(staged), "buckets": stats["sync/buckets"],
                    "devices": sorted({str(t.device) for t in staged.values()}),
                    "dtypes": {n: str(t.dtype) for n, t in staged.items()},
                    "equal": {n: torch.equal(staged[n].reshape(-1).view(torch.uint8),
                                             t.reshape(-1).view(torch.uint8)) for n, t in expected.items()},
                }))
            done.set()
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        out.put((rank, None, traceback.format_exc()))
    finally:
        if group is not None:
            group.close()


def run_pair(backend: str, device: str, wire: str | None,
             envs: tuple[dict[str, str], dict[str, str]]) -> dict[tuple[int, int], dict]:
    """Spawn both ranks; {(rank, version): report}. Fails with a rank's traceback if one raised."""
    store, port = create_store(2, TIMEOUT_S)  # the master stays here; both ranks connect as clients
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=rank_main, args=(rank, port, backend, device, wire, envs[rank], out, done))
             for rank in (0, 1)]
    for p in procs:
        p.start()
    reports: dict[tuple[int, int], dict] = {}
    try:
        while len(reports) < 2 * len(VERSIONS):
            try:
                rank, version, report = out.get(timeout=TIMEOUT_S * 2)
            except queue.Empty:
                pytest.fail(f"no report within {TIMEOUT_S * 2:.0f}s; exit codes {[p.exitcode for p in procs]}")
            if version is None:
                pytest.fail(f"rank {rank} failed:\n{report}")
            reports[(rank, version)] = report
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            assert p.exitcode == 0, f"a rank exited with code {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        del store
    return reports


def check_reports(reports: dict[tuple[int, int], dict], device: str, wire: str | None) -> None:
    names = list(model_state(0, "cpu"))
    for version in VERSIONS:
        sent, got = reports[(0, version)], reports[(1, version)]
        assert got["version"] == version
        assert got["devices"] == [device]
        assert got["dtypes"] == {n: str(t.dtype) for n, t in on_the_wire(model_state(0, "cpu"), wire).items()}
        assert got["equal"] == {n: True for n in names}, f"version {version}: tensors differ"
        assert got["sums"] == sent["sums"], f"version {version}: checksums differ"
        assert got["buckets"] == sent["buckets"] > 2
    # the versions really differ, so a receiver that kept an old one would have been caught
    assert len({reports[(0, v)]["sums"]["lm_head.weight"] for v in VERSIONS}) == len(VERSIONS)


WIRES = [None, "bfloat16"]  # as held; in the engines' dtype (fp32 converted while packing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("wire", WIRES)
def test_two_nccl_ranks_on_one_gpu_with_distinct_host_ids_receive_bit_identical_versions(wire):
    envs = ({**NCCL_ENV, "NCCL_HOSTID": "asyncrl-check-host-0"}, {**NCCL_ENV, "NCCL_HOSTID": "asyncrl-check-host-1"})
    check_reports(run_pair("nccl", "cuda:0", wire, envs), "cuda:0", wire)


@pytest.mark.slow  # two spawned interpreters importing torch: about 10 s on 2 cores
@pytest.mark.parametrize("wire", WIRES)
def test_the_same_two_process_ranks_over_gloo_receive_bit_identical_versions(wire):
    check_reports(run_pair("gloo", "cpu", wire, ({}, {})), "cpu", wire)


def test_the_state_has_bf16_and_fp32_buckets_and_a_tensor_larger_than_a_bucket():
    state = model_state(0, "cpu")
    meta = plan_buckets(state, BUCKET_BYTES)
    dtypes = [meta.tensors[b[0]].dtype for b in meta.buckets]
    assert {"float32", "bfloat16", "int64"} <= set(dtypes) and len(meta.buckets) >= 4
    in_bf16 = plan_buckets(state, BUCKET_BYTES, dtype=torch.bfloat16)
    assert {in_bf16.tensors[b[0]].dtype for b in in_bf16.buckets} == {"bfloat16", "int64"}
    assert len(in_bf16.buckets) > 2
    assert max(t.numel() * t.element_size() for t in state.values()) > BUCKET_BYTES
    assert any(t.numel() * t.element_size() % 8 for t in state.values())  # not all multiples of 8 bytes
