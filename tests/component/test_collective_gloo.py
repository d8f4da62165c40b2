"""The collective weight-sync group on gloo: members are threads of this process (gloo is fine with
that; each thread holds its own ProcessGroupGloo over one shared TCPStore on 127.0.0.1:0)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from transports import (
    CollectiveReceiver,
    CollectiveSender,
    LocalWeightChannel,
    WeightReceiver,
    WeightSender,
    WeightSyncGroup,
    create_store,
    join_group,
    plan_buckets,
    resolve_backend,
)

torch.set_num_threads(1)


def _together(*fns: Callable[[], Any], limit_s: float = 30.0) -> list[Any]:
    """Run fns concurrently (as the controller's ray.get([...]) would) and return their results."""
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=limit_s) for f in futures]


def _form_group(world_size: int, timeout_s: float, backend: str = "gloo",
                devices: list[str] | None = None) -> list[WeightSyncGroup]:
    store, port = create_store(world_size, timeout_s)

    def join(rank: int) -> WeightSyncGroup:
        return join_group(host="127.0.0.1", port=port, rank=rank, world_size=world_size, backend=backend,
                          timeout_s=timeout_s, store=store if rank == 0 else None,
                          device=devices[rank] if devices else None)

    return _together(*(lambda r=r: join(r) for r in range(world_size)))


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "layers.0.attn.qkv": torch.randn(8, 24, generator=g).to(torch.bfloat16),
        "layers.0.norm": torch.randn(8, generator=g),
        "layers.0.mlp.up": torch.randn(8, 32, generator=g),
        "step_count": torch.randint(0, 1 << 40, (3,), generator=g, dtype=torch.int64),
        "lm_head.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_three_ranks_receive_bit_identical_weights_and_the_group_is_reusable():
    groups = _form_group(3, timeout_s=10.0)
    try:
        meta = plan_buckets(_state(0), bucket_bytes=512)
        assert len(meta.buckets) > 2
        sender = CollectiveSender(groups[0], meta)
        receivers = [CollectiveReceiver(g, meta) for g in groups[1:]]
        assert isinstance(sender, WeightSender) and isinstance(receivers[0], WeightReceiver)
        for version, seed in ((7, 0), (8, 1)):
            state = _state(seed)
            results = _together(lambda: sender.send(state, version), *(r.receive for r in receivers))
            send_stats = results[0]
            for staged, got_version, stats in results[1:]:
                assert got_version == version
                assert list(staged) == list(state)
                for name, t in state.items():
                    assert staged[name].dtype == t.dtype and staged[name].shape == t.shape
                    assert torch.equal(_bits(staged[name]), _bits(t)), name
                assert stats["sync/buckets"] == len(meta.buckets)
            for stats in [send_stats] + [r[2] for r in results[1:]]:
                assert stats["sync/bytes"] == sum(t.numel() * t.element_size() for t in state.values())
                assert stats["sync/seconds"] > 0
                assert stats["sync/gbps"] == pytest.approx(stats["sync/bytes"] / stats["sync/seconds"] / 1e9)
        assert not dist.is_initialized()  # the default group is never touched
    finally:
        for g in groups:
            g.close()


def test_a_long_run_of_broadcasts_leaves_no_announcement_keys_in_the_store():
    groups = _form_group(3, timeout_s=10.0)
    try:
        store = groups[0]._store  # the master (on the trainer in a run)
        assert store is not None
        keys_before = store.num_keys()
        meta = plan_buckets(_state(0), bucket_bytes=512)
        sender = CollectiveSender(groups[0], meta)
        receivers = [CollectiveReceiver(g, meta) for g in groups[1:]]
        state = _state(0)
        for version in range(5):
            _together(lambda: sender.send(state, version), *(r.receive for r in receivers))
        assert store.num_keys() == keys_before
        announce = groups[0]._announce
        assert [announce.queue_len(f"to/{rank}") for rank in (1, 2)] == [0, 0]  # each popped by its receiver
    finally:
        for g in groups:
            g.close()


