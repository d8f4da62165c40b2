"""Thin Ray wrappers around the roles: one async actor class hosts any role and adds only lifecycle
(construction in the actor's process, thread settings, joining the weight-sync group).

Roles never import Ray: they receive collaborators as objects with async methods. `RayProxy` turns an
actor handle into such an object, so `await buffer.admit(...)` in a role becomes an actor call.

Each actor also answers the Controller's watch (`heartbeat`, asyncrl/control/watchdog.py) from its "watch"
concurrency group, a thread with an event loop of its own: the answer comes while the role's own loop is
blocked, and says where it is blocked.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import logging
import os
import sys
from datetime import timedelta
from typing import Any, Callable

import ray

from asyncrl import heap
from asyncrl.checkpoints.transfer import NodeFiles
from asyncrl.config.schema import Config
from asyncrl.control.watchdog import Heartbeat, LoopMonitor
from asyncrl.deploy import wire
from asyncrl.deploy.auto import (
    available_cpus,
    decide_threads,
    lower_priority,
    pin_cpus,
    run_cpus,
    scorers_in_buffer,
    set_torch_threads,
    thread_candidates,
)
from asyncrl.deploy.native_memory import bound_native_memory
from asyncrl.deploy.placement import require_device
from asyncrl.messages import WeightsMeta
from asyncrl.telemetry.metrics import ACTOR_CALLS, ProcessCpu
from asyncrl.telemetry.spans import SpanRecorder
from engines.base import CollectiveWeightEngine, weight_transport

# The launcher imports this module, and the buffer's process hosts its role with it: neither needs torch, whose
# import (with the role builders, the trainer's parallelism, the weight transports) is 1.5-2 s of CPU in each
# process that starts. What pulls torch is imported where a role that needs it is built or joins a group.

log = logging.getLogger(__name__)


class RayProxy:
    """`await proxy.method(*args)` → `await handle.call.remote("method", *args)` on a RoleActor.

    The call is submitted when `proxy.method(*args)` is called, not when it is first awaited: calls leave in
    the order they are made, and one made just before other work (a generator's `note_held` before it builds
    its report) is on its way meanwhile. The result is the call's ObjectRef (awaitable; `asyncio.ensure_future`
    and `gather` take it), or, for a call whose reply travels packed (asyncrl/deploy/wire.py), a future of the
    decoded reply. Arguments and replies of the calls `wire.WIRE` names cross as one msgpack blob.

    With `role` set, the calls go to that role hosted inside the actor beside its own (the scorers of
    `cluster.scorer_placement = "buffer"` live in the buffer actor): `handle.call_hosted.remote(role, index,
    "method", *args)`.
    """

    def __init__(self, handle: Any, role: str | None = None, index: int = 0) -> None:
        self._handle = handle
        self._role = role
        self._index = index

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._role is None:
            remote, route = self._handle.call.remote, (name,)
        else:
            remote, route = self._handle.call_hosted.remote, (self._role, self._index, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            ACTOR_CALLS.n += 1
            ref = remote(*route, *wire.encode_args(name, args), **kwargs)  # submitted now; the ObjectRef is awaitable
            return asyncio.ensure_future(_decoded(name, ref)) if wire.packs_reply(name) else ref

        return call

    def rebind(self, handle: Any) -> None:
        """Call `handle` from now on (a restarted actor replaces a dead one; every holder of this proxy follows)."""
        self._handle = handle

    def __reduce__(self):  # travels to other actors as the handle it wraps
        return (RayProxy, (self._handle, self._role, self._index))


class ActorCalls:
    """`await calls.method(*args)` → `await handle.method.remote(*args)`: the RoleActor's own methods (its
    lifecycle, the weight group's join and leave), where RayProxy reaches the role it hosts."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._handle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            ACTOR_CALLS.n += 1
            return method.remote(*args, **kwargs)

        return call

    def __reduce__(self):  # travels to other actors as the handle it wraps
        return (ActorCalls, (self._handle,))


async def _decoded(method: str, ref: Any) -> Any:
    return wire.decode_reply(method, await ref)


def _build(kind: str, cfg: Config, index: int, buffer: Any) -> Any:
    from asyncrl.deploy.build_scoring import build_buffer, build_scorer

    if kind == "buffer":
        return build_buffer(cfg)
    if kind == "scorer":
        return build_scorer(cfg, index, buffer)
    from asyncrl.deploy.build import build_generator, build_trainer

    return build_generator(cfg, index, buffer) if kind == "generator" else build_trainer(cfg, buffer)


