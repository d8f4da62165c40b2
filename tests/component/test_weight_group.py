"""transports/group.py, the weight-sync group's membership: a trainer and two generators (threads of this process,
as in test_collective_gloo.py) join through it on gloo and the weights arrive bit-identical; leaving ends the
members, and a group re-formed under a new name on the same store works; in one process `join_local` connects the
roles through one channel."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from transports import group
from transports.bucketing import plan_buckets
from transports.local import LocalWeightChannel

torch.set_num_threads(1)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, 8, generator=g), "lm_head.weight": torch.randn(16, 8, generator=g)}


def _form(store, port: int, meta, name: str):
    def trainer():
        return group.join_trainer(transport="bucketed", backend="gloo", store=store, host="127.0.0.1", port=port,
                                  world_size=3, timeout_s=10.0, meta=meta, group_name=name)

    def generator(rank: int):
        return group.join_generator(backend="gloo", host="127.0.0.1", port=port, rank=rank, world_size=3,
                                    timeout_s=10.0, meta=meta, group_name=name)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(trainer), pool.submit(generator, 1), pool.submit(generator, 2)]
        return [f.result(timeout=30) for f in futures]


def _sync(sender, receivers, state, version):
    with ThreadPoolExecutor(3) as pool:
        sent = pool.submit(sender.send, state, version)
        got = [pool.submit(r.receive) for r in receivers]
        sent.result(timeout=30)
        return [g.result(timeout=30) for g in got]


def test_members_join_through_the_group_module_and_a_group_re_formed_on_the_same_store_works():
    meta = plan_buckets(_state(0), bucket_bytes=256)
    store, port = group.open_store(3, 10.0, "127.0.0.1")
    sender, *receivers = _form(store, port, meta, "weights")
    for staged, version, _ in _sync(sender, receivers, _state(1), 5):
        assert version == 5 and all(torch.equal(staged[k], v) for k, v in _state(1).items())
    for member in (sender, *receivers, None):  # a generator died: every live member leaves its group
        group.leave(member)
    sender, *receivers = _form(store, port, meta, "weights-1")  # re-formed, same store, fresh name
    try:
        for staged, version, _ in _sync(sender, receivers, _state(2), 6):
            assert version == 6 and all(torch.equal(staged[k], v) for k, v in _state(2).items())
    finally:
        for member in (sender, *receivers):
            group.leave(member)


def test_join_local_connects_the_trainer_and_every_generator_through_one_channel():
    trainer, generators = SimpleNamespace(), [SimpleNamespace(), SimpleNamespace()]
    channel = group.join_local(trainer, generators, shared=False, dtype=None)
    assert isinstance(channel, LocalWeightChannel) and trainer.sender is channel
    channel.send(_state(3), 1)
    for g in generators:
        staged, version, _ = g.receiver.receive()
        assert version == 1 and torch.equal(staged["embed.weight"], _state(3)["embed.weight"])
    group.leave(generators[0].receiver)  # nothing to end in one process: left as it is


def test_a_vllm_workers_member_joins_receives_and_leaves_through_transports_vllm():
    """The receiving half a vLLM worker holds (engines/vllm_worker.py) without vLLM: a member beside the trainer's
    sender on gloo."""
    from transports.vllm import WorkerMember

    meta = plan_buckets(_state(0), bucket_bytes=256)
    store, port = group.open_store(2, 10.0, "127.0.0.1")
    member = WorkerMember()
    with pytest.raises(RuntimeError, match="before joining"):
        member.receive()
    with ThreadPoolExecutor(2) as pool:
        sender = pool.submit(group.join_trainer, transport="bucketed", backend="gloo", store=store,
                             host="127.0.0.1", port=port, world_size=2, timeout_s=10.0, meta=meta)
        pool.submit(member.join, host="127.0.0.1", port=port, rank=1, world_size=2, backend="gloo", timeout_s=10.0,
                    meta=meta).result(timeout=30)
        sender = sender.result(timeout=30)
        sent = pool.submit(sender.send, _state(4), 9)
        staged, version, _ = member.receive()
        sent.result(timeout=30)
    assert version == 9 and all(torch.equal(staged[k], v) for k, v in _state(4).items())
    member.leave()
    group.leave(sender)
    assert member.group is None


def test_the_sglang_engines_header_read_gives_the_version_and_refuses_another_meta_or_none_in_time():
    import msgspec
    import torch.distributed as dist

    from transports.collective import meta_crc
    from transports.sglang import header_key, read_header

    meta = plan_buckets(_state(0), bucket_bytes=256)
    other = plan_buckets({"x": torch.zeros(3)}, bucket_bytes=256)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.2))
    store.set(header_key("g", 0), msgspec.msgpack.encode([7, meta_crc(meta)]))  # as the sender writes it
    assert read_header(store, "g", 0, meta) == 7
    with pytest.raises(RuntimeError, match="WeightsMeta differs"):
        read_header(store, "g", 0, other)
    with pytest.raises(TimeoutError, match="no header 'asyncrl-sglang/g/1'"):
        read_header(store, "g", 1, meta)


def test_the_drivers_form_opens_the_store_once_and_re_forms_the_group_on_it_and_leave_all_tolerates_the_dead():
    """`form` / `leave_all` as a deployment's driver calls them, with members standing for the actors: each joins
    through this module in a thread of its own, as RoleActor does in its process."""
    import asyncio

    meta = plan_buckets(_state(0), bucket_bytes=256)

    class Member:
        def __init__(self) -> None:
            self.opened, self.joined, self.member, self.store = 0, [], None, None

        async def weights_meta(self):
            return meta

        async def open_weight_store(self, world: int):
            self.opened += 1
            self.store, port = group.open_store(world, 10.0, "127.0.0.1")
            return "127.0.0.1", port

        async def join_weight_group(self, host, port, rank, world, backend, meta_, name):
            self.joined.append((rank, name))
            if rank == 0:
                self.member = await asyncio.to_thread(
                    lambda: group.join_trainer(transport="bucketed", backend=backend, store=self.store, host=host,
                                               port=port, world_size=world, timeout_s=10.0, meta=meta_,
                                               group_name=name))
            else:
                self.member = await asyncio.to_thread(
                    lambda: group.join_generator(backend=backend, host=host, port=port, rank=rank, world_size=world,
                                                 timeout_s=10.0, meta=meta_, group_name=name))

        async def leave_weight_group(self):
            group.leave(self.member)

    class Dead:
        async def leave_weight_group(self):
            raise RuntimeError("the actor died")

    async def main():
        trainer, gens = Member(), [Member(), Member()]
        address = await group.form(trainer, gens, backend="gloo")
        await group.leave_all([trainer, *gens, Dead()])
        again = await group.form(trainer, gens, backend="gloo", group_name="weights-1", store_address=address)
        staged = _sync(trainer.member, [g.member for g in gens], _state(5), 3)
        await group.leave_all([trainer, *gens])
        return trainer, gens, address, again, staged

    trainer, gens, address, again, staged = asyncio.run(asyncio.wait_for(main(), 60))
    assert trainer.opened == 1 and again == address  # one store for every group
    assert trainer.joined == [(0, "weights"), (0, "weights-1")] and gens[1].joined == [(2, "weights"), (2, "weights-1")]
    for tensors, version, _ in staged:
        assert version == 3 and torch.equal(tensors["embed.weight"], _state(5)["embed.weight"])


def test_a_local_receive_made_after_the_next_send_leaves_that_sends_receive_nothing_to_wait_for():
    """A late receive (made after the trainer's next send too) takes the newer version at once; the receive for that
    next send then returns it again instead of waiting out the timeout for a version after it (a run at max_staleness
    2 under load failed so: "no version > 3 was sent within 60s")."""
    import torch

    from transports.local import LocalWeightChannel

    channel = LocalWeightChannel(timeout_s=0.5)
    receiver = channel.receiver()
    channel.send({"w": torch.zeros(2)}, 1)
    assert receiver.receive()[1] == 1
    channel.send({"w": torch.ones(2)}, 2)
    channel.send({"w": torch.full((2,), 3.0)}, 3)     # the receive for version 2 comes late, after this send
    assert receiver.receive()[1] == 3
    tensors, version, _ = receiver.receive()           # the receive for version 3's send: no wait
    assert version == 3 and torch.equal(tensors["w"], torch.full((2,), 3.0))
    with pytest.raises(TimeoutError, match="no version > 3"):
        receiver.receive()                             # every send taken: the next receive waits for a send
