"""The IPC weight transport (transports/ipc.py). Receivers run as spawned OS processes (as generator actors are)
mapping the sender's shared-memory buffer, on the CPU here and on CUDA under the gpu marker; the join, the store's
hygiene and the run-time torn-copy check are also tested with members as threads of this process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.messages import SamplingParams, WeightsMeta
from tests.component.test_collective_gloo import _state  # the same small mixed-dtype state
from transports import WeightReceiver, WeightSender, create_store, join_group, plan_buckets, resolve_backend
from transports.ipc import join_receiver, join_sender

torch.set_num_threads(1)

HOST = "127.0.0.1"
TIMEOUT_S = 60.0  # a spawned member imports torch first: on 2 busy cores that takes seconds
SHORT_S = 2.0  # the timeout under test


def _sending(sender) -> tuple[threading.Thread, list[BaseException]]:
    """`sender.send(version 1)` on a thread, once it has announced (it then waits for the acks); what it
    raised goes into the list."""
    raised: list[BaseException] = []

    def send() -> None:
        try:
            sender.send(_state(1), 1)
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            raised.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    while not sender._store.check(["sync/0"]):
        time.sleep(0.01)
    return thread, raised


def _meta() -> WeightsMeta:
    meta = plan_buckets(_state(0), bucket_bytes=512)
    assert len(meta.buckets) > 2  # several buckets, two dtypes
    return meta


def _bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for name, t in tensors.items()}


def _together(*fns: Callable[[], Any], limit_s: float = 30.0) -> list[Any]:
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=limit_s) for f in futures]


def _spawn(target: Callable[..., None], *args: Any) -> mp.Process:
    process = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def _finish(processes: list[mp.Process]) -> None:
    for p in processes:
        p.join(timeout=TIMEOUT_S)
        assert p.exitcode == 0, f"a receiver process exited with {p.exitcode}"


# -- receiver processes (spawned: module-level functions) ------------------------------------------------------
def _receiving(rank: int, port: int, world: int, meta: WeightsMeta, delay_s: float, syncs: int, out) -> None:
    """Receive `syncs` versions, sleeping `delay_s` before each (a slow generator); put what arrived on `out`."""
    torch.set_num_threads(1)
    receiver = join_receiver(host=HOST, port=port, rank=rank, world_size=world, timeout_s=TIMEOUT_S, meta=meta)
    got = []
    for _ in range(syncs):
        time.sleep(delay_s)
        asked_at = time.monotonic()
        staged, version, stats = receiver.receive(armed=delay_s == 0)
        got.append((version, _bytes(staged), asked_at, stats["sync/bytes"]))
    receiver.close()
    out.put((rank, got))


def _timing_out(port: int, meta: WeightsMeta, out) -> None:
    """Time out waiting for a version that never comes, then join the re-formed group and receive there."""
    torch.set_num_threads(1)
    out.put("ready")  # imports done: the short timeout below starts now
    receiver = join_receiver(host=HOST, port=port, rank=1, world_size=2, timeout_s=SHORT_S, meta=meta)
    for _ in range(2):  # the timeout, then the broken receiver refusing
        try:
            receiver.receive()
        except (TimeoutError, RuntimeError) as exc:
            out.put((type(exc).__name__, str(exc)))
    fresh = join_receiver(host=HOST, port=port, rank=1, world_size=2, timeout_s=TIMEOUT_S, meta=meta,
                          group_name="weights-1")
    staged, version, _ = fresh.receive(armed=True)
    out.put((version, _bytes(staged)))
    fresh.close()


def _closing(port: int, meta: WeightsMeta, out) -> None:
    """Start an armed receive, close the receiver while it waits, report what the receive raised."""
    torch.set_num_threads(1)
    receiver = join_receiver(host=HOST, port=port, rank=1, world_size=2, timeout_s=TIMEOUT_S, meta=meta)
    raised: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive(armed=True)
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            raised.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    while not receiver._lock.locked():  # the receive is in its wait
        time.sleep(0.01)
    time.sleep(0.2)
    receiver.close()
    thread.join(timeout=TIMEOUT_S)
    out.put([(type(e).__name__, str(e)) for e in raised])


# -- across processes, CPU shared memory ---------------------------------------------------------------------
def test_receiver_processes_get_every_version_bit_identical_and_a_slow_one_is_never_overwritten_mid_copy():
    meta = _meta()
    store, port = create_store(3, TIMEOUT_S)
    out = mp.get_context("spawn").Queue()
    syncs = 4
    processes = [_spawn(_receiving, 1, port, 3, meta, 0.0, syncs, out),   # armed, takes each at once
                 _spawn(_receiving, 2, port, 3, meta, 0.3, syncs, out)]   # slow: each receive comes late
    sender = join_sender(store=store, host=HOST, port=port, world_size=3, timeout_s=TIMEOUT_S, meta=meta,
                         device="cpu")
    assert isinstance(sender, WeightSender) and sender.device == torch.device("cpu")
    sent: dict[int, tuple[dict[str, bytes], float]] = {}
    for version in range(1, syncs + 1):
        state = _state(version)
        stats = sender.send(state, version)
        sent[version] = (_bytes(state), time.monotonic())  # the send has returned
        assert stats["sync/bytes"] == meta.total_bytes and stats["sync/buckets"] == len(meta.buckets)
    got = dict(out.get(timeout=TIMEOUT_S) for _ in processes)
    _finish(processes)
    sender.close()
    for rank in (1, 2):
        assert [v for v, *_ in got[rank]] == list(range(1, syncs + 1))
        for version, arrived, _, nbytes in got[rank]:
            assert arrived == sent[version][0], f"rank {rank}, version {version}: bytes differ from the sent ones"
            assert nbytes == meta.total_bytes
    for version, _, slow_asked_at, _ in got[2]:
        # each send returned only after the slow receiver asked for (and copied) its version: the next version's
        # write waited for it, which is why its bytes above are whole
        assert slow_asked_at <= sent[version][1]
    assert store.num_keys() <= 1  # no handle, join, announcement or ack key left behind (TCPStore's own: 1)


def test_a_timeout_on_either_side_is_one_line_and_breaks_it_and_a_re_formed_group_works():
    meta = _meta()
    store, port = create_store(2, TIMEOUT_S)
    out = mp.get_context("spawn").Queue()
    processes = [_spawn(_timing_out, port, meta, out)]
    assert out.get(timeout=TIMEOUT_S) == "ready"
    sender = join_sender(store=store, host=HOST, port=port, world_size=2, timeout_s=SHORT_S, meta=meta, device="cpu")
    kind, text = out.get(timeout=TIMEOUT_S)
    assert kind == "TimeoutError" and "\n" not in text
    assert text == "weight sync (ipc): no version announced within 2.0s on rank 1 (the trainer never sent)"
    kind, text = out.get(timeout=TIMEOUT_S)
    assert kind == "RuntimeError" and "broken" in text
    with pytest.raises(TimeoutError) as raised:  # the receiver no longer takes versions: no ack comes
        sender.send(_state(3), 3)
    assert str(raised.value).startswith("weight sync (ipc): 0 of 1 receivers copied version 3 within 2.0s")
    assert "\n" not in str(raised.value)
    with pytest.raises(RuntimeError, match="broken"):  # never writes the buffer a late receiver may still read
        sender.send(_state(4), 4)
    sender.close()
    fresh = join_sender(store=store, host=HOST, port=port, world_size=2, timeout_s=TIMEOUT_S, meta=meta,
                        device="cpu", group_name="weights-1")
    fresh.send(_state(5), 5)
    version, arrived = out.get(timeout=TIMEOUT_S)
    assert version == 5 and arrived == _bytes(_state(5))
    _finish(processes)
    fresh.close()


def test_close_makes_a_waiting_receive_and_a_pending_send_raise():
    meta = _meta()
    store, port = create_store(2, TIMEOUT_S)
    out = mp.get_context("spawn").Queue()
    processes = [_spawn(_closing, port, meta, out)]
    sender = join_sender(store=store, host=HOST, port=port, world_size=2, timeout_s=TIMEOUT_S, meta=meta,
                         device="cpu")
    assert out.get(timeout=TIMEOUT_S) == [("RuntimeError", "weight-sync group is closed")]
    _finish(processes)
    thread, raised = _sending(sender)  # its receiver is gone: the send waits for an ack until closed
    sender.close()
    thread.join(timeout=TIMEOUT_S)
    assert [(type(e), str(e)) for e in raised] == [(RuntimeError, "weight-sync group is closed")]


# -- members as threads of this process ------------------------------------------------------------------------
def _form(world: int, timeout_s: float = 10.0):
    """(the master store, [sender, receivers...]); keep the store alive as long as the members."""
    meta = _meta()
    store, port = create_store(world, timeout_s)
    sender = lambda: join_sender(store=store, host=HOST, port=port, world_size=world,  # noqa: E731
                                 timeout_s=timeout_s, meta=meta, device="cpu")
    receivers = [lambda r=r: join_receiver(host=HOST, port=port, rank=r, world_size=world, timeout_s=timeout_s,
                                           meta=meta) for r in range(1, world)]
    return store, _together(sender, *receivers)


def test_the_sender_releases_the_weights_once_copied_and_receivers_get_what_they_were():
    store, (sender, receiver) = _form(2)
    assert isinstance(receiver, WeightReceiver) and receiver.arms_early
    state = _state(1)
    expected = _bytes(state)

    def released() -> None:  # the trainer's next update may write the weights from here on
        for t in state.values():
            t.zero_()

    (_, (staged, version, _)) = _together(lambda: sender.send(state, 9, released=released), receiver.receive)
    assert version == 9 and _bytes(staged) == expected and receiver.last_version == 9
    assert all(not t.any() for t in state.values())  # released() was called
    sender.close()
    receiver.close()


def test_a_receiver_reuses_its_cpu_staging_only_once_the_caller_let_go_of_every_tensor_of_it():
    store, (sender, receiver) = _form(2)

    def sync(version: int) -> dict[str, torch.Tensor]:
        return _together(lambda: sender.send(_state(version), version), receiver.receive)[1][0]

    def address(staged: dict[str, torch.Tensor]) -> int:
        return staged["embed.weight"].untyped_storage().data_ptr()

    held = sync(1)
    second = sync(2)  # `held` is still referenced: new memory
    assert address(second) != address(held) and _bytes(held) == _bytes(_state(1))
    kept = second["layers.0.norm"][2:]  # a view of a view keeps the memory too
    old, second = address(second), None
    third = sync(3)
    assert address(third) != old and _bytes({"n": kept}) == _bytes({"n": _state(2)["layers.0.norm"][2:]})
    old, third, kept = address(third), None, None
    assert address(sync(4)) == old  # let go of: the same memory again, no fresh pages to fault in
    sender.close()
    receiver.close()


def test_a_copy_that_overlaps_a_write_raises_instead_of_returning_two_versions_mixed():
    store, (sender, receiver) = _form(2, timeout_s=SHORT_S)
    thread, raised = _sending(sender)
    sender._arena.head.fill_(-1)  # what a sender writing the next version early would leave: the seqlock sees it
    with pytest.raises(RuntimeError, match="changed during the copy of sync 0"):
        receiver.receive()
    thread.join()
    assert [type(e) for e in raised] == [TimeoutError]  # no ack for a refused copy
    assert "0 of 1 receivers copied version 1" in str(raised[0])
    with pytest.raises(RuntimeError, match="broken"):
        receiver.receive()
    sender.close()
    receiver.close()


def test_a_receiver_holding_a_different_meta_fails_the_join_on_both_sides_in_one_line():
    other = plan_buckets(_state(0), bucket_bytes=1 << 20)  # one bucket: another layout
    store, port = create_store(2, 10.0)
    with ThreadPoolExecutor(2) as pool:
        sending = pool.submit(join_sender, store=store, host=HOST, port=port, world_size=2, timeout_s=10.0,
                              meta=_meta(), device="cpu")
        receiving = pool.submit(join_receiver, host=HOST, port=port, rank=1, world_size=2, timeout_s=10.0, meta=other)
        for future in (sending, receiving):
            with pytest.raises(RuntimeError, match="weights meta differs from this member's") as raised:
                future.result(timeout=30)
            assert "\n" not in str(raised.value) and "rank 1" in str(raised.value)


def test_the_join_times_out_in_one_line_when_a_member_never_joins():
    store, port = create_store(2, 1.0)
    with pytest.raises(TimeoutError, match=r"not all members joined within 1.0s") as raised:
        join_sender(store=store, host=HOST, port=port, world_size=2, timeout_s=1.0, meta=_meta(), device="cpu")
    assert "\n" not in str(raised.value)


def test_the_sender_rejects_tensors_that_do_not_match_the_meta_before_announcing():
    store, (sender, receiver) = _form(2)
    state = _state(0)
    state["layers.0.norm"] = torch.zeros(9)
    with pytest.raises(ValueError, match="layers.0.norm"):
        sender.send(state, 1)
    assert not sender._store.check(["sync/0"])
    sender.close()
    receiver.close()


def test_ipc_is_a_backend_name_but_forms_no_collective_group():
    assert resolve_backend("ipc") == "ipc"
    with pytest.raises(ValueError, match="transports.ipc"):
        join_group(host=HOST, port=1, rank=0, world_size=2, backend="ipc", timeout_s=1.0)
    with pytest.raises(ValueError, match="'ipc' only"):
        join_sender(store=None, host=HOST, port=1, world_size=2, backend="gloo", timeout_s=1.0, meta=_meta())


# -- CUDA IPC --------------------------------------------------------------------------------------------------
def _engine_receiving(port: int, meta: WeightsMeta, model_dir: str, prompt: list[int], out) -> None:
    """A generator's process: a TorchEngine on cuda:0 loads each received version; report bytes and logprobs."""
    torch.set_num_threads(1)
    from engines.torch_engine import TorchEngine

    engine = TorchEngine(model_dir, device="cuda:0", seed=0)
    receiver = join_receiver(host=HOST, port=port, rank=1, world_size=2, timeout_s=TIMEOUT_S, meta=meta)
    for _ in range(2):
        staged, version, _ = receiver.receive(armed=True)
        devices = sorted({str(t.device) for t in staged.values()})
        engine.load_weights(staged, version)
        params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=version)
        ((completion,),) = asyncio.run(engine.generate([prompt], params))
        out.put((version, devices, _bytes(staged), completion.response_ids, completion.logprobs, engine.version))
    asyncio.run(engine.close())
    receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_weights_reach_a_torch_engine_in_another_process_that_then_gives_the_trainers_logprobs(tmp_path):
    from asyncrl.config.schema import TinyModelConfig
    from engines import hf

    model_dir = tmp_path / "tiny"
    hf.build_tiny_model(model_dir, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                   intermediate_size=64, init_std=0.2))
    trainer = hf.load_model(model_dir, device="cuda:0")
    initial = hf.load_model(model_dir, device="cuda:0")
    state = {name: p.detach() for name, p in trainer.named_parameters()}
    meta = plan_buckets(state, bucket_bytes=4096)
    prompt = [5, 6, 7, 8]
    store, port = create_store(2, TIMEOUT_S)
    out = mp.get_context("spawn").Queue()
    processes = [_spawn(_engine_receiving, port, meta, str(model_dir), prompt, out)]
    sender = join_sender(store=store, host=HOST, port=port, world_size=2, timeout_s=TIMEOUT_S, meta=meta)
    assert sender.device == torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cuda:0").manual_seed(0)
    for version in (1, 2):
        with torch.no_grad():  # a train step's worth of change
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, device=p.device))
        sender.send(state, version)
        got_version, devices, arrived, response, logprobs, engine_version = out.get(timeout=TIMEOUT_S)
        assert (got_version, engine_version) == (version, version)
        assert devices == ["cuda:0"] and arrived == _bytes(state)
        with torch.no_grad():
            ids = torch.tensor([prompt + response], device="cuda:0")
            expected = [m(ids).logits[0, len(prompt) - 1: -1].float().log_softmax(-1)
                        .gather(-1, ids[0, len(prompt):, None]).squeeze(-1).cpu() for m in (trainer, initial)]
        torch.testing.assert_close(torch.tensor(logprobs), expected[0], atol=2e-4, rtol=0)
        assert (torch.tensor(logprobs) - expected[1]).abs().max() > 1e-2  # the engine runs the new weights
    _finish(processes)
    sender.close()
