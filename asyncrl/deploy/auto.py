"""Placement and threads chosen from the run's shape and the machine: the `"auto"` defaults of `[cluster]`.

Three decisions, each overridden by an explicit setting:

- `cluster.scorer_placement = "auto"` (Ray): the scorers run inside the replay buffer's actor when the reward is
  light — rule or Python functions, no reward model, no GPU or custom resources or CPUs pinned for the scorer, one
  scorer (or `reward.isolation = "process"`, whose worker processes score in parallel anyway). A scorer actor of
  its own costs a process, its event loop and two actor calls per batch: on a 2-core machine about 50 ms of CPU a
  step against 7 ms of scoring (benchmarks/README.md, overlap). A reward model or several thread-isolated scorers
  keep actors of their own (processes that score in parallel).
- `cluster.torch_threads = "auto"`: torch intra-op threads per role from the cores it may use and when it works.
  With `max_staleness = 0` the phases alternate (the generators wait for the new weights, the trainer for the
  groups), so the trainer and the generators each get all the cores (split over trainer ranks, or over the
  generators, which decode at the same time). With `max_staleness >= 1` they run at once and the cores (less one
  for the light roles from 4 cores on) are split between them by their busy shares (`split_cores`; equal by
  default); the buffer and the scorers get one. Where that leaves a role more than one count to choose from
  (1 or all its cores), it measures both on its own work and keeps the faster (asyncrl/deploy/thread_tuner.py).
- `cluster.auto_affinity` (Ray, local cluster): when the roles overlap (`max_staleness >= 1`) and the threads they
  want — the trainer's, the generators', one for the light roles (buffer, scorers, the Controller and Ray's own
  processes) — exceed the cores, the trainer gets cores of its own and everything else the rest. Floating, the
  light roles and Ray's threads preempted the trainer 4-10% of its update time on 2 cores. Nothing is pinned
  when `[cluster.affinity]` names any CPU, on a cluster at `cluster.address`, or when a role uses a GPU.

- `cluster.generator_nice = "auto"` (with the automatic affinity only): the generators, pinned to the cores the
  buffer, the scorers and the Controller also run on, run at niceness `AUTO_GENERATOR_NICE`. Their work is
  throughput; the others' is short replies on every step's path (a weight swap noted, an admit, a put, a score),
  which at the default priority waited behind a generator's time slice: 10-17% of a first_digit step on 2 cores.

`resolve_ray(cfg)` (the driver, before the local cluster starts; a cluster it joins is not pinned) writes the
placement and affinity decisions into the config the actors get; each actor then pins itself and calls
`decide_threads` (and `thread_candidates` for its tuner) with the CPUs it may run on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec

from asyncrl.config.schema import Config

AFFINITY_ROLES = ("trainer", "generator", "scorer", "buffer", "controller")
AUTO_GENERATOR_NICE = 10  # cluster.generator_nice = "auto" where the automatic affinity pins the generators


def available_cpus() -> list[int]:
    """The CPU ids this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def scorers_in_buffer(cfg: Config) -> bool:
    """Whether the scorers run inside the buffer actor's process (Ray deployment; module docstring)."""
    placement = cfg.cluster.scorer_placement
    if placement != "auto":
        return placement == "buffer"
    c, r = cfg.cluster, cfg.reward
    light = not r.model and c.scorer_gpus == 0 and not c.resources.scorer and not c.affinity.scorer
    return light and (r.num_scorers == 1 or r.isolation == "process")


def split_cores(cores: int, trainer_busy: float = 1.0, generator_busy: float = 1.0) -> tuple[int, int]:
    """Cores for (the trainer, the generators) when they run at once: in proportion to their busy shares, each at
    least one (a single core: both get it). The shares are the fraction of a step each side computes
    (asyncrl.planning.model's `trainer_busy` and `generator_busy`); equal by default."""
    if cores <= 1:
        return 1, 1
    total = trainer_busy + generator_busy
    share = 0.5 if total <= 0 else trainer_busy / total
    trainer = min(cores - 1, max(1, round(cores * share)))
    return trainer, cores - trainer


