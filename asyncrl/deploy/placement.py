"""Where each role runs: its device, what its actor asks Ray for, and how weights reach the generators.

Place in the dataflow: read once per role when it is built (asyncrl/deploy/build.py: the trainer, its critic and
reference, each generator's engine, each scorer's reward model and reference go to `role_device`), by the Ray
deployment when it places the actors (asyncrl/deploy/launch.py: `actor_resources`, and the colocation bundle), and when
the weight-sync group is formed (`weight_backend`). Nothing here imports Ray or touches CUDA.

| config                                  | devices                          | weights (`weight_sync.backend = auto`) |
|-------------------------------------------|----------------------------------|----------------------------------------|
| every `cluster.*_gpus` = 0              | CPU                              | gloo broadcast                         |
| trainer_gpus, generator_gpus > 0,       | a GPU each (whole GPUs: Ray      | NCCL broadcast                         |
| placement = "disaggregated"             | gives each actor its own)        |                                        |
| the same, placement = "colocated"       | one GPU shared (fractions, one   | CUDA IPC (`ipc`); in one process       |
|                                         | Ray bundle)                      | (`--local`) the trainer's own tensors  |
| trainer on a GPU, generators on the CPU | as asked                         | gloo (the sender packs from the GPU)   |

A role with GPUs asked for runs on "cuda": under Ray that is the GPU Ray assigned to its actor (Ray sets
CUDA_VISIBLE_DEVICES), in process (`--local`) the first GPU. A role with none never initialises CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.config.checks import unknown
from asyncrl.config.schema import Config
from engines.base import available_engines, ipc_engines, sleeping_engines, traits

GPU_FIELDS = {"trainer": "trainer_gpus", "generator": "generator_gpus", "scorer": "scorer_gpus"}


def role_gpus(cfg: Config, role: str) -> float:
    """The GPUs one actor of `role` ("trainer", "generator", "scorer", "buffer") asks for."""
    field = GPU_FIELDS.get(role)
    return float(getattr(cfg.cluster, field)) if field else 0.0


def role_device(cfg: Config, role: str) -> str:
    """"cuda" for a role with GPUs asked for, else "cpu"."""
    return "cuda" if role_gpus(cfg, role) > 0 else "cpu"


def require_device(cfg: Config, role: str) -> str:
    """The role's device, checked in the process that hosts it: one line when a GPU was asked for and this
    process sees none (Ray gave the actor no GPU, or torch has no CUDA build)."""
    device = role_device(cfg, role)
    if device == "cuda":
        import os

        import torch

        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise RuntimeError(f"cluster.{GPU_FIELDS[role]} = {role_gpus(cfg, role):g}: the {role} should run on a GPU "
                               f"but its process sees no CUDA device (torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                               f"{visible!r}) — set it to 0 to run on the CPU, or run where torch sees a GPU")
    return device


def uses_gpus(cfg: Config) -> bool:
    return any(role_gpus(cfg, role) > 0 for role in GPU_FIELDS)


def weight_backend(cfg: Config) -> str:
    """How the trainer's weights reach the generators' engines across processes: the configured backend, or
    for "auto" the one the roles' devices call for (the module docstring's table)."""
    backend = cfg.weight_sync.backend
    if backend != "auto":
        return backend
    on_gpus = role_device(cfg, "trainer") == "cuda" and role_device(cfg, "generator") == "cuda"
    if not on_gpus:
        return "gloo"
    if cfg.cluster.placement == "colocated" and traits(cfg.rollout.engine).ipc:
        return "ipc"
    return "nccl"


def colocated_bundle(cfg: Config) -> dict[str, float]:
    """The resources of the one bundle the trainer and every generator share with placement = "colocated"
    (a Ray placement group packs it on one node; its GPUs are the sum of theirs, at most one)."""
    n = cfg.rollout.num_generators
    c = cfg.cluster
    bundle = {"CPU": c.trainer_cpus + n * c.generator_cpus, "GPU": c.trainer_gpus + n * c.generator_gpus}
    return {k: v for k, v in bundle.items() if v > 0}


def check_placement(cfg: Config, *, cuda: bool, gpus_here: int) -> list[str]:
    """Impossible placements, one line each naming the fix. `cuda`: torch sees CUDA in this process;
    `gpus_here`: how many (both only matter for a local cluster: with `cluster.address` Ray knows its GPUs)."""
    c, errors = cfg.cluster, []
    local = not c.address
    wanted = {role: role_gpus(cfg, role) for role in GPU_FIELDS}
    if local and not cuda:
        for role, gpus in wanted.items():
            if gpus > 0:
                errors.append(f"cluster.{GPU_FIELDS[role]}: {gpus:g} GPU asked for, but torch sees no CUDA device "
                              f"here — set it to 0 to run the {role} on the CPU, or join a cluster with GPUs "
                              f"(cluster.address)")
    for role, gpus in wanted.items():
        if gpus > 1 and gpus != int(gpus):
            errors.append(f"cluster.{GPU_FIELDS[role]}: {gpus:g} — more than one GPU must be a whole number")
    if wanted["scorer"] > 0 and c.scorer_placement == "buffer":
        errors.append("cluster.scorer_gpus: the scorers run inside the buffer actor (cluster.scorer_placement = "
                      "'buffer'), which asks for no GPU — set cluster.scorer_placement = 'actor'")
    backend = weight_backend(cfg)
    gen_gpu = wanted["generator"] > 0
    if c.placement == "colocated":
        shared = wanted["trainer"] + cfg.rollout.num_generators * wanted["generator"]
        if (wanted["trainer"] > 0) != gen_gpu:
            errors.append("cluster.placement = 'colocated' shares one device between the trainer and the generators: "
                          "set cluster.trainer_gpus and cluster.generator_gpus both > 0 (e.g. 0.5 each) or both 0")
        elif shared > 1 + 1e-9:
            errors.append(f"cluster.placement = 'colocated' puts the trainer and every generator on one GPU, but "
                          f"trainer_gpus + num_generators x generator_gpus = {shared:g} > 1 — use fractions, e.g. "
                          f"trainer_gpus = 0.5 and generator_gpus = {0.5 / cfg.rollout.num_generators:g}")
        # (an engine that cannot sleep: asyncrl/config/loader.py _check_colocated)
        if backend == "nccl":
            errors.append("weight_sync.backend = 'nccl' with cluster.placement = 'colocated': NCCL refuses two ranks "
                          "on one GPU — use 'ipc' or 'auto'")
    else:
        if backend == "ipc" and (wanted["trainer"] > 0 or gen_gpu or not local):
            errors.append("weight_sync.backend = 'ipc' needs the trainer and the generators on one device (one GPU, "
                          "or the CPUs of one machine): set cluster.placement = 'colocated', or use 'auto'")
        if backend == "nccl" and not (wanted["trainer"] > 0 and gen_gpu):
            errors.append("weight_sync.backend = 'nccl' broadcasts between GPUs: set cluster.trainer_gpus and "
                          "cluster.generator_gpus > 0, or use 'gloo' / 'auto'")
        elif backend == "nccl" and (wanted["trainer"] < 1 or wanted["generator"] < 1):
            errors.append("weight_sync.backend = 'nccl' with a fraction of a GPU per role: two NCCL ranks on one GPU "
                          "fail ('Duplicate GPU detected') — give the trainer and each generator whole GPUs, or set "
                          "cluster.placement = 'colocated'")
        if local and cuda and backend == "nccl":
            needed = (cfg.trainer.num_ranks * int(wanted["trainer"])
                      + cfg.rollout.num_generators * int(wanted["generator"]))
            if needed > gpus_here:
                ranks = "trainer.num_ranks x " if cfg.trainer.num_ranks > 1 else ""
                errors.append(f"cluster.placement = 'disaggregated' needs {needed} GPUs ({ranks}trainer_gpus + "
                              f"num_generators x generator_gpus) and this machine has {gpus_here} — use fewer, or "
                              f"cluster.placement = 'colocated'")
    return errors


# -- the checks `load_config` runs (asyncrl/config/checks.py) -------------------------------------------------


def cuda_available() -> bool:
    """Whether torch sees a GPU (imports torch lazily; no torch means no CUDA)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_count() -> int:
    """How many GPUs torch sees here."""
    import torch

    return int(torch.cuda.device_count())