def test_receiver_times_out_when_the_source_never_sends():
    groups = _form_group(2, timeout_s=2.0)
    try:
        receiver = CollectiveReceiver(groups[1], plan_buckets(_state(0), 512))
        start = time.perf_counter()
        with pytest.raises(TimeoutError, match="header"):
            receiver.receive()
        assert time.perf_counter() - start < 2.0 + 1.5
        with pytest.raises(RuntimeError, match="broken"):  # a failed group is not silently reused
            receiver.receive()
    finally:
        for g in groups:
            g.close()


def test_an_armed_receiver_waits_past_the_group_timeout_and_joins_when_the_source_sends():
    groups = _form_group(2, timeout_s=1.0)
    try:
        state = _state(3)
        meta = plan_buckets(state, 512)
        sender, receiver = CollectiveSender(groups[0], meta), CollectiveReceiver(groups[1], meta)
        assert receiver.arms_early
        with ThreadPoolExecutor(2) as pool:
            armed = pool.submit(receiver.receive, armed=True)  # ahead of the send, as the controller arms it
            time.sleep(1.5)  # longer than the group's timeout: an unarmed receive would have failed
            assert not armed.done()
            send_stats = pool.submit(sender.send, state, 5).result(timeout=10)
            staged, version, stats = armed.result(timeout=10)
        assert version == 5 and all(torch.equal(_bits(staged[k]), _bits(v)) for k, v in state.items())
        assert stats["sync/seconds"] < 1.0  # the transfer, not the wait before it
        assert send_stats["sync/bytes"] == stats["sync/bytes"]
        # the members still count the same broadcasts: an ordinary pair goes through next
        _, version, _ = _together(lambda: sender.send(_state(4), 6), receiver.receive)[1]
        assert version == 6
    finally:
        for g in groups:
            g.close()


def test_an_armed_receiver_waiting_seconds_logs_no_c10d_timeout_warnings(capfd):
    # a store `wait` that times out makes libtorch log "[c10d] waitForInput ... timed out" twice; a receiver
    # armed through a train step of seconds (a real model) must not fill the console with them
    groups = _form_group(2, timeout_s=30.0)
    try:
        state = _state(5)
        meta = plan_buckets(state, 1 << 20)
        sender, receiver = CollectiveSender(groups[0], meta), CollectiveReceiver(groups[1], meta)
        capfd.readouterr()
        with ThreadPoolExecutor(2) as pool:
            armed = pool.submit(receiver.receive, armed=True)
            time.sleep(2.5)
            t0 = time.monotonic()
            pool.submit(sender.send, state, 1).result(timeout=10)
            _, version, _ = armed.result(timeout=10)
            seen_s = time.monotonic() - t0
        assert version == 1 and seen_s < 1.0
        err = capfd.readouterr().err
        assert "waitForInput" not in err and "timed out" not in err, err[-2000:]
    finally:
        for g in groups:
            g.close()


@pytest.mark.parametrize("bucket_bytes", [512, 1 << 20])  # several buckets; one bucket
def test_the_source_releases_the_weights_once_packed_and_sends_what_they_were(bucket_bytes):
    groups = _form_group(2, timeout_s=10.0)
    try:
        state = _state(5)
        expected = {k: v.clone() for k, v in state.items()}
        meta = plan_buckets(state, bucket_bytes)
        sender, receiver = CollectiveSender(groups[0], meta), CollectiveReceiver(groups[1], meta)
        calls = []

        def released() -> None:  # the trainer's next update may write the weights from here on
            calls.append(len(calls))
            for t in state.values():
                t.zero_()

        _, (staged, version, _) = _together(lambda: sender.send(state, 9, released=released), receiver.receive)
        assert calls == [0] and version == 9
        assert all(torch.equal(_bits(staged[k]), _bits(v)) for k, v in expected.items())
    finally:
        for g in groups:
            g.close()


def test_an_armed_receiver_ends_with_an_error_when_its_group_is_closed():
    groups = _form_group(2, timeout_s=1.0)
    try:
        receiver = CollectiveReceiver(groups[1], plan_buckets(_state(0), 512))
        with ThreadPoolExecutor(1) as pool:
            armed = pool.submit(receiver.receive, armed=True)
            time.sleep(0.2)
            t0 = time.monotonic()
            groups[1].close()  # wakes the blocked wait for the announcement
            with pytest.raises(RuntimeError, match="closed"):
                armed.result(timeout=5)
            assert time.monotonic() - t0 < 1.0
    finally:
        for g in groups:
            g.close()


