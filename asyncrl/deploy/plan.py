"""The actors a run starts and the logical CPUs and GPUs each asks Ray for (`plan_resources`), the numbers
`asyncrl launch --dry-run` prints (`derived`), and the check that the plan fits a local cluster's CPUs."""

from __future__ import annotations

import math

import msgspec

from asyncrl.config.schema import Config
from asyncrl.deploy.auto import scorers_in_buffer
from asyncrl.deploy.placement import role_device, role_gpus, weight_backend


class ActorPlan(msgspec.Struct, frozen=True, kw_only=True):
    """How many actors of one role to start, the logical CPUs and GPUs each asks Ray for, and its device."""

    role: str
    count: int
    cpus: float  # per actor
    gpus: float = 0.0  # per actor (asyncrl/deploy/placement.py)
    device: str = "cpu"
    resources: dict[str, float] = {}  # custom Ray resources per actor (cluster.resources.<role>)

    @property
    def total_cpus(self) -> float:
        return self.count * self.cpus


def plan_resources(cfg: Config) -> list[ActorPlan]:
    """The actors a run starts, with the logical CPUs each asks for (cluster.*_cpus)."""
    c = cfg.cluster

    def plan(role: str, count: int, cpus: float) -> ActorPlan:
        return ActorPlan(role=role, count=count, cpus=cpus, gpus=role_gpus(cfg, role), device=role_device(cfg, role),
                         resources=dict(getattr(c.resources, role)))

    return [
        plan("generator", cfg.rollout.num_generators, c.generator_cpus),
        # scorers in the buffer actor's process (scorer_placement, asyncrl/deploy/auto.py) ask for nothing
        plan("scorer", 0 if scorers_in_buffer(cfg) else cfg.reward.num_scorers, c.scorer_cpus),
        plan("trainer", cfg.trainer.num_ranks, c.trainer_cpus),  # rank 0 and the other trainer ranks
        plan("buffer", 1, c.buffer_cpus),
    ]


def derived(cfg: Config) -> dict[str, object]:
    """Numbers that follow from the config, for `asyncrl launch --dry-run`."""
    sps = cfg.samples_per_step
    mini = sps // cfg.trainer.mini_batches
    in_flight = (cfg.staleness.max_staleness + 1) * cfg.trainer.prompts_per_step
    plans = plan_resources(cfg)
    return {
        "samples_per_step": sps,
        "optimizer_steps_per_train_step": cfg.trainer.epochs * cfg.trainer.mini_batches,
        "samples_per_mini_batch": mini,
        # by the token budget: as many as the step's lengths need (asyncrl/training/micro.py)
        "micro_batches_per_mini_batch": (math.ceil(mini / cfg.trainer.micro_batch_size)
                                         if not cfg.trainer.max_tokens_per_micro_batch else "by token budget"),
        "max_groups_in_flight": in_flight,
        "max_samples_in_flight": in_flight * cfg.rollout.group_size,
        "rollout_queue_capacity_samples": cfg.buffer.rollout_capacity,
        "train_store_capacity_groups": cfg.buffer.train_capacity,
        "actors": [{"role": p.role, "count": p.count, "cpus_each": p.cpus, "gpus_each": p.gpus, "device": p.device}
                   for p in plans],
        "cpus_requested": sum(p.total_cpus for p in plans),
        "cpus_available": cfg.cluster.num_cpus if not cfg.cluster.address else None,
        "gpus_requested": sum(p.count * p.gpus for p in plans),
        "placement": cfg.cluster.placement,
        "weight_sync_backend": weight_backend(cfg),
    }


def check_cpus(cfg: Config) -> list[str]:
    """`load_config`'s check (asyncrl/config/checks.py) that the plan's CPUs fit a local cluster."""
    if cfg.cluster.address:
        return []  # an existing cluster: Ray knows its size, we do not
    plans = plan_resources(cfg)
    need = sum(p.total_cpus for p in plans)
    if need <= cfg.cluster.num_cpus + 1e-9:
        return []
    parts = ", ".join(f"{p.count} {p.role}{'s' if p.count != 1 else ''} x {p.cpus:g}" for p in plans if p.count)
    return [f"cluster.num_cpus: the plan needs {need:g} CPUs ({parts}) but the local cluster has "
            f"{cfg.cluster.num_cpus:g} — lower cluster.generator_cpus (or another cluster.*_cpus) "
            f"or raise cluster.num_cpus"]