def check_engine(cfg: Config) -> list[str]:
    return unknown("rollout.engine", "engine", cfg.rollout.engine, available_engines())


def check_backend(cfg: Config) -> list[str]:
    backend, engine = cfg.weight_sync.backend, cfg.rollout.engine
    if backend == "nccl" and not cuda_available():
        return ["weight_sync.backend: 'nccl' needs CUDA and torch sees no GPU here — use 'gloo' or 'auto'"]
    if backend == "ipc" and engine in available_engines() and engine not in ipc_engines():  # unknown: check_engine
        return [f"weight_sync.backend: 'ipc' is unsupported with rollout.engine = {engine!r} (its workers receive "
                f"through their own group) — use 'auto', 'gloo' or 'nccl', or rollout.engine = 'torch'"]
    return []


def check_devices(cfg: Config) -> list[str]:
    """cluster.placement and *_gpus against the weight backend and this machine (`check_placement`)."""
    cuda = cuda_available() if uses_gpus(cfg) or cfg.weight_sync.backend == "nccl" else False
    errors = check_placement(cfg, cuda=cuda, gpus_here=gpu_count() if cuda else 0)
    if cfg.weight_sync.backend == "nccl" and not cuda:  # check_backend says it
        errors = [e for e in errors if not e.startswith("weight_sync.backend = 'nccl' broadcasts between GPUs")]
    return errors


