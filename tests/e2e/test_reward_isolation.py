"""`reward.isolation = "process"` in whole runs: the scorers and the trainer's evaluator score through
worker processes, in process and on Ray, no call fails on the way, and no worker outlives the run."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def reward_workers() -> list[int]:
    """Process ids of the live reward workers on this machine (zombies excluded)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"asyncrl.rewards.worker" in (proc / "cmdline").read_bytes() and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile
            pass
    return pids


def none_left(timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while reward_workers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _check(rows: list[dict]) -> None:
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["buffer/failed"] == 0 for r in train)  # no reward call failed: no worker died on the way
    evals = [r for r in rows if "eval/greedy_reward" in r]
    assert evals and all(r["eval/greedy_errors"] == 0 and r["eval/sampled_errors"] == 0 for r in evals)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_an_in_process_run_scores_through_reward_workers_and_leaves_none_behind(make_config, tmp_path):
    from asyncrl.deploy.local import run_local

    assert reward_workers() == []
    cfg = make_config('reward.isolation="process"', "reward.workers=2", "trainer.eval_every=2",
                      f'run.output_dir="{tmp_path / "local"}"')
    _check(run_local(cfg))
    gc.collect()  # the trainer's evaluator pool ends with the deployment that held it
    assert none_left()


@pytest.mark.ray
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_a_ray_run_scores_through_reward_workers_and_leaves_none_behind(ray_cluster, make_config, tmp_path):
    from asyncrl.deploy.launch import run_with_ray

    cfg = make_config('reward.isolation="process"', "reward.workers=2", "reward.num_scorers=2",
                      "trainer.eval_every=2", f'run.output_dir="{tmp_path / "ray"}"')
    _check(run_with_ray(cfg))
    assert none_left()  # the actors' processes ended; their workers got the parent-death signal
