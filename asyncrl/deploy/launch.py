"""`asyncrl launch`: start (or join) a Ray cluster, place the role actors, run the Controller, clean up.

A local cluster listens on 127.0.0.1 only, starts no dashboard unless `cluster.dashboard = true`, and is
shut down at the end of the run (also on Ctrl-C). With `cluster.address` the run joins an existing
cluster and leaves it running. The Controller's own event loop is uvloop's. In-process runs (`--local`)
do not come here: `asyncrl.deploy.local.run_local` needs no Ray installed (GPU machines without it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable

import ray

from asyncrl.aio import discard, run_loop
from asyncrl.checkpoints.transfer import CheckpointRelay, relay_for
from asyncrl.config.schema import Config
from asyncrl.control.controller import Controller
from asyncrl.control.supervisor import RoleFailed
from asyncrl.control.watchdog import Heartbeat, Probe
from asyncrl.data.prompts import check_prompts
from asyncrl.deploy.actors import ActorCalls, RayProxy, RemoteRoleActor
from asyncrl.deploy.auto import (
    available_cpus,
    pin_cpus,
    pin_local_cluster,
    resolve_ray,
    scorers_in_buffer,
    trainer_spread,
)
from asyncrl.deploy.native_memory import arena_env
from asyncrl.deploy.placement import colocated_bundle, uses_gpus, weight_backend
from asyncrl.deploy.plan import ActorPlan, plan_resources
from asyncrl.telemetry.metrics import ACTOR_CALLS
from engines.base import traits
from engines.hf import ensure_model
from transports import group as weight_group

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 180.0


def start_ray(cfg: Config) -> bool:
    """Connect to `cluster.address` or start a local cluster; True if we started (and must stop) it."""
    if ray.is_initialized():
        return False
    if cfg.cluster.address:
        ray.init(address=cfg.cluster.address, log_to_driver=True)
        return False
    # the local cluster's processes (raylet, workers, the roles' actors) inherit this environment: glibc's arenas
    # capped from each process's start (asyncrl/deploy/native_memory.py)
    os.environ.update(arena_env())
    # cluster.affinity.controller: this process and the cluster's own (raylet, GCS, ...) are pinned once the actors
    # started (`pin_local_cluster`): Ray's start-up and the actors' use every core meanwhile
    ray.init(
        address="local",  # a cluster of its own, even where another runs on this machine (`ray start`)
        num_cpus=max(1, int(round(cfg.cluster.num_cpus))),
        num_gpus=None if uses_gpus(cfg) else 0,  # GPUs are for the roles that ask (asyncrl/deploy/placement.py)
        include_dashboard=cfg.cluster.dashboard,
        dashboard_host="127.0.0.1",
        object_store_memory=cfg.cluster.object_store_mb * 2**20,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )
    return True


def stop_ray() -> None:
    """Stop the cluster `start_ray` started (the caller knows whether it did)."""
    ray.shutdown()


def colocation_group(cfg: Config) -> Any:
    """placement = "colocated": a placement group of one bundle (one node, the GPU they share) that the trainer
    and every generator are scheduled into; None otherwise (or when they ask for no resources at all)."""
    bundle = colocated_bundle(cfg)
    if cfg.cluster.placement != "colocated" or not bundle:
        return None
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([bundle], strategy="STRICT_PACK")
    ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"cluster.placement = 'colocated': the cluster has no node with {bundle} free for the "
                           f"trainer and the generators together (waited {READY_TIMEOUT_S:.0f} s)")
    return group


def actor_options(plan: ActorPlan, bundle: Any = None, network_interface: str = "",
                  remote: bool = False) -> dict[str, Any]:
    """Ray options of one actor of `plan.role`: its CPUs, GPUs and custom resources (cluster.*_cpus,
    cluster.*_gpus, cluster.resources.<role>; Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigns), the
    network interface of its collectives (cluster.network_interface), on a cluster of its own (`remote`) glibc's
    arena cap (asyncrl/deploy/native_memory.py), and for the trainer and generators the colocation bundle."""
    options: dict[str, Any] = {"num_cpus": plan.cpus, "num_gpus": plan.gpus, "max_concurrency": 1000}
    if plan.resources:
        options["resources"] = dict(plan.resources)
    env = {"GLOO_SOCKET_IFNAME": network_interface, "NCCL_SOCKET_IFNAME": network_interface} \
        if network_interface else {}
    if remote:  # a cluster of its own (cluster.address): its workers did not inherit the driver's environment
        env.update(arena_env())
    if env:
        options["runtime_env"] = {"env_vars": env}
    if bundle is not None and plan.role in ("trainer", "generator"):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=bundle,
                                                                          placement_group_bundle_index=0)
    return options


class RayDeployment:
    """The roles as Ray actors; attributes are RayProxy objects the Controller awaits."""

    def __init__(self, cfg: Config, *, trainer_spread: list[int] | None = None) -> None:
        """`trainer_spread`: every CPU of the run where the automatic affinity pinned the trainer (its tuner may
        try its update on all of them; asyncrl.deploy.auto.trainer_spread)."""
        self.cfg = cfg
        self._plans = {p.role: p for p in plan_resources(cfg)}
        self._bundle = colocation_group(cfg)
        actor = self._actor
        self.buffer_actor = actor("buffer").remote("buffer", cfg)
        self.trainer_actor = actor("trainer").remote("trainer", cfg, 0, self.buffer_actor, 0, trainer_spread or [])
        # trainer.num_ranks > 1: ranks 1..W-1 train each step beside the trainer (rank 0), which drives them
        self.rank_actors = [actor("trainer").remote("trainer", cfg, r) for r in range(1, cfg.trainer.num_ranks)]
        self.generator_actors = [actor("generator").remote("generator", cfg, i, self.buffer_actor)
                                 for i in range(cfg.rollout.num_generators)]
        # scorer_placement = "buffer": the buffer actor built the scorers beside the buffer (RoleActor.hosted)
        in_buffer = scorers_in_buffer(cfg)
        self.scorer_actors = [] if in_buffer else [actor("scorer").remote("scorer", cfg, i, self.buffer_actor)
                                                for i in range(cfg.reward.num_scorers)]
        self._replaced: dict[str, str] = {}  # the actor id of every restarted incarnation -> its role
        self._incarnations: dict[str, int] = {}  # role -> how often it was restarted (its holder name at the buffer)
        self._store_address: tuple[str, int] | None = None  # the trainer's rendezvous store, opened once
        self._relay: CheckpointRelay | None = None  # set by relay_checkpoints when the trainer lacks RUN_DIR
        self.buffer = RayProxy(self.buffer_actor)
        self.trainer = RayProxy(self.trainer_actor)
        self.generators = [RayProxy(a) for a in self.generator_actors]
        self.scorers = ([RayProxy(self.buffer_actor, "scorer", i) for i in range(cfg.reward.num_scorers)] if in_buffer
                        else [RayProxy(a) for a in self.scorer_actors])

    def _actor(self, role: str) -> Any:
        """The actor class of `role` with its resources, in the colocation bundle when the role shares it (a
        restarted generator goes back into it)."""
        return RemoteRoleActor.options(**actor_options(self._plans[role], self._bundle,
                                                       self.cfg.cluster.network_interface,
                                                       remote=bool(self.cfg.cluster.address)))

    @property
    def actors(self) -> list[Any]:
        return [self.buffer_actor, self.trainer_actor, *self.rank_actors, *self.generator_actors, *self.scorer_actors]

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        named = self._named()
        refs = {a.ready.remote(): role for role, a in named.items()}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if pending:
            raise RuntimeError(f"{', '.join(refs[r] for r in pending)}: not placed or not started within "
                               f"{timeout_s:.0f}s — check cluster.*_cpus, cluster.*_gpus and cluster.resources "
                               f"against the cluster's free resources (`ray status`)")
        ray.get(ready)  # surfaces a constructor error (e.g. a model folder that does not load)
        if self.rank_actors:
            self._form_trainer_group(timeout_s)

    def _form_trainer_group(self, timeout_s: float) -> None:
        """trainer.num_ranks > 1: every rank joins the trainer group (rank 0 holds its store) and builds its
        role on it; then rank 0 takes the other ranks (asyncrl/roles/trainer_ranks.py)."""
        world = 1 + len(self.rank_actors)
        host, port = ray.get(self.trainer_actor.open_trainer_store.remote(world), timeout=timeout_s)
        ranks = [self.trainer_actor, *self.rank_actors]
        ray.get([a.join_trainer_group.remote(host, port, r, world) for r, a in enumerate(ranks)], timeout=timeout_s)
        ray.get(self.trainer_actor.attach_trainer_ranks.remote(self.rank_actors), timeout=timeout_s)

    def _named(self) -> dict[str, Any]:
        """Every actor by its role's name ("buffer", "trainer", "trainer rank 1", "generator 0", ...)."""
        return {"buffer": self.buffer_actor, "trainer": self.trainer_actor,
                **{f"trainer rank {r}": a for r, a in enumerate(self.rank_actors, start=1)},
                **{f"generator {i}": a for i, a in enumerate(self.generator_actors)},
                **{f"scorer {i}": a for i, a in enumerate(self.scorer_actors)}}

    async def setup_weight_sync(self, group_name: str = "weights") -> None:
        """Form the weight-sync group (trainer rank 0, generators 1..N). Re-formed after a generator died
        (`group_name` fresh, on the store the trainer opened first): every member leaves its old group first."""
        self._store_address = await weight_group.form(
            ActorCalls(self.trainer_actor), [ActorCalls(a) for a in self.generator_actors],
            backend=weight_backend(self.cfg), group_name=group_name, store_address=self._store_address)

    def where(self) -> dict[str, dict[str, Any]]:
        """Where each actor runs, by role name ("trainer", "generator 0", ...): its node, process and device
        (RoleActor.placement); `run_with_ray` writes it to RUN_DIR/placement.json."""
        named = self._named()
        return dict(zip(named, ray.get([a.placement.remote() for a in named.values()], timeout=READY_TIMEOUT_S)))

    def process_of(self, role: str) -> str:
        """The probe name (`probes`) of the process that runs `role` ("generator/0", "scorer/1")."""
        kind, _, index = role.partition("/")
        if kind == "scorer" and scorers_in_buffer(self.cfg):
            return "buffer (and the scorers it hosts)"
        return f"{kind} {index}"

    def probes(self) -> dict[str, Probe]:
        """One heartbeat probe per actor (asyncrl/control/watchdog.py); scorers hosted by the buffer share its loop.
        A probe asks the role's current actor, so it follows a restart (`restart`)."""
        buffer = self.process_of("scorer/0") if scorers_in_buffer(self.cfg) else "buffer"
        named: dict[str, Callable[[], Any]] = {
            buffer: lambda: self.buffer_actor, "trainer": lambda: self.trainer_actor,
            **{f"trainer rank {r}": (lambda a=a: a) for r, a in enumerate(self.rank_actors, start=1)},
            **{f"generator {i}": (lambda i=i: self.generator_actors[i]) for i in range(len(self.generator_actors))},
            **{f"scorer {i}": (lambda i=i: self.scorer_actors[i]) for i in range(len(self.scorer_actors))}}

        def probe(actor: Callable[[], Any]) -> Probe:
            async def heartbeat() -> Heartbeat:
                ACTOR_CALLS.n += 1
                return await actor().heartbeat.remote()

            return heartbeat

        return {name: probe(actor) for name, actor in named.items()}

    # -- supervision (docs/checkpoints.md, Supervision) --------------------------------------------
    @property
    def restartable(self) -> tuple[str, ...]:
        """The roles `restart` can bring back: scorers in their own actors; generators where the weight
        transport can re-form its group ("bucketed", received by the generator actor itself)."""
        if self.cfg.cluster.max_restarts == 0:
            return ()
        kinds = ["scorer"] if self.scorer_actors else []  # scorers inside the buffer's actor die with it
        if traits(self.cfg.rollout.engine).in_process:  # vLLM / SGLang workers hold their own group membership
            kinds.append("generator")
        return tuple(kinds)

    def dead_role(self, exc: BaseException) -> str | None:
        """The role ("trainer", "trainer/1" (rank 1), "buffer", "generator/0", ...) of the actor whose death `exc`
        reports."""
        actor_id = getattr(exc, "actor_id", None)
        roles = {"buffer": self.buffer_actor, "trainer": self.trainer_actor,
                 **{f"trainer/{r}": a for r, a in enumerate(self.rank_actors, start=1)},
                 **{f"generator/{i}": a for i, a in enumerate(self.generator_actors)},
                 **{f"scorer/{i}": a for i, a in enumerate(self.scorer_actors)}}
        current = next((role for role, a in roles.items() if a._actor_id.hex() == actor_id), None)
        return current or self._replaced.get(actor_id or "")  # a call still made to the dead incarnation

    def holder_of(self, role: str) -> str:
        """The name under which the current actor of `role` ("generator/0") holds groups at the buffer."""
        return f"{role}#{self._incarnations.get(role, 0)}"

    async def generator_death(self, timeout_s: float = 10.0) -> BaseException | None:
        """The error of a generator actor that is dead now (its `pid` call fails with Ray's actor death), else
        None: a failed weight sync that named no death may still have been one."""
        calls = [a.pid.remote() for a in self.generator_actors]
        results = await asyncio.gather(*[asyncio.wait_for(c, timeout_s) for c in calls], return_exceptions=True)
        return next((r for r in results if isinstance(r, BaseException) and self.dead_role(r) is not None), None)

    async def leave_weight_groups(self) -> None:
        """A generator died: every live member ends its group (sends and armed receives on it raise)."""
        await weight_group.leave_all([ActorCalls(a) for a in [self.trainer_actor, *self.generator_actors]])

    async def restart(self, kind: str, index: int) -> None:
        """Replace the dead actor of generator or scorer `index` with a fresh one; its proxy now calls the
        new actor. A generator then needs the re-formed weight group (`setup_weight_sync`)."""
        actors = self.generator_actors if kind == "generator" else self.scorer_actors
        try:
            ray.kill(actors[index], no_restart=True)
        except Exception as exc:  # already gone
            log.debug("kill failed: %s", exc)
        role = f"{kind}/{index}"
        self._incarnations[role] = self._incarnations.get(role, 0) + 1
        self._replaced[actors[index]._actor_id.hex()] = role
        new = self._actor(kind).remote(kind, self.cfg, index, self.buffer_actor, self._incarnations[role])
        actors[index] = new  # before it is ready: its death while starting names the role (dead_role)
        await asyncio.wait_for(new.ready.remote(), READY_TIMEOUT_S)
        (self.generators if kind == "generator" else self.scorers)[index].rebind(new)

    def relay_checkpoints(self, *, fresh: bool) -> None:
        """When a trainer rank does not see RUN_DIR, checkpoints and the final export travel through Ray from now
        on: `trainer` becomes a CheckpointRelay (asyncrl/checkpoints/transfer.py). `fresh`: a new run (no --resume)."""
        run = self.cfg.run
        self._relay = asyncio.run(relay_for(self.trainer, [self.trainer_actor, *self.rank_actors],
                                            run_dir=run.output_dir, trainer_dir=run.trainer_dir,
                                            keep_last=run.keep_last, fresh=fresh))
        if self._relay is not None:
            self.trainer = self._relay

    async def save_checkpoint(self, path: str) -> None:
        if self._relay is not None:
            await self._relay.save_export(path)
        else:
            await self.trainer_actor.save_checkpoint.remote(path)

    async def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception as exc:  # already dead
                log.debug("kill failed: %s", exc)
        if self._bundle is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._bundle)
            self._bundle = None