def check_colocated(cfg: Config) -> list[str]:
    """Colocated placement puts the generators' engines to sleep around every train step: the engine must be
    one that can (engines.base.sleeping_engines(), names only: no engine is imported)."""
    if cfg.cluster.placement != "colocated":
        return []
    sleeping = sleeping_engines()
    if cfg.rollout.engine in sleeping:
        return []
    return [f"cluster.placement: 'colocated' needs an engine that releases its K/V cache while the trainer trains, "
            f"which rollout.engine = {cfg.rollout.engine!r} does not do in asyncrl — use rollout.engine = "
            f"{' or '.join(map(repr, sleeping))}, or cluster.placement = 'disaggregated'"]


# Model types whose routers routing replay knows (engines/routing.py ROUTER_CASTS; the tiny ones: engines/hf.MOE_ARCHS)
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def check_routing(cfg: Config) -> list[str]:
    """algorithm.routing_replay on: an engine that records routing, an MoE model."""
    mode, errors = cfg.algorithm.routing_replay, []
    key = f"algorithm.routing_replay: {mode!r}"
    if not traits(cfg.rollout.engine).records_routing:
        errors.append(f"{key} needs an engine that records routing (rollout.engine = 'torch', or 'vllm' where it "
                      f"returns routed experts): the {cfg.rollout.engine} engine does not hand asyncrl its routing")
    errors += _needs_moe(cfg, key, "'off'")
    return errors


def check_router_aux(cfg: Config) -> list[str]:
    """trainer.router_aux_loss_coef > 0: an MoE model."""
    return _needs_moe(cfg, f"trainer.router_aux_loss_coef: {cfg.trainer.router_aux_loss_coef}", "0")


def _needs_moe(cfg: Config, key: str, off: str) -> list[str]:
    """[one error] where the model is known (model.build_tiny, model.path's config.json) not to be an MoE."""
    tiny, config = cfg.model.build_tiny, Path(cfg.model.path) / "config.json"
    model_type = tiny.arch if tiny is not None else None
    if model_type is None and config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except ValueError:
            model_type = None
    if model_type is not None and model_type not in MOE_MODEL_TYPES:
        return [f"{key} needs a mixture-of-experts model ({', '.join(MOE_MODEL_TYPES)}); model.path is "
                f"{model_type!r}, which routes nothing — set it to {off}"]
    return []
