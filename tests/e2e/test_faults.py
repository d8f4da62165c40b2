"""Faults end to end on a tiny model: a reward function that raises is contained and every admitted group
is accounted for; a run whose every group fails, and a role whose event loop is blocked, end with one error
naming the cause instead of a livelock or a hang; a dead actor ends the run with an error instead of a hang;
Ctrl-C on `asyncrl launch` stops the run with exit code 130 and leaves no actor of it behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncrl.telemetry.metrics import read_metrics

pytestmark = pytest.mark.slow  # whole runs, some on Ray

torch.set_num_threads(1)

FLAKY_REWARD = '''
import itertools
import zlib

_calls = itertools.count()


def reward(prompt, completion, answer):
    """prefix_match, but raises on ~30% of calls (which ones: a hash of the call counter)."""
    n = next(_calls)
    if zlib.crc32(str(n).encode()) % 10 < 3:
        raise RuntimeError(f"flaky reward failed on call {n}")
    return 1.0 if completion.startswith(answer) else 0.0
'''


def _train_rows(rows):
    return [r for r in rows if "reward/mean" in r]


@pytest.mark.timeout(180)  # a hang fails the test instead of the suite
def test_raising_reward_is_contained_and_every_admitted_group_is_accounted_for(make_config, tmp_path,
                                                                               monkeypatch):
    from asyncrl.deploy.local import run_local

    (tmp_path / "flaky_reward_mod.py").write_text(FLAKY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    # group_size 2 so that about half the groups survive a 30% per-sample failure rate
    cfg = make_config('reward.fn="flaky_reward_mod:reward"', "rollout.group_size=2", "trainer.total_steps=4",
                      "trainer.eval_every=0", f'run.output_dir="{tmp_path / "flaky"}"')
    rows = run_local(cfg)
    assert [r["step"] for r in _train_rows(rows)] == [1, 2, 3, 4]
    on_disk = read_metrics(tmp_path / "flaky" / "metrics.jsonl")
    assert len(on_disk) == len(rows)
    last = on_disk[-1]
    assert last["buffer/failed"] > 0
    assert last["scorer/reward_errors"] > 0
    assert last["buffer/consumed"] == 4 * cfg.trainer.prompts_per_step
    for row in on_disk:  # every snapshot, not only the last: no admitted group is ever unaccounted for
        stored = row["buffer/accepted"] - row["buffer/consumed"]
        assert stored == row["buffer/train_depth"], row
        assert row["buffer/admitted"] == (row["buffer/consumed"] + row["buffer/failed"] + row["buffer/filtered"]
                                          + row["buffer/running"] + stored), row


# -- every group fails: the run ends with one error naming the reasons, instead of refilling forever --------
NO_PROGRESS_MOD = '''
from asyncrl.tasks.digits import first_digit


def raising_reward(prompt, completion, **row):
    raise RuntimeError("reward service is down")


def rows_with_a_set(split="train", seed=0):
    """first_digit rows, each with a field JSON cannot encode (a set)."""
    return [{**row, "tags": {"digits"}} for row in first_digit(split, seed)]
'''


@pytest.mark.timeout(120)  # before the watch: a livelock, and the test hangs until here
@pytest.mark.parametrize("cause, overrides, reason", [
    ("raising_reward", ['reward.fn="no_progress_mod:raising_reward"'], "RuntimeError: reward service is down"),
    ("rows_without_answer_key", ['reward.answer_key="solution"'], "the row has no field 'solution'"),
    ("row_not_json", ['data.source="no_progress_mod:rows_with_a_set"'], "not JSON serializable"),
])
def test_a_run_whose_every_group_fails_ends_with_one_error_naming_the_reason(make_config, tmp_path, monkeypatch,
                                                                             cause, overrides, reason):
    from asyncrl.control.watchdog import RunStalled
    from asyncrl.deploy.local import run_local

    (tmp_path / "no_progress_mod.py").write_text(NO_PROGRESS_MOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / cause
    cfg = make_config(*overrides, "run.max_failed_groups_in_a_row=12", "trainer.eval_every=0",
                      "run.save_checkpoint=false", f'run.output_dir="{run_dir}"')
    with pytest.raises(RunStalled) as info:
        run_local(cfg)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "groups all failed or were filtered" in message and "run.max_failed_groups_in_a_row = 12" in message
    assert reason in message, message
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or read_metrics(metrics) == []  # no step was ever trained


# -- a role's event loop blocked: the run ends with one error naming where, instead of hanging ----------------
# by import path from the repository root: Ray adds the driver's working directory to its workers' sys.path
BLOCKING_ENV = ['env.env="tests.e2e.stall_fixtures:BlockingEnv"', "env.max_episode_tokens=8",
                "rollout.max_new_tokens=2", "trainer.eval_every=0", "run.save_checkpoint=false"]


@pytest.mark.timeout(180)
def test_an_env_step_that_blocks_the_event_loop_ends_the_in_process_run_with_where_it_blocked(make_config,
                                                                                              tmp_path):
    # In process every role shares one event loop: the block (3 s, once) stops them all. The watch reads the
    # stall once the loop runs again; without it, the run would just go on after the block.
    from asyncrl.control.watchdog import RunStalled
    from asyncrl.deploy.local import run_local

    cfg = make_config(*BLOCKING_ENV, "env.kwargs.seconds=3.0", "run.role_timeout_s=1.0", "trainer.total_steps=50",
                      f'run.output_dir="{tmp_path / "blocked"}"')
    with pytest.raises(RunStalled) as info:
        run_local(cfg)
    message = str(info.value)
    assert message.startswith("the event loop of the in-process roles did not run for "), message
    assert "(run.role_timeout_s = 1): blocked in stall_fixtures.py:" in message and " in step" in message
    assert "generator 0: generate (env episodes), begun " in message


# -- Ray ----------------------------------------------------------------------------------------------
def _alive_role_actors() -> set[str]:
    """Ids of ALIVE RoleActor actors in the cluster (GCS table; the dashboard's state API is off here)."""
    import ray._private.state as ray_state

    return {aid for aid, info in ray_state.actors().items()
            if info.get("State") == "ALIVE" and "RoleActor" in str(info.get("ActorClassName", ""))}


def _wait_for(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_killed_generator_actor_without_restarts_fails_the_run_fast_and_shuts_down(ray_cluster, make_config,
                                                                                 tmp_path):
    import ray

    from asyncrl.control.controller import Controller, RoleFailed
    from asyncrl.deploy.launch import RayDeployment

    cfg = make_config("trainer.total_steps=200", "trainer.eval_every=0", "run.save_checkpoint=false",
                      "cluster.max_restarts=0", f'run.output_dir="{tmp_path / "dead"}"')
    deployment = RayDeployment(cfg)
    deployment.wait_ready()
    controller = Controller(cfg, deployment)

    async def main() -> tuple[BaseException | None, float]:
        task = asyncio.create_task(controller.run())
        t0 = time.monotonic()
        while controller.rows_written < 2:
            assert not task.done(), f"run ended before the kill: {task.exception()!r}"
            assert time.monotonic() - t0 < 120, "no two steps within 120 s"
            await asyncio.sleep(0.1)
        ray.kill(deployment.generator_actors[0])
        t_kill = time.monotonic()
        try:
            await asyncio.wait_for(task, 45)
        except asyncio.TimeoutError:
            raise AssertionError("controller hung after its generator died") from None
        except Exception as exc:  # the failure we want
            return exc, time.monotonic() - t_kill
        return None, time.monotonic() - t_kill

    exc, elapsed = asyncio.run(main())
    assert exc is not None, "run finished 200 steps although its only generator was killed"
    assert isinstance(exc, (RoleFailed, ray.exceptions.RayActorError)), repr(exc)
    assert elapsed < 30, f"took {elapsed:.1f}s to fail"
    assert controller.rows_written < 200
    for actor in deployment.actors:  # shutdown killed every actor of the run (ray.kill is asynchronous: a call
        deadline = time.monotonic() + 30  # made just after it may still be answered before the actor dies)
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray.get(actor.ready.remote(), timeout=30)
                time.sleep(0.2)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ctrl_c_on_launch_checkpoints_exits_130_and_leaves_no_actors(ray_cluster, tiny_config_file, tmp_path):
    run_dir = tmp_path / "sigint"
    before = _alive_role_actors()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "launch", str(tiny_config_file), "--address", ray_cluster,
             "--set", "trainer.total_steps=500", "--set", "trainer.eval_every=0",
             "--set", f'run.output_dir="{run_dir}"'],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            metrics = run_dir / "metrics.jsonl"

            def two_rows() -> bool:
                assert proc.poll() is None, f"launch exited early:\n{log_path.read_text()[-3000:]}"
                return metrics.is_file() and len(metrics.read_text().splitlines()) >= 2

            _wait_for(two_rows, 150, "two metrics rows")
            assert len(_alive_role_actors() - before) == 3  # buffer (hosting the scorer), trainer, generator
            proc.send_signal(signal.SIGINT)
            t0 = time.monotonic()
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"launch did not exit within 30 s of SIGINT (its signal masks: "
                                     f"{_signal_masks(proc.pid)}):\n{log_path.read_text()[-3000:]}") from None
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = log_path.read_text()
    assert rc == 130, out[-3000:]
    assert "stopped by SIGINT after step" in out and f"asyncrl launch --resume {run_dir}" in out  # checkpointed
    assert any(run_dir.glob("checkpoints/step_*"))
    assert elapsed < 30
    _wait_for(lambda: not (_alive_role_actors() - before), 15, "the run's actors to die")
    assert len(read_metrics(run_dir / "metrics.jsonl")) < 500