async def _invoke(obj: Any, method: str, args: tuple, kwargs: dict) -> Any:
    """`obj.method(*args, **kwargs)` for a caller in another process: its packed argument decoded, its reply
    encoded (asyncrl/deploy/wire.py)."""
    result = getattr(obj, method)(*wire.decode_args(method, args), **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return wire.encode_reply(method, result)


def _model_on_this_node(cfg: Config, kind: str) -> None:
    """The model folder where this role runs: another node than the driver's may lack it. A tiny model
    (model.build_tiny) is written here; a real one must be on every node (or on shared storage): one line."""
    from engines.hf import ensure_model

    try:
        ensure_model(cfg.model)
    except (FileNotFoundError, FileExistsError) as exc:
        raise RuntimeError(f"the {kind} on node {ray.util.get_node_ip_address()}: {exc} — copy the model folder to "
                           f"every node that runs a role, or put it on storage they share") from None


def tune_threads(cfg: Config, kind: str, role: Any, spread: list[int] | None = None) -> None:
    """Where `cluster.torch_threads = "auto"` offers the role more than one thread count, measure them on its own
    work and keep the faster (asyncrl/deploy/thread_tuner.py): the trainer's updates, the native engine's decode steps.
    `spread` (the trainer pinned by the automatic affinity): every CPU of the run, a layout the trainer tries too.
    Not the trainer with `trainer.compile`: its compiled code is specialised to the thread count, so each count
    tried would compile the model again; it keeps the count it starts with."""
    from asyncrl.deploy.thread_tuner import ThreadTuner, TunedUpdater, trainer_layouts

    cpus = available_cpus()
    candidates = thread_candidates(cfg, len(cpus), kind)
    if kind == "trainer" and cfg.trainer.compile:
        return
    if kind == "trainer" and cfg.trainer.num_ranks == 1:
        fixed = None if cfg.cluster.torch_threads == "auto" else int(cfg.cluster.torch_threads)
        layouts = trainer_layouts(candidates, cpus, spread or [], fixed)
        if len(layouts) > 1:
            per_step = layouts != candidates  # layouts: judged by the steps' pace, two steps a window
            tuner = ThreadTuner(layouts, window=2, skip=2, decisive=1.3) if per_step else ThreadTuner(layouts)
            role.pipeline.learner = TunedUpdater(role.pipeline.learner, tuner, per_step=per_step)
    elif len(candidates) > 1 and kind == "generator" and hasattr(getattr(role.engine, "scheduler", None), "tuner"):
        role.engine.scheduler.tuner = ThreadTuner(candidates, window=8, skip=8)  # decode steps


class RoleActor(NodeFiles):
    """Hosts one role ("buffer", "generator", "scorer" or "trainer") in its own process; the buffer's actor also
    hosts the scorers with `cluster.scorer_placement = "buffer"`. NodeFiles: the driver's file calls, which carry
    checkpoints to and from a trainer on another node (asyncrl/checkpoints/transfer.py)."""

    def __init__(self, kind: str, cfg: Config, index: int = 0, buffer_handle: Any = None,
                 incarnation: int = 0, spread: list[int] | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        bound_native_memory()  # before any kernel: kernel caches that do not grow with each new shape
        pinned = getattr(cfg.cluster.affinity, kind)  # the kinds are cluster.affinity's role names
        if pinned:  # its start-up (imports, model loads) may use every CPU of the run; its work, its own (below)
            pin_cpus(run_cpus(cfg.cluster.affinity), kind)
        self.nice = lower_priority(cfg, kind)  # a generator beside the light roles (cluster.generator_nice)
        # the CPUs it will work on
        set_torch_threads(decide_threads(cfg, len(pinned) or len(available_cpus()), kind), light=kind == "buffer")
        self.kind = kind
        self.cfg = cfg
        self.device = require_device(cfg, kind)  # "cuda": the GPU Ray gave this actor (cluster.<kind>_gpus)
        if kind != "buffer" or scorers_in_buffer(cfg):
            _model_on_this_node(cfg, kind)
        self._buffer = RayProxy(buffer_handle) if buffer_handle is not None else None
        # trainer.num_ranks > 1: every trainer rank builds its role once the trainer group formed (join_trainer_group)
        ranked = kind == "trainer" and cfg.trainer.num_ranks > 1
        self.role = None if ranked else _build(kind, cfg, index, self._buffer)
        pin_cpus(pinned, kind)  # every thread the build started too
        if kind in ("generator", "scorer"):  # a late call of a dead incarnation must not count as this one's
            self.role.holder = f"{kind}/{index}#{incarnation}"
        if self.role is not None:
            tune_threads(cfg, kind, self.role, spread)  # spread: the trainer's, from asyncrl.deploy.auto.trainer_spread
        # roles that run inside this actor's process beside its own, called through `call_hosted`
        self.hosted: dict[str, list[Any]] = {}
        if kind == "buffer" and scorers_in_buffer(cfg):
            # in-process: the scorers await the buffer's methods directly (same event loop, no actor calls)
            from asyncrl.deploy.build_scoring import build_scorer

            self.hosted["scorer"] = [build_scorer(cfg, i, self.role) for i in range(cfg.reward.num_scorers)]
        self._store = None  # keeps the TCPStore master alive on the trainer
        self._trainer_store: Any = None  # the trainer group's store (rank 0: the master)
        self.name = {"buffer": "buffer", "trainer": f"trainer rank {index}" if index else "trainer"}.get(
            kind, f"{kind} {index}")
        self._monitor: LoopMonitor | None = None  # watches this process's event loop, from the first call
        if self.role is not None:
            self.role.process_cpu = ProcessCpu(from_now=False)  # its reports: this process's CPU (hosted scorers too)
            heap.settle()  # this process hosts the role until the run ends: no full collection walks its setup again

    def ready(self) -> str:
        return self.kind

    def placement(self) -> dict[str, Any]:
        """Where this actor runs: its device, the GPU ids Ray gave it, and whether it initialised CUDA (a role
        with no GPU must not). A process that never imported torch (the buffer's) is not made to."""
        torch = sys.modules.get("torch")
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "device": self.device, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_initialized": torch is not None and torch.cuda.is_initialized(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                # the buffer's process without torch: the count set_torch_threads left for it in OMP_NUM_THREADS
                "torch_threads": torch.get_num_threads() if torch is not None else int(os.environ["OMP_NUM_THREADS"]),
                "cpus": available_cpus(), "nice": self.nice,
                "gc_frozen": gc.get_freeze_count()}  # objects no collection walks (asyncrl/heap.py)

    def pid(self) -> int:
        """This actor's process id (fault tests kill it with SIGKILL)."""
        return os.getpid()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._watch_loop()
        report = wire.wants_report(method, kwargs)
        result = await _invoke(self.role, method, args, kwargs)
        if report:  # the role's window report rides on the reply; the buffer's carries its hosted scorers' too
            result = await wire.with_report(self.role, method, result, self.hosted.get("scorer", ()))
        return result

    async def call_hosted(self, role: str, index: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """A method of a role hosted in this process (see `hosted`)."""
        self._watch_loop()
        return await _invoke(self.hosted[role][index], method, args, kwargs)

    def _recorders(self) -> dict[str, SpanRecorder]:
        """The span recorders of the roles in this process, by role name (the buffer keeps none)."""
        out = {} if self.kind == "buffer" else {self.name: self.role.recorder}
        out.update({f"scorer {s.scorer_id}": s.recorder for s in self.hosted.get("scorer", [])})
        return out

    def _watch_loop(self) -> None:
        if self._monitor is None:  # on the actor's own event loop: the one the roles run on
            self._monitor = LoopMonitor(asyncio.get_running_loop(), self._recorders(),
                                        timeout_s=self.cfg.run.role_timeout_s, dump_stacks=True).start()

    @ray.method(concurrency_group="watch")
    async def heartbeat(self) -> Heartbeat:
        """The watch's probe: runs on the "watch" group's own thread, so it answers while the roles' loop is
        blocked (not while something holds the interpreter lock: then the probe's timeout speaks)."""
        if self._monitor is None:
            return Heartbeat(stalled_s=0.0)
        return self._monitor.heartbeat()

    # -- the trainer group (trainer.num_ranks > 1; asyncrl/roles/trainer_ranks.py) ----------------
    def open_trainer_store(self, world_size: int) -> tuple[str, int]:
        """Trainer rank 0: start the trainer group's TCPStore master; return (host, port) for the other ranks."""
        from transports.collective import create_store  # the trainer ranks' own group (trainer.num_ranks > 1)

        host = "127.0.0.1" if not self.cfg.cluster.address else ray.util.get_node_ip_address()
        self._trainer_store, port = create_store(world_size, self.cfg.weight_sync.timeout_s, host)
        return host, port

    async def join_trainer_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join the trainer group as `rank` and build this rank's role on it (rank 0: the Trainer; others: a
        TrainerRank). Blocks until every rank joined: the deployment asks them together."""
        import torch
        import torch.distributed as dist

        from asyncrl.deploy.build import build_trainer, build_trainer_rank
        from asyncrl.training.parallel import DataParallel

        timeout_s = self.cfg.weight_sync.timeout_s
        store = self._trainer_store if rank == 0 else dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        device = torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")  # Ray's one GPU
        dp = await asyncio.to_thread(DataParallel.join, self.cfg.trainer.parallel, store=store, rank=rank,
                                     world_size=world_size, timeout_s=timeout_s, device=device)
        self._trainer_store = store
        build = (lambda: build_trainer(self.cfg, self._buffer, dp)) if rank == 0 else \
            (lambda: build_trainer_rank(self.cfg, dp))
        self.role = await asyncio.to_thread(build)
        self.role.process_cpu = ProcessCpu(from_now=False)
        heap.settle()  # as __init__ does for the other roles

    async def attach_trainer_ranks(self, handles: list[Any]) -> None:
        """Trainer rank 0, once every rank built its role: drive the other ranks' actors from now on."""
        from asyncrl.roles.trainer_ranks import RankedLearner

        ranks = RankedLearner(self.role.learner, [RayProxy(h) for h in handles], asyncio.get_running_loop())
        await self.role.attach_ranks(ranks)

    # -- weight-sync lifecycle (trainer is rank 0, generators 1..N) -------------------------------
    def weights_meta(self) -> WeightsMeta:
        """The bucket plan of the broadcast, describing the tensors in the engines' dtype (rollout.dtype): the
        sender converts the trainer's (float32 under mixed precision) as it packs each bucket. With several
        trainer ranks: the weights gathered after the last change (never a gather of rank 0 alone)."""
        from asyncrl.deploy.build import sync_dtype
        from transports.bucketing import plan_buckets

        tensors = self.role.pipeline.learner.state_dict_for_sync()
        return plan_buckets(tensors, int(self.cfg.weight_sync.bucket_mb * 2**20), dtype=sync_dtype(self.cfg))

    def open_weight_store(self, world_size: int) -> tuple[str, int]:
        """Trainer only: start the TCPStore master; return (host, port) for the other members."""
        # A local cluster keeps everything on loopback; on a multi-node cluster peers need our node IP. The
        # store listens on that address only.
        from transports import group as weight_group

        host = "127.0.0.1" if not self.cfg.cluster.address else ray.util.get_node_ip_address()
        self._store, port = weight_group.open_store(world_size, self.cfg.weight_sync.timeout_s, host)
        return host, port

    async def join_weight_group(self, host: str, port: int, rank: int, world_size: int,
                                backend: str, meta: WeightsMeta, group_name: str = "weights") -> None:
        """Blocks until every member has joined: the controller calls all members together. A group re-formed
        after a generator died has a fresh `group_name` (its own announcements, its count from 0)."""
        from transports import group as weight_group

        engine = getattr(self.role, "engine", None)
        if rank > 0 and isinstance(engine, CollectiveWeightEngine):
            # vLLM / SGLang: the engine's worker processes are the group member, not this actor.
            await engine.join_weight_group(host=host, port=port, rank=rank, world_size=world_size,
                                           backend=backend, timeout_s=self.cfg.weight_sync.timeout_s, meta=meta)
            return
        timeout_s = self.cfg.weight_sync.timeout_s
        if rank == 0:  # the trainer sends in the format the generators' engine receives (transports/group.py)
            self.role.pipeline.supervised = self.cfg.cluster.max_restarts > 0
            self.role.sender = await asyncio.to_thread(
                functools.partial(weight_group.join_trainer, transport=weight_transport(self.cfg.rollout.engine),
                                  backend=backend, store=self._store, host=host, port=port, world_size=world_size,
                                  timeout_s=timeout_s, meta=meta, group_name=group_name))
            return
        self.role.receiver = await asyncio.to_thread(
            functools.partial(weight_group.join_generator, backend=backend, host=host, port=port, rank=rank,
                              world_size=world_size, timeout_s=timeout_s, meta=meta, group_name=group_name))
        self.role.weight_group = group_name

    def leave_weight_group(self) -> None:
        """A generator died: end this member's group (a send or an armed receive in flight on it raises), so
        that every member can join the re-formed one. The trainer's next sends wait for the new group."""
        from transports import group as weight_group

        if self.kind == "trainer":
            old = self.role.pipeline.drop_sender()
        else:
            old, self.role.receiver = self.role.receiver, None
        weight_group.leave(old)

    async def save_checkpoint(self, path: str) -> str:
        """On a worker thread: writing a large model must not block the actor's event loop (the watch would
        take it for a stalled role)."""
        from asyncrl.deploy.build import export_dtype
        from engines.hf import load_tokenizer

        return await asyncio.to_thread(self.role.save_checkpoint, path, load_tokenizer(self.cfg.model.path),
                                       export_dtype(self.cfg))


RemoteRoleActor = ray.remote(concurrency_groups={"watch": 1})(RoleActor)
