"""Placement on Ray without GPUs (asyncrl/deploy/placement.py, asyncrl/deploy/launch.py): the session's cluster has
two logical GPUs, so Ray assigns GPU ids and sets CUDA_VISIBLE_DEVICES as it would on a GPU machine. What each actor
is given (whole GPUs each, or one shared GPU in the colocation bundle), that roles with no GPUs never initialise
CUDA, and that a role given a GPU its process cannot see fails with one line naming the config key."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture
def probe_class(ray_cluster):
    import os

    import ray

    @ray.remote
    class Probe:
        def where(self) -> tuple[list[str], str | None]:
            return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")

    return Probe


@pytest.mark.parametrize(("placement", "gpus", "shared"), [("disaggregated", 1, False), ("colocated", 0.5, True)])
def test_each_actor_is_given_the_gpus_its_role_asks_for(ray_cluster, make_config, probe_class, placement, gpus,
                                                        shared):
    import ray
    from ray.util.placement_group import remove_placement_group

    from asyncrl.deploy.launch import actor_options, colocation_group
    from asyncrl.deploy.plan import plan_resources

    cfg = make_config(f'cluster.address="{ray_cluster}"', f'cluster.placement="{placement}"',
                      f"cluster.trainer_gpus={gpus}", f"cluster.generator_gpus={gpus}")
    plans = {p.role: p for p in plan_resources(cfg)}
    bundle = colocation_group(cfg)
    assert (bundle is not None) == shared
    try:
        probes = {role: probe_class.options(**actor_options(plans[role], bundle)).remote()
                  for role in ("trainer", "generator", "buffer")}
        given = {role: ray.get(p.where.remote(), timeout=60) for role, p in probes.items()}
        for p in probes.values():
            ray.kill(p)
    finally:
        if bundle is not None:
            remove_placement_group(bundle)
    (trainer_gpu,), visible = given["trainer"]
    assert visible == trainer_gpu
    (generator_gpu,), _ = given["generator"]
    assert (trainer_gpu == generator_gpu) == shared  # colocated: the one GPU of the bundle; else one each
    assert given["buffer"][0] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_roles_without_gpus_run_on_the_cpu_and_never_initialise_cuda(ray_cluster, make_config, tmp_path, placement):
    from asyncrl.control.controller import Controller
    from asyncrl.deploy.launch import RayDeployment

    cfg = make_config("trainer.total_steps=12", "trainer.eval_every=0", "run.save_checkpoint=false",
                      "logging.live=false", f'cluster.placement="{placement}"', f'run.output_dir="{tmp_path}"')
    deployment = RayDeployment(cfg)
    deployment.wait_ready()
    controller = Controller(cfg, deployment)

    async def main():  # ask every actor once a step has trained (the run's end shuts them down: many steps)
        task = asyncio.create_task(controller.run())
        while controller.rows_written < 1:
            assert not task.done(), repr(task.exception())
            await asyncio.sleep(0.05)
        where = await asyncio.gather(*[a.placement.remote() for a in deployment.actors])
        return await task, where

    rows, where = asyncio.run(main())
    assert [r["step"] for r in rows if "trainer/samples" in r] == list(range(1, 13))
    assert all(w["device"] == "cpu" and w["gpu_ids"] == [] and not w["cuda_initialized"] for w in where), where


@pytest.mark.timeout(300)
def test_a_role_given_a_gpu_its_process_cannot_see_fails_with_one_line_naming_the_key(ray_cluster, make_config):
    import torch

    from asyncrl.deploy.launch import RayDeployment

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the trainer would see its GPU")
    cfg = make_config(f'cluster.address="{ray_cluster}"', "cluster.trainer_gpus=1")
    deployment = RayDeployment(cfg)
    try:
        with pytest.raises(Exception) as info:
            deployment.wait_ready()
    finally:
        asyncio.run(deployment.shutdown())
    assert ("cluster.trainer_gpus = 1: the trainer should run on a GPU but its process sees no CUDA device "
            "(torch ") in str(info.value)
    assert "CUDA_VISIBLE_DEVICES='0'" in str(info.value) or "CUDA_VISIBLE_DEVICES='1'" in str(info.value)
