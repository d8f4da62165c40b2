"""In-process deployment: every role in one event loop (engine and trainer compute on worker threads).

Same roles, same Controller as the Ray deployment; weights travel through a LocalWeightChannel instead of
a collective group. Used by tests, for debugging a config without a cluster and on machines without Ray
(`asyncrl launch --local`, `run_local`): nothing on this path imports Ray (tests/unit/test_local_without_ray.py).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

from asyncrl.aio import run_loop
from asyncrl.config.schema import Config
from asyncrl.control.controller import Controller
from asyncrl.control.watchdog import Heartbeat, LoopMonitor, Probe
from asyncrl.deploy import wire
from asyncrl.deploy.auto import available_cpus, local_threads, set_torch_threads
from asyncrl.deploy.build import (
    build_buffer,
    build_generator,
    build_scorer,
    build_trainer,
    engine_dtype,
    export_dtype,
    sync_dtype,
    trained_dtype,
)
from asyncrl.deploy.native_memory import bound_native_memory
from engines.base import traits
from engines.hf import ensure_model
from transports import group as weight_group
from transports.local import LocalWeightChannel


class AsyncFacade:
    """Exposes every method of `obj` as an async method (sync ones are simply called); a call asked with
    `report=True` gets the role's window report on its reply, as from a Ray actor (asyncrl/deploy/wire.py)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            report = wire.wants_report(name, kwargs)
            result = attr(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return await wire.with_report(self._obj, name, result) if report else result

        return call


def shares_trainer_model(cfg: Config) -> bool:
    """In process, cluster.placement = "colocated" with the torch engine on the trainer's device and dtype: the
    generators' engines wrap the trainer's module (not under LoRA: they take the merged weights). They generate
    only between train steps (colocated roles take turns: asyncrl/pipeline.py), so what they read is always one
    whole policy version."""
    from asyncrl.deploy.placement import role_device

    return (cfg.cluster.placement == "colocated" and traits(cfg.rollout.engine).wraps_module
            and engine_dtype(cfg) == trained_dtype(cfg)  # (mixed precision: float32 master weights, no sharing)
            and cfg.model.lora is None  # (LoRA: the engines hold the merged weights, the trainer base + adapters)
            and role_device(cfg, "generator") == role_device(cfg, "trainer"))


class LocalDeployment:
    restartable: tuple[str, ...] = ()  # in process, a role cannot die without the run: nothing to supervise

    def __init__(self, cfg: Config) -> None:
        if cfg.trainer.num_ranks > 1:  # one process holds one trainer rank
            raise ValueError(f"trainer.num_ranks = {cfg.trainer.num_ranks}: an in-process run (--local) trains in one "
                             f"process — run it on Ray (drop --local), or set trainer.num_ranks = 1")
        if cfg.run.trainer_dir:  # the trainer is this process: it writes run.output_dir itself
            raise ValueError(f"run.trainer_dir = {cfg.run.trainer_dir!r}: an in-process run (--local) writes "
                             f"run.output_dir itself — remove run.trainer_dir, or run it on Ray (drop --local)")
        bound_native_memory()  # before any kernel (asyncrl/deploy/native_memory.py)
        set_torch_threads(local_threads(cfg, len(available_cpus())))
        self.cfg = cfg
        self.buffer_obj = build_buffer(cfg)
        self.trainer_obj = build_trainer(cfg, self.buffer_obj)
        # colocated in one process: the engines wrap the trainer's own module (no copy; a sync only names the
        # version), when they would hold the same tensors anyway (one device, one dtype)
        shared = self.trainer_obj.learner.model if shares_trainer_model(cfg) else None
        self.generator_objs = [build_generator(cfg, i, self.buffer_obj, shared_model=shared)
                               for i in range(cfg.rollout.num_generators)]
        self.shared_weights = shared is not None
        self.scorer_objs = [build_scorer(cfg, i, self.buffer_obj) for i in range(cfg.reward.num_scorers)]
        self.buffer = AsyncFacade(self.buffer_obj)
        self.trainer = AsyncFacade(self.trainer_obj)
        self.generators = [AsyncFacade(g) for g in self.generator_objs]
        self.scorers = [AsyncFacade(s) for s in self.scorer_objs]
        self.channel: LocalWeightChannel | None = None
        self.monitor: LoopMonitor | None = None

    def dead_role(self, exc: BaseException) -> str | None:
        return None

    def holder_of(self, role: str) -> str:
        return role

    async def leave_weight_groups(self) -> None:
        raise NotImplementedError("in-process runs are not supervised")

    async def generator_death(self) -> BaseException | None:
        raise NotImplementedError("in-process runs are not supervised")

    async def restart(self, kind: str, index: int) -> None:
        raise NotImplementedError("in-process runs are not supervised")

    async def setup_weight_sync(self, group_name: str = "weights") -> None:
        self.channel = weight_group.join_local(self.trainer_obj, self.generator_objs, shared=self.shared_weights,
                                               dtype=sync_dtype(self.cfg))

    def probes(self) -> dict[str, Probe]:
        """Every role shares this process's event loop: one monitor watches it (asyncrl/control/watchdog.py)."""
        if self.monitor is None:
            recorders = {"trainer": self.trainer_obj.recorder,
                         **{f"generator {g.generator_id}": g.recorder for g in self.generator_objs},
                         **{f"scorer {s.scorer_id}": s.recorder for s in self.scorer_objs}}
            self.monitor = LoopMonitor(asyncio.get_running_loop(), recorders,
                                       timeout_s=self.cfg.run.role_timeout_s).start()
        monitor = self.monitor

        async def heartbeat() -> Heartbeat:
            return monitor.heartbeat()

        return {"the in-process roles": heartbeat}

    async def save_checkpoint(self, path: str) -> None:
        from engines.hf import load_tokenizer

        # on a worker thread: writing a large model must not block the event loop every role shares
        await asyncio.to_thread(self.trainer_obj.save_checkpoint, path, load_tokenizer(self.cfg.model.path),
                                export_dtype(self.cfg))

    async def shutdown(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        if self.channel is not None:
            self.channel.close()  # a receive still waiting ends with an error
        for g in self.generator_objs:
            await g.engine.close()
        for s in self.scorer_objs:  # their loops closed them too, unless a loop never started
            s.rewards.close()


def run_local(cfg: Config, *, config_text: str | None = None, resume: bool = False,
              launched_at: float | None = None) -> list[dict[str, Any]]:
    """Run `cfg` with every role in this process (no Ray); returns the metrics rows."""
    ensure_model(cfg.model)
    launched_at = time.time() if launched_at is None else launched_at
    return run_loop(Controller(cfg, LocalDeployment(cfg), config_text=config_text, resume=resume,
                               launched_at=launched_at).run())