def run_with_ray(cfg: Config, *, config_text: str | None = None, resume: bool = False,
                 beside: Callable[[Controller, RayDeployment], Awaitable[None]] | None = None,
                 launched_at: float | None = None) -> list[dict[str, Any]]:
    """Run `cfg` on Ray; returns the metrics rows. Stops the cluster if this call started it.

    A dead trainer or buffer ends the Controller's run with RoleFailed; when a valid checkpoint exists the
    roles are started afresh and the run resumes from it, up to `run.max_resumes` times. `beside(controller,
    deployment)`, when given, runs on the Controller's loop beside each attempt's run and is cancelled when
    the run ends (a monitor; benchmarks/faults.py injects its kills with it). `launched_at`: the time the run's
    start-up counts from (summary.json "startup_s"; `asyncrl launch` passes its own start; default: now)."""
    launched_at = time.time() if launched_at is None else launched_at
    ensure_model(cfg.model)
    # scorer placement and, for a local cluster it starts on a small machine, affinity (asyncrl/deploy/auto.py)
    resolved = resolve_ray(cfg, starts_cluster=not ray.is_initialized())
    spread, cfg = trainer_spread(cfg, resolved), resolved
    before = available_cpus()  # the driver's CPUs: start_ray may pin it (cluster.affinity.controller)
    # the run's prompts are checked beside Ray's start (its own processes leave the driver's core mostly idle)
    # and the actors' (an over-long or unrenderable prompt: one line, not an actor's death)
    prompts = ThreadPoolExecutor(1, thread_name_prefix="check-prompts")
    problems = prompts.submit(check_prompts, cfg)
    prompts.shutdown(wait=False)
    started = start_ray(cfg)
    try:
        resumes = 0
        while True:
            deployment = RayDeployment(cfg, trainer_spread=spread)
            try:
                found = [] if resumes else problems.result()
                if found:
                    raise ValueError("\n".join(found))
                deployment.wait_ready()
                where = deployment.where()
                if started and not resumes:  # each actor pins itself (RoleActor); Ray's own processes: here
                    pin_local_cluster(cfg.cluster.affinity.controller, skip={w["pid"] for w in where.values()})
                write_placement(cfg, where)
                deployment.relay_checkpoints(fresh=not resume)
            except BaseException:
                asyncio.run(deployment.shutdown())
                raise
            controller = Controller(cfg, deployment, config_text=config_text, resume=resume, launched_at=launched_at)
            try:
                return run_loop(_run_beside(controller, deployment, beside))
            except RoleFailed as exc:
                if exc.checkpoint is None or resumes >= cfg.run.max_resumes:
                    raise
                resumes += 1
                log.warning("%s — resuming from %s (resume %d of at most %d, run.max_resumes)", exc,
                            exc.checkpoint.name, resumes, cfg.run.max_resumes)
                resume = True
    finally:
        if started:
            ray.shutdown()
            if cfg.cluster.affinity.controller:  # the process outlives the run (tests, benchmarks): unpin it
                pin_cpus(before, "controller")


def write_placement(cfg: Config, where: dict[str, dict[str, Any]]) -> None:
    """RUN_DIR/placement.json: the node, process and device of every role; one log line each."""
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "placement.json").write_text(json.dumps(where, indent=1) + "\n")
    for role, w in where.items():
        gpus = f", GPU {','.join(w['gpu_ids'])}" if w["gpu_ids"] else ""
        log.info("%s: node %s (%s), pid %d, %s%s", role, w["node_id"][:12], w["node_ip"], w["pid"], w["device"], gpus)


async def _run_beside(controller: Controller, deployment: RayDeployment,
                      beside: Callable[[Controller, RayDeployment], Awaitable[None]] | None) -> list[dict[str, Any]]:
    side = None if beside is None else asyncio.ensure_future(beside(controller, deployment))
    try:
        return await controller.run()
    finally:
        if side is not None:
            discard(side)
