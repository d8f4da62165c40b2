"""Where each role runs (asyncrl/deploy/placement.py): devices, the weight backend `auto` picks, what each actor asks
Ray for, and the one-line errors of impossible placements (checked through `load_config`, as a user meets them)."""

from __future__ import annotations

import pytest

import asyncrl.deploy.placement as placement_mod
from asyncrl.config import load_config
from asyncrl.deploy.launch import actor_options  # (imported before the autouse fixture stubs the registries)
from asyncrl.deploy.placement import colocated_bundle, role_device, weight_backend
from asyncrl.deploy.plan import derived, plan_resources
from tests.unit.test_config import errors_of, workdir, write_config  # noqa: F401 (the autouse fixture)

ONE_GPU = {"cluster.trainer_gpus": 0.5, "cluster.generator_gpus": 0.5, "cluster.placement": "colocated"}
TWO_GPUS = {"cluster.trainer_gpus": 1, "cluster.generator_gpus": 1}


@pytest.fixture
def gpus(monkeypatch):
    """This machine has CUDA and `n` GPUs (the checks ask torch; here they are told)."""
    def have(n: int) -> None:
        monkeypatch.setattr(placement_mod, "cuda_available", lambda: n > 0)
        monkeypatch.setattr(placement_mod, "gpu_count", lambda: n)
    return have


@pytest.mark.parametrize(("edits", "devices", "backend"), [
    ({}, ("cpu", "cpu"), "gloo"),
    (TWO_GPUS, ("cuda", "cuda"), "nccl"),
    (ONE_GPU, ("cuda", "cuda"), "ipc"),
    ({"cluster.trainer_gpus": 1}, ("cuda", "cpu"), "gloo"),
    ({"cluster.placement": "colocated"}, ("cpu", "cpu"), "gloo"),
])
def test_each_role_runs_where_its_gpus_say_and_the_weights_take_the_backend_of_those_devices(gpus, edits, devices,
                                                                                             backend):
    gpus(1 if edits is ONE_GPU else 2)
    cfg = load_config(write_config(edits))
    assert (role_device(cfg, "trainer"), role_device(cfg, "generator")) == devices
    assert role_device(cfg, "buffer") == "cpu"
    assert weight_backend(cfg) == backend
    plans = {p.role: p for p in plan_resources(cfg)}
    assert plans["trainer"].gpus == edits.get("cluster.trainer_gpus", 0)
    assert plans["generator"].device == devices[1] and plans["buffer"].gpus == 0
    plan = derived(cfg)
    assert plan["weight_sync_backend"] == backend and plan["placement"] == cfg.cluster.placement
    assert plan["gpus_requested"] == sum(p.count * p.gpus for p in plans.values())


def test_colocated_roles_share_one_bundle_whose_gpus_are_the_sum_of_theirs(gpus):
    gpus(1)
    cfg = load_config(write_config({**ONE_GPU, "rollout.num_generators": 2, "cluster.generator_gpus": 0.25,
                                    "cluster.num_cpus": 4}))
    assert colocated_bundle(cfg) == {"CPU": cfg.cluster.trainer_cpus + 2 * cfg.cluster.generator_cpus, "GPU": 1.0}
    cpu_only = load_config(write_config({"cluster.placement": "colocated"}))
    assert "GPU" not in colocated_bundle(cpu_only)