def _signal_masks(pid: int) -> str:
    """The SigBlk / SigIgn / SigCgt lines of /proc/PID/status (bit 1 = SIGINT), to tell an ignored or
    blocked Ctrl-C from one that was caught and then lost."""
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except OSError as exc:
        return f"unreadable: {exc}"
    return ", ".join(line.replace("\t", " ") for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["env_step_blocks_the_generator_loop", "reward_holds_the_interpreter_lock"])
def test_a_stalled_role_actor_ends_the_run_with_one_error_naming_it(ray_cluster, make_config, tmp_path, case):
    # Under Ray each role has its own process: the Controller's watch asks each actor for a heartbeat, answered
    # from the actor's "watch" thread while the role's loop is blocked; a process in which nothing runs (the
    # interpreter lock held) does not answer at all. Both blocks last for good: only the watch ends the run.
    from asyncrl.control.controller import Controller
    from asyncrl.control.watchdog import RunStalled
    from asyncrl.deploy.launch import RayDeployment, run_loop

    if case == "env_step_blocks_the_generator_loop":
        overrides = [*BLOCKING_ENV, "env.kwargs.seconds=600.0"]
        # the last thing begun: the episodes' generate, or the armed weight receive that runs beside it
        expected = ["the event loop of generator 0 did not run for ", "blocked in stall_fixtures.py:",
                    "last activity: generator 0: ", ", begun "]
    else:
        overrides = ['reward.fn="tests.e2e.stall_fixtures:gil_holding_reward"', "trainer.eval_every=0",
                     "run.save_checkpoint=false", 'cluster.scorer_placement="actor"']  # the scorer's own process
        expected = ["scorer 0 has not answered for 3 s (run.role_timeout_s): nothing in its process runs, so "
                    "something there holds the interpreter lock"]
    cfg = make_config(*overrides, "run.role_timeout_s=3.0", "trainer.total_steps=50",
                      f'run.output_dir="{tmp_path / case}"', f'cluster.address="{ray_cluster}"')
    deployment = RayDeployment(cfg)
    deployment.wait_ready()
    t0 = time.monotonic()
    with pytest.raises(RunStalled) as info:
        run_loop(Controller(cfg, deployment).run())
    message = str(info.value)
    assert all(text in message for text in expected), message
    # the Controller asked none of that process's roles to stop (a stop() it would wait 10 s for in vain)
    assert info.value.process == ("generator 0" if case == "env_step_blocks_the_generator_loop" else "scorer 0")
    assert time.monotonic() - t0 < 150  # the watch's bound, with room for actor startup on a loaded machine
