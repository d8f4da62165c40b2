"""The weight-sync group's membership in one place: open its store, join the trainer and each generator, leave.

Place in the dataflow: a deployment forms the group before the first step and re-forms it after a generator
died (supervision: asyncrl/control/supervisor.py asks the deployment, which calls these). Across processes the
driver runs `form`: the trainer's process opens the store once (`open_store`), then every member joins at once,
the trainer as rank 0 (`join_trainer`) and the generators as ranks 1..N (`join_generator`), each in its own
process (the Ray deployment's members are its actors: asyncrl/deploy/actors.py, asyncrl/deploy/launch.py). A
re-formed group has a fresh name (its announcements and counts start from 0); each live member first leaves the
old one (`leave_all` on the driver, `leave` in the member), which ends a send or an armed receive still waiting
on it. In one process (`--local`) there is no
store and no rendezvous: `join_local` connects the trainer and the generators through one
`LocalWeightChannel`. An engine whose own workers receive (vLLM, SGLang) joins through the engine
(`engines.base.CollectiveWeightEngine.join_weight_group`), not here.

Which sender the trainer joins with: `ipc` where `weight_sync.backend = "ipc"`, else the transport the rollout
engine declares (`engines.base.weight_transport`: "bucketed" or "per_tensor"), from `transports.base.SENDERS`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Sequence

from asyncrl.messages import WeightsMeta
from transports.base import SENDERS, WeightReceiver, WeightSender

log = logging.getLogger(__name__)


async def form(trainer: Any, generators: Sequence[Any], *, backend: str, group_name: str = "weights",
               store_address: tuple[str, int] | None = None) -> tuple[str, int]:
    """The driver's side of forming (or re-forming) the group across processes. `trainer` and `generators` are
    the members as awaitable-method objects (a Ray deployment's actor proxies) offering `weights_meta()`,
    `open_weight_store(world_size)` (the trainer: `open_store` in its process) and `join_weight_group(host, port,
    rank, world_size, backend, meta, group_name)` (`join_trainer` / `join_generator` in theirs). The store is
    opened once and kept for every re-formed group: pass the returned (host, port) back as `store_address`."""
    world = 1 + len(generators)
    meta = await trainer.weights_meta()
    host, port = store_address if store_address is not None else await trainer.open_weight_store(world)
    # every member joins at once: the group's rendezvous blocks until all ranks arrive
    await asyncio.gather(*[m.join_weight_group(host, port, rank, world, backend, meta, group_name)
                           for rank, m in enumerate([trainer, *generators])])
    return host, port


async def leave_all(members: Sequence[Any]) -> None:
    """The driver's side of a generator's death: every live member ends its part (`leave_weight_group()` in its
    process: `leave`); the dead one cannot answer, which is expected."""
    results = await asyncio.gather(*[m.leave_weight_group() for m in members], return_exceptions=True)
    for m, r in zip(members, results):
        if isinstance(r, BaseException):
            log.debug("leave_weight_group on %s: %r", m, r)


def open_store(world_size: int, timeout_s: float, host: str) -> tuple[Any, int]:
    """The group's TCPStore master, in the trainer's process: (the store, its port) — the other members connect
    to `host`:port."""
    from transports.collective import create_store

    return create_store(world_size, timeout_s, host)


def join_trainer(*, transport: str, backend: str, store: Any, host: str, port: int, world_size: int,
                 timeout_s: float, meta: WeightsMeta, group_name: str = "weights") -> WeightSender:
    """Rank 0's sender, once every member joined (they all call together). `transport`: the rollout engine's
    ("bucketed", "per_tensor"); `backend = "ipc"` takes the shared-memory transport instead."""
    join = SENDERS.get("ipc" if backend == "ipc" else transport)
    return join(store=store, host=host, port=port, world_size=world_size, backend=backend, timeout_s=timeout_s,
                meta=meta, group_name=group_name)


def join_generator(*, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                   meta: WeightsMeta, group_name: str = "weights") -> WeightReceiver:
    """Generator `rank`'s receiver (1..N), once every member joined: the trainer's shared buffer mapped (`ipc`),
    else a member of the bucketed broadcast's gloo/NCCL group."""
    if backend == "ipc":
        from transports.ipc import join_receiver

        return join_receiver(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s, meta=meta,
                             group_name=group_name)
    from transports.collective import CollectiveReceiver, join_group

    group = join_group(host=host, port=port, rank=rank, world_size=world_size, backend=backend,
                       timeout_s=timeout_s, group_name=group_name)
    return CollectiveReceiver(group, meta)


def leave(member: WeightSender | WeightReceiver | None) -> None:
    """End this member's part in its group (a send or an armed receive waiting on it raises), so that every
    member can join the re-formed one. A member with nothing to end (the in-process receiver) is left as it is."""
    close = getattr(member, "close", None)
    if close is not None:
        close()


def join_local(trainer: Any, generators: Iterable[Any], *, shared: bool, dtype: Any) -> Any:
    """In one process: the trainer sends through one LocalWeightChannel and each generator receives from it
    (`trainer.sender`, `generator.receiver` set); returns the channel."""
    from transports.local import LocalWeightChannel

    channel = LocalWeightChannel(shared=shared, dtype=dtype)
    trainer.sender = channel
    for g in generators:
        g.receiver = channel.receiver()
    return channel