@pytest.mark.parametrize(("cuda", "edits", "error"), [
    (0, TWO_GPUS, "cluster.trainer_gpus: 1 GPU asked for, but torch sees no CUDA device here — set it to 0 to run "
                  "the trainer on the CPU"),
    (1, {**ONE_GPU, "cluster.generator_gpus": 0.75}, "cluster.placement = 'colocated' puts the trainer and every "
                                                     "generator on one GPU, but trainer_gpus + num_generators x "
                                                     "generator_gpus = 1.25 > 1 — use fractions"),
    (1, {**ONE_GPU, "cluster.generator_gpus": 0}, "cluster.placement = 'colocated' shares one device between the "
                                                  "trainer and the generators"),
    (1, {**ONE_GPU, "rollout.engine": "vllm"}, "cluster.placement: 'colocated' needs an engine that releases its "
                                               "K/V cache"),
    (1, {**ONE_GPU, "weight_sync.backend": "nccl"}, "weight_sync.backend = 'nccl' with cluster.placement = "
                                                    "'colocated': NCCL refuses two ranks on one GPU — use 'ipc'"),
    (2, {"cluster.trainer_gpus": 0.5, "cluster.generator_gpus": 0.5, "weight_sync.backend": "nccl"},
     "weight_sync.backend = 'nccl' with a fraction of a GPU per role"),
    (1, TWO_GPUS, "cluster.placement = 'disaggregated' needs 2 GPUs (trainer_gpus + num_generators x "
                  "generator_gpus) and this machine has 1"),
    (2, {**TWO_GPUS, "weight_sync.backend": "ipc"}, "weight_sync.backend = 'ipc' needs the trainer and the "
                                                    "generators on one device"),
    (2, {"cluster.scorer_gpus": 1, "cluster.scorer_placement": "buffer"}, "cluster.scorer_gpus: the scorers run "
                                                                          "inside the buffer actor"),
    (2, {"cluster.trainer_gpus": 1.5}, "cluster.trainer_gpus: 1.5 — more than one GPU must be a whole number"),
    (2, {**TWO_GPUS, "trainer.num_ranks": 2}, "cluster.placement = 'disaggregated' needs 3 GPUs (trainer.num_ranks x "
                                              "trainer_gpus + num_generators x generator_gpus) and this machine has 2"),
    (2, {"cluster.trainer_gpus": 0.5, "trainer.num_ranks": 2}, "cluster.trainer_gpus: 0.5 with trainer.num_ranks = 2: "
                                                               "each trainer rank needs a GPU of its own"),
])
def test_an_impossible_placement_is_one_line_naming_the_fix(gpus, cuda, edits, error):
    gpus(cuda)
    errors = errors_of(write_config(edits))
    assert any(e.startswith(error) for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_gpus_on_a_cluster_joined_by_address_are_left_to_ray(gpus):
    gpus(0)  # the driver has no GPU; the cluster's nodes may
    cfg = load_config(write_config({**TWO_GPUS, "cluster.address": "10.0.0.1:6379"}))
    assert weight_backend(cfg) == "nccl"


def test_the_readme_gpu_configs_are_valid_on_the_machines_they_name(gpus):
    import re
    import tomllib
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## GPUs: where each role runs")[1].split("\n## ")[0]
    colocated, disaggregated = [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", section, flags=re.S)]

    def edits(table: dict) -> dict:
        return {f"{k}.{f}": v for k, fields in table.items() for f, v in fields.items()}

    gpus(1)
    cfg = load_config(write_config(edits(colocated)))
    assert weight_backend(cfg) == "ipc" and cfg.trainer.mixed_precision == "bf16"
    gpus(2)
    cfg = load_config(write_config(edits(disaggregated)))
    assert weight_backend(cfg) == "nccl"
    gpus(1)  # one GPU is too few for it
    assert any("needs 2 GPUs" in e for e in errors_of(write_config(edits(disaggregated))))


def test_custom_resources_and_the_network_interface_reach_each_actors_ray_options():
    cfg = load_config(write_config({"cluster.resources.generator": {"rollout_node": 1},
                                    "cluster.network_interface": "eth1"}))
    plans = {p.role: p for p in plan_resources(cfg)}
    generator = actor_options(plans["generator"], None, cfg.cluster.network_interface)
    assert generator["resources"] == {"rollout_node": 1.0}
    assert generator["runtime_env"]["env_vars"] == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    trainer = actor_options(plans["trainer"])
    assert "resources" not in trainer and "runtime_env" not in trainer and trainer["num_gpus"] == 0
    assert errors_of(write_config({"cluster.resources.trainer": {"gpu_node": 0}}))[0].startswith(
        "cluster.resources.trainer.gpu_node: expected a number > 0")


def test_on_a_cluster_of_its_own_each_actor_caps_glibcs_arenas_unless_the_user_set_them(monkeypatch):
    """A local cluster's processes inherit MALLOC_ARENA_MAX from the driver (start_ray); a cluster's workers at
    cluster.address do not, so each actor carries it in its runtime_env (asyncrl/deploy/native_memory.py)."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    plan = {p.role: p for p in plan_resources(load_config(write_config({})))}["trainer"]
    assert "runtime_env" not in actor_options(plan)
    assert actor_options(plan, remote=True)["runtime_env"]["env_vars"] == {"MALLOC_ARENA_MAX": "2"}
    assert actor_options(plan, None, "eth1", remote=True)["runtime_env"]["env_vars"] == {
        "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1", "MALLOC_ARENA_MAX": "2"}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert "runtime_env" not in actor_options(plan, remote=True)
