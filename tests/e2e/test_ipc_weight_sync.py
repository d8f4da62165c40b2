"""`weight_sync.backend = "ipc"` on Ray (transports/ipc.py): the trainer and generator actors exchange weights
through the trainer's shared-memory buffer (CPU here), train every step, and re-form the group under a fresh name
around a generator restarted after a SIGKILL."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _transport_probe():
    """A function for `actor.__ray_call__`: inside a RoleActor, (the class of its sender or receiver, the weight
    group it is in). Made in a function so that Ray pickles it by value (the actors cannot import this module)."""
    def probe(actor) -> tuple[str, str]:
        if actor.kind == "trainer":
            return type(actor.role.sender).__name__, ""
        return type(actor.role.receiver).__name__, actor.role.weight_group

    return probe


def _train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "trainer/samples" in r]


@pytest.mark.timeout(300)
def test_a_ray_run_with_ipc_weight_sync_trains_every_step(ray_cluster, make_config, tmp_path):
    from asyncrl.deploy.launch import run_with_ray

    steps = 4
    cfg = make_config('weight_sync.backend="ipc"', f"trainer.total_steps={steps}", "trainer.eval_every=0",
                      "rollout.num_generators=2", "run.save_checkpoint=false", "logging.live=false",
                      f'run.output_dir="{tmp_path / "run"}"')
    seen: list[tuple[str, str]] = []

    async def inspect(controller, deployment) -> None:  # while the actors live: what each one holds
        while controller.rows_written < 1:
            await asyncio.sleep(0.05)
        members = [deployment.trainer_actor, *deployment.generator_actors]
        seen.extend(await asyncio.gather(*[a.__ray_call__.remote(_transport_probe()) for a in members]))

    train = _train_rows(run_with_ray(cfg, beside=inspect))
    assert seen == [("IpcSender", ""), ("IpcReceiver", "weights"), ("IpcReceiver", "weights")]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert sum(r["trainer/samples"] for r in train) == steps * cfg.samples_per_step
    assert all(r["sync/bytes"] > 0 and r["sync/buckets"] >= 1 for r in train)


@pytest.mark.timeout(420)
def test_a_generator_killed_under_ipc_is_restarted_into_a_re_formed_ipc_group(ray_cluster, make_config, tmp_path,
                                                                            caplog):
    from asyncrl.deploy.launch import run_with_ray

    steps = 6
    cfg = make_config('weight_sync.backend="ipc"', f"trainer.total_steps={steps}", "trainer.eval_every=0",
                      "rollout.num_generators=2", "run.save_checkpoint=false", "logging.live=false",
                      "weight_sync.timeout_s=30", f'run.output_dir="{tmp_path / "run"}"')

    async def kill(controller, deployment) -> None:
        while controller.rows_written < 2:
            await asyncio.sleep(0.05)
        os.kill(await deployment.generator_actors[0].pid.remote(), signal.SIGKILL)

    with caplog.at_level(logging.INFO, logger="asyncrl.control.supervisor"):
        train = _train_rows(run_with_ray(cfg, beside=kill))
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["supervisor/restarts"] == 1
    assert sum(r["trainer/samples"] for r in train) == steps * cfg.samples_per_step
    # the ipc group (every member joins by weight_sync.backend) re-formed under a fresh name: a new shared buffer
    assert "re-forming the weight-sync group as 'weights-1'" in caplog.text
    assert all(r["sync/bytes"] > 0 for r in train[-2:])