def test_an_announcement_wakes_the_waiting_receiver_at_once_and_one_out_of_order_breaks_the_group():
    # the receiver blocks in the store's server until the source's push arrives: no polling interval to wait out
    groups = _form_group(3, timeout_s=10.0)
    try:
        source, receiver = groups[0], groups[1]
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(receiver._announce_wait, 0, True)
            time.sleep(0.3)
            assert not waiting.done()
            source._announce_set(0)
            t0 = time.monotonic()
            waiting.result(timeout=5)
            assert time.monotonic() - t0 < 0.1
        assert groups[2]._announce.queue_len("to/2") == 1  # the other receiver's announcement waits for it
        source._announce.queue_push("to/1", "7")  # not broadcast 1: the members no longer count the same
        with pytest.raises(RuntimeError, match="expected the announcement of broadcast 1"):
            receiver._announce_wait(1, False)
        with pytest.raises(RuntimeError, match="broken"):
            CollectiveReceiver(receiver, plan_buckets(_state(0), 512)).receive()
    finally:
        for g in groups:
            g.close()


def test_a_send_whose_receiver_never_comes_ends_at_once_when_its_group_is_closed():
    # A receiver killed mid-sync never takes part; supervision makes every member leave (close) the group. The
    # source's broadcast in flight ends then, not at the group's timeout: a blocked trainer would hold every
    # later sync, the re-formed group's too.
    groups = _form_group(2, timeout_s=60.0)
    try:
        sender = CollectiveSender(groups[0], plan_buckets(_state(0), 512))
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(sender.send, _state(0), 1)
            time.sleep(0.3)
            assert not sending.done()  # the header waits for the receiver that never comes
            t0 = time.monotonic()
            groups[0].close()
            with pytest.raises(RuntimeError, match="weight-sync group is closed"):
                sending.result(timeout=10)
            assert time.monotonic() - t0 < 2.0
    finally:
        for g in groups:
            g.close()


def test_receiver_holding_a_different_meta_fails_loudly_instead_of_misreading():
    groups = _form_group(2, timeout_s=1.0)
    try:
        state = _state(0)
        sender = CollectiveSender(groups[0], plan_buckets(state, 512))
        receiver = CollectiveReceiver(groups[1], plan_buckets(state, 4096))  # another plan
        with ThreadPoolExecutor(2) as pool:
            sent = pool.submit(sender.send, state, 1)
            with pytest.raises(RuntimeError, match="meta"):
                pool.submit(receiver.receive).result(timeout=10)
            with pytest.raises((TimeoutError, RuntimeError)):  # nobody takes the buckets
                sent.result(timeout=10)
    finally:
        for g in groups:
            g.close()


def test_join_times_out_when_a_member_never_joins():
    store, port = create_store(2, timeout_s=1.0)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="join"):
        join_group(host="127.0.0.1", port=port, rank=0, world_size=2, backend="gloo", timeout_s=1.0, store=store)
    assert time.perf_counter() - start < 1.0 + 1.5


def test_source_rejects_tensors_that_do_not_match_the_meta_before_sending():
    (group,) = _form_group(1, timeout_s=5.0)
    try:
        state = _state(0)
        sender = CollectiveSender(group, plan_buckets(state, 512))
        state["embed.weight"] = torch.zeros(3)
        with pytest.raises(ValueError, match="embed.weight"):
            sender.send(state, 1)
        with pytest.raises(ValueError, match="rank 0"):
            CollectiveReceiver(group, sender.meta)
    finally:
        group.close()