def decide_threads(cfg: Config, cores: int, role: str, *, trainer_busy: float = 1.0,
                   generator_busy: float = 1.0) -> int:
    """torch intra-op threads of `role` ("trainer", "generator", "scorer", "buffer") whose process may run on
    `cores` CPUs: `cluster.torch_threads` when it is a number, else the rule of the module docstring."""
    fixed = cfg.cluster.torch_threads
    if fixed != "auto":
        return int(fixed)
    if role not in ("trainer", "generator"):
        return 1
    ranks, gens = cfg.trainer.num_ranks, cfg.rollout.num_generators
    mine, count = (0, ranks) if role == "trainer" else (1, gens)
    aff = cfg.cluster.affinity
    own, other = (aff.trainer, aff.generator) if role == "trainer" else (aff.generator, aff.trainer)
    alone = bool(own) and bool(other) and not set(own) & set(other)  # pinned to cores of its own
    if cfg.staleness.max_staleness == 0 or alone:  # the phases alternate, or no other side on these cores
        return max(1, cores // count)
    computing = cores - 1 if cores >= 4 else cores  # from 4 cores on, one is left to the light roles
    return max(1, split_cores(computing, trainer_busy, generator_busy)[mine] // count)


def thread_candidates(cfg: Config, cores: int, role: str) -> list[int]:
    """The thread counts a role's ThreadTuner measures (asyncrl/deploy/thread_tuner.py): 1 and `decide_threads` when
    that is more and `cluster.torch_threads = "auto"`, else only `decide_threads`."""
    n = decide_threads(cfg, cores, role)
    return [1, n] if cfg.cluster.torch_threads == "auto" and n > 1 else [n]


def overlap_threads(cfg: Config, cores: int) -> int:
    """Threads of a generator while generation and training run at once on `cores` CPUs (the planner's threads
    per computing role)."""
    if cfg.cluster.torch_threads != "auto":
        return int(cfg.cluster.torch_threads)
    return decide_threads(cfg if cfg.staleness.max_staleness else _overlapping(cfg), cores, "generator")


def _overlapping(cfg: Config) -> Config:
    return msgspec.structs.replace(cfg, staleness=msgspec.structs.replace(cfg.staleness, max_staleness=1))


def local_threads(cfg: Config, cores: int) -> int:
    """Threads of the in-process deployment (one process, one torch setting for every role): all cores when the
    phases alternate, else the larger side of the split (generation and training share the process)."""
    if cfg.cluster.torch_threads != "auto":
        return int(cfg.cluster.torch_threads)
    if cfg.staleness.max_staleness == 0:
        return max(1, cores)
    return max(1, min(split_cores(cores)))


def auto_affinity(cfg: Config, cpus: list[int]) -> dict[str, list[int]]:
    """The CPUs of each role when `cluster.auto_affinity` pins them (module docstring); {} when it does not."""
    c = cfg.cluster
    from asyncrl.deploy.placement import uses_gpus

    if (not c.auto_affinity or c.address or cfg.staleness.max_staleness == 0 or len(cpus) < 2 or uses_gpus(cfg)
            or any(getattr(c.affinity, role) for role in AFFINITY_ROLES)):
        return {}
    n = len(cpus)
    ranks, gens = cfg.trainer.num_ranks, cfg.rollout.num_generators
    want_t = ranks * decide_threads(cfg, n, "trainer")
    want_g = gens * decide_threads(cfg, n, "generator")
    if want_t + want_g + 1 <= n:  # room for every role and the light ones: the scheduler keeps them apart
        return {}
    own = min(n - 1, max(1, want_t if c.torch_threads != "auto" else split_cores(n)[0]))
    trainer, rest = cpus[n - own:], cpus[:n - own]
    return {"trainer": trainer, "generator": rest, "scorer": rest, "buffer": rest, "controller": rest}


def resolve_ray(cfg: Config, cpus: list[int] | None = None, *, starts_cluster: bool = True) -> Config:
    """The config a Ray run's actors get: scorer placement decided ("actor" or "buffer") and, when the run starts
    its own local cluster (`starts_cluster`: not one this process joined) and it applies, the automatic affinity
    written into `[cluster.affinity]`."""
    c = cfg.cluster
    placement = "buffer" if scorers_in_buffer(cfg) else "actor"
    pins = auto_affinity(cfg, available_cpus() if cpus is None else cpus) if starts_cluster else {}
    affinity = msgspec.structs.replace(c.affinity, **pins) if pins else c.affinity
    nice = c.generator_nice if c.generator_nice != "auto" else AUTO_GENERATOR_NICE if pins else 0
    return msgspec.structs.replace(cfg, cluster=msgspec.structs.replace(c, scorer_placement=placement,
                                                                        affinity=affinity, generator_nice=nice))


def machine_defaults(cfg: Config, cpus: list[int] | None = None) -> list[tuple[str, object]]:
    """The `"auto"` values of `[cluster]` as `asyncrl launch` resolves them on this machine (`cpus`: the CPU ids
    this process may run on), one (key, value) each, for `asyncrl config show`: what `resolve_ray` writes into
    the config a Ray run's actors get when the run starts its local cluster, the torch threads each role's process
    then sets from the CPUs it may use (a tuner measures 1 against that count where `thread_candidates` gives
    both), and the in-process deployment's threads (`--local`)."""
    cpus = available_cpus() if cpus is None else cpus
    c, resolved = cfg.cluster, resolve_ray(cfg, cpus)
    r = resolved.cluster
    rows: list[tuple[str, object]] = []
    if c.scorer_placement == "auto":
        rows.append(("cluster.scorer_placement", r.scorer_placement))
    rows += [(f"cluster.affinity.{role}", getattr(r.affinity, role)) for role in AFFINITY_ROLES
             if getattr(r.affinity, role) != getattr(c.affinity, role)]
    if c.generator_nice == "auto":
        rows.append(("cluster.generator_nice", r.generator_nice))
    if c.torch_threads == "auto":
        for role in ("trainer", "generator", "scorer", "buffer"):
            cores = len(getattr(r.affinity, role) or cpus)
            rows.append((f"torch_threads.{role}", thread_candidates(resolved, cores, role)))
        rows.append(("torch_threads.local", local_threads(cfg, len(cpus))))
    return rows


def trainer_spread(cfg: Config, resolved: Config) -> list[int]:
    """Every CPU of the run when `resolve_ray` pinned the trainer (one rank) automatically: where its tuner may also try
    the update (asyncrl/deploy/thread_tuner.py, `trainer_layouts`); [] when nothing was pinned or the user pinned."""
    before, after = cfg.cluster.affinity, resolved.cluster.affinity
    if before == after or not after.trainer or cfg.trainer.num_ranks > 1:
        return []
    return sorted(set(after.trainer) | set(after.generator))


def lower_priority(cfg: Config, kind: str) -> int:
    """Lower this process's priority as `cluster.generator_nice` says for a generator (an unresolved "auto": no
    change); returns the niceness added."""
    nice = cfg.cluster.generator_nice
    if kind != "generator" or nice == "auto" or nice <= 0 or not hasattr(os, "nice"):
        return 0
    os.nice(nice)
    return nice


def run_cpus(affinity: Any) -> list[int]:
    """Every CPU `cluster.affinity` pins some role to: where a pinned actor may start up before it keeps to its own."""
    return sorted({c for kind in AFFINITY_ROLES for c in getattr(affinity, kind)})


def pin_cpus(cpus: list[int], who: str) -> None:
    """Pin every thread of this process to `cpus` (`cluster.affinity.<who>`); threads started later inherit
    it from their creator. Nothing happens for an empty list."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError(f"cluster.affinity.{who}: CPU pinning needs Linux (os.sched_setaffinity)")
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, set(cpus))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            raise RuntimeError(f"cluster.affinity.{who} = {cpus}: {exc.strerror or exc}") from None


def set_torch_threads(n: int, *, light: bool = False) -> None:
    """One actor, `n` intra-op threads, one inter-op thread: two roles really share two cores. `light`: a process
    that may never need torch (the buffer's, its scorers' reward a plain function) is not made to import it: `n`
    goes into OMP_NUM_THREADS, which torch reads for its intra-op threads if something there imports it later."""
    if light and "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(n)
        return
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (inter-op pool started); harmless
        pass


def pin_local_cluster(cpus: list[int], skip: set[int]) -> None:
    """Pin this process and the local Ray cluster it started (its descendants: GCS, raylet, agents, idle workers;
    each thread), except the processes in `skip` (the actors, which pin themselves), to `cpus`
    (`cluster.affinity.controller`). Workers Ray forks later inherit the raylet's CPUs. Nothing for an empty list."""
    if not cpus:
        return
    import psutil  # Ray's own dependency

    pin_cpus(cpus, "controller")
    for process in psutil.Process().children(recursive=True):
        if process.pid in skip:
            continue
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{process.pid}/task")]
        except OSError:  # it ended meanwhile
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(tid, set(cpus))
            except (ProcessLookupError, PermissionError):
                continue