def test_resolve_backend():
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert resolve_backend("gloo") == "gloo"
    with pytest.raises(ValueError):
        resolve_backend("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_backend("nccl")


def test_local_channel_hands_out_copies_of_the_latest_version():
    channel = LocalWeightChannel(timeout_s=0.05)
    assert isinstance(channel, WeightSender) and isinstance(channel.receiver(), WeightReceiver)
    with pytest.raises(TimeoutError):
        channel.receive()
    state = _state(0)
    expected = {k: v.clone() for k, v in state.items()}
    send_stats = channel.send(state, 3)
    state["embed.weight"].add_(1.0)  # the trainer keeps training in place
    got = [channel.receive() for _ in range(2)]
    for staged, version, stats in got:
        assert version == 3
        for name, t in expected.items():
            assert torch.equal(_bits(staged[name]), _bits(t)), name
        assert stats["sync/bytes"] == send_stats["sync/bytes"] == sum(t.nbytes for t in expected.values())
        assert stats["sync/seconds"] > 0
    got[0][0]["embed.weight"].zero_()  # receivers own their copies
    assert torch.equal(got[1][0]["embed.weight"], expected["embed.weight"])
    channel.send(_state(1), 4)
    assert channel.receive()[1] == 4 and channel.version == 4


def test_a_local_channel_in_the_engines_dtype_hands_out_bf16_copies_of_float32_weights():
    channel = LocalWeightChannel(dtype=torch.bfloat16)
    state = {k: v.float() if v.is_floating_point() else v for k, v in _state(2).items()}
    channel.send(state, 1)
    staged, version, stats = channel.receive()
    assert version == 1
    for name, t in state.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert staged[name].dtype == want.dtype and torch.equal(_bits(staged[name]), _bits(want)), name
    assert stats["sync/bytes"] == sum(t.numel() * (2 if t.is_floating_point() else 8) for t in state.values())


def test_a_float32_source_with_a_bf16_plan_delivers_bf16_equal_to_converting_the_source():
    groups = _form_group(2, timeout_s=10.0)
    try:
        # float32 master weights (the trainer under mixed precision); the engines hold bfloat16
        state = {k: v.float() if v.is_floating_point() else v for k, v in _state(4).items()}
        meta = plan_buckets(state, bucket_bytes=512, dtype=torch.bfloat16)
        assert len(meta.buckets) > 2 and meta.total_bytes < sum(t.nbytes for t in state.values())
        sender, receiver = CollectiveSender(groups[0], meta), CollectiveReceiver(groups[1], meta)
        for version, seed in ((1, 4), (2, 5)):  # twice: the reused pack buffers carry nothing over
            state = {k: v.float() if v.is_floating_point() else v for k, v in _state(seed).items()}
            send_stats, (staged, got_version, stats) = _together(lambda: sender.send(state, version), receiver.receive)
            assert got_version == version
            for name, t in state.items():
                want = t.to(torch.bfloat16) if t.is_floating_point() else t
                assert staged[name].dtype == want.dtype and staged[name].shape == want.shape, name
                assert torch.equal(_bits(staged[name]), _bits(want)), name
            assert send_stats["sync/bytes"] == stats["sync/bytes"] == meta.total_bytes
    finally:
        for g in groups:
            g.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (two NCCL ranks cannot share one)")
def test_nccl_two_ranks_receive_bit_identical_weights():
    groups = _form_group(2, timeout_s=60.0, backend="nccl", devices=["cuda:0", "cuda:1"])
    try:
        meta = plan_buckets(_state(0), bucket_bytes=512)
        state = {k: v.to("cuda:0") for k, v in _state(0).items()}
        _, (staged, version, _) = _together(
            lambda: CollectiveSender(groups[0], meta).send(state, 5), CollectiveReceiver(groups[1], meta).receive
        )
        assert version == 5
        for name, t in state.items():
            assert staged[name].device == torch.device("cuda:1")
            assert torch.equal(_bits(staged[name].cpu()), _bits(t.cpu())), name
    finally:
        for g in groups:
            g.close()


def test_the_weight_store_listens_on_the_given_address_only():
    import socket

    from transports.collective import create_store

    store, port = create_store(2, timeout_s=5.0)  # loopback by default
    try:
        with open("/proc/net/tcp") as f:  # local address column: hex IP:port, state 0A = LISTEN
            listening = [line.split()[1] for line in f.read().splitlines()[1:] if line.split()[3] == "0A"]
        assert f"0100007F:{port:04X}" in listening  # 127.0.0.1
        assert f"00000000:{port:04X}" not in listening  # not every interface
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=1).close()
    finally:
        del store
