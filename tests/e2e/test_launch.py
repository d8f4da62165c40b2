"""`asyncrl launch` end to end on a tiny model: the run finishes, writes its run directory, and the
staleness bound holds — reached when the trainer is slow, never exceeded, and exactly 0 on-policy."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _train_rows(rows):
    return [r for r in rows if "reward/mean" in r]


# `asyncrl launch` on Ray writing the run directory: tests/e2e/test_first_digit_learns.py (the README's command)


def test_a_local_cluster_requires_ray_token_authentication(ray_cluster):
    """Ray 2.60 starts a local cluster (`ray.init(address="local")`, as `start_ray` does) with token
    authentication on unless RAY_AUTH_MODE says otherwise: the README's trust model relies on it."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    assert os.environ.get("RAY_AUTH_MODE", "token") == "token"
    assert get_authentication_mode() == AuthenticationMode.TOKEN


def test_slow_trainer_reaches_but_never_exceeds_staleness_2(ray_cluster, make_config, tmp_path):
    from asyncrl.deploy.launch import run_with_ray

    # 12 epochs over each step's samples makes the trainer slow next to generation, so generators
    # run as far ahead as the bound allows.
    cfg = make_config("staleness.max_staleness=2", "trainer.epochs=12", "trainer.total_steps=8",
                      "trainer.eval_every=0", f'run.output_dir="{tmp_path / "k2"}"')
    rows = _train_rows(run_with_ray(cfg))
    assert len(rows) == 8
    assert max(r["staleness/max"] for r in rows) == 2
    assert all(r["staleness/max"] <= 2 for r in rows)


def test_scorers_hosted_in_the_buffer_actor_score_every_sample(ray_cluster, make_config, tmp_path):
    """cluster.scorer_placement = "buffer": no scorer actors; the buffer's actor runs both scorers, which
    score every sample the trainer trains on."""
    from asyncrl.control.controller import Controller
    from asyncrl.deploy.launch import RayDeployment, run_loop

    cfg = make_config('cluster.scorer_placement="buffer"', "reward.num_scorers=2", "trainer.total_steps=3",
                      "trainer.eval_every=0", "run.save_checkpoint=false", f'run.output_dir="{tmp_path / "buffer"}"')
    deployment = RayDeployment(cfg)
    assert deployment.scorer_actors == []
    assert deployment.actors == [deployment.buffer_actor, deployment.trainer_actor, *deployment.generator_actors]
    deployment.wait_ready()
    rows = _train_rows(run_loop(Controller(cfg, deployment).run()))
    assert [r["step"] for r in rows] == [1, 2, 3]
    samples = 3 * cfg.samples_per_step
    assert sum(r["trainer/samples"] for r in rows) == samples
    # every trained sample was scored by the hosted scorers (a window may score none: its groups were
    # scored ahead, during the window before)
    scored = sum(r["scorer/samples_per_s"] * r["time/step_s"] for r in rows)
    assert scored >= samples - 0.5 and all(r["buffer/failed"] == 0 for r in rows)
    trace = json.loads((tmp_path / "buffer" / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert any(names.get(e.get("pid")) == "scorer" and e.get("name") == "score" for e in events)


def test_on_policy_k0_trains_only_on_data_of_the_current_version(make_config, tmp_path):
    from asyncrl.deploy.local import run_local

    cfg = make_config("staleness.max_staleness=0", "trainer.total_steps=4", "trainer.eval_every=0",
                      "rollout.num_generators=2", f'run.output_dir="{tmp_path / "k0"}"')
    rows = _train_rows(run_local(cfg))
    assert len(rows) == 4
    # staleness = step - min_version = 0 for every trajectory: no episode of step s started before the
    # weights of version s were published and loaded.
    assert all(r["staleness/max"] == 0 and r["staleness/mean"] == 0 for r in rows)


def test_in_flight_updates_yield_trajectories_that_span_versions_within_the_bound(make_config, tmp_path):
    """Generation is the bottleneck (2 groups in flight, 4 per step, k = 2), so the generator is always
    mid-sequence when a swap lands: trained trajectories carry tokens of two versions — and staleness
    (from min_version) still never exceeds k. (That a swap lands exactly between two decode steps with
    exact per-token stamps is tested deterministically at the engine level.)"""
    from asyncrl.deploy.local import run_local

    cfg = make_config("staleness.max_staleness=2", "rollout.concurrency=2", "rollout.max_new_tokens=24",
                      "trainer.total_steps=6", "trainer.eval_every=0", "rollout.weight_update=\"in_flight\"",
                      f'run.output_dir="{tmp_path / "span"}"')
    rows = _train_rows(run_local(cfg))
    assert len(rows) == 6
    assert max(r["rollout/multi_version_share"] for r in rows) > 0
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert all(r["rollout/kv_reused_share"] == 0 for r in rows)  # recompute is the default


def test_between_requests_updates_never_mix_versions_in_a_trajectory(make_config, tmp_path):
    from asyncrl.deploy.local import run_local

    cfg = make_config("staleness.max_staleness=1", "rollout.max_new_tokens=24", "trainer.total_steps=4",
                      "trainer.eval_every=0", "rollout.weight_update=\"between_requests\"",
                      f'run.output_dir="{tmp_path / "between"}"')
    rows = _train_rows(run_local(cfg))
    assert len(rows) == 4
    assert all(r["rollout/multi_version_share"] == 0 for r in rows)


def test_an_over_long_prompt_ends_the_launch_with_one_line_and_no_actor_left(ray_cluster, make_config, tmp_path):
    """The Ray launch checks the run's prompts while its actors start: an over-long one (data.overlong = "error")
    is a ValueError of one line per split, and the actors it started are gone."""
    from ray._private.state import actors  # `ray.util.state` needs ray[default]

    from asyncrl.deploy.launch import run_with_ray

    def alive() -> set[str]:
        return {a for a, info in actors().items() if info["State"] != "DEAD"}

    before = alive()
    cfg = make_config("data.max_prompt_len=2", 'data.overlong="error"', "trainer.total_steps=1",
                      f'run.output_dir="{tmp_path / "run"}"')
    with pytest.raises(ValueError, match="max_prompt_len") as err:
        run_with_ray(cfg)
    lines = str(err.value).splitlines()  # one per split: train, and eval (evaluation is on)
    assert len(lines) == 2 and all(line.startswith("data.max_prompt_len: ") for line in lines), lines
    left = alive() - before
    assert not left, left


def test_the_prompts_are_checked_while_ray_starts(make_config, tmp_path, monkeypatch):
    """Start-up (summary.json startup_s): the driver checks the run's prompts on a thread of its own while
    `ray.init` starts the cluster (Ray's processes leave the driver's core mostly idle), not after it; a problem
    it finds still ends the launch with its line and the deployment shut down. Ray itself is stood in for here:
    the stand-in start returns only once the check is under way, which a check run after it never is."""
    import threading

    from asyncrl.deploy import launch

    checking, events = threading.Event(), []

    def check(cfg):
        events.append(("check", threading.current_thread() is threading.main_thread()))
        checking.set()
        return ["data.max_prompt_len: a prompt of 9 tokens"]

    def start(cfg):
        assert checking.wait(30), "the prompt check did not start before Ray's start returned"
        events.append(("ray started",))
        return False

    class Deployment:
        def __init__(self, cfg, trainer_spread):
            events.append(("actors",))

        async def shutdown(self):
            events.append(("shutdown",))

    monkeypatch.setattr(launch, "check_prompts", check)
    monkeypatch.setattr(launch, "start_ray", start)
    monkeypatch.setattr(launch, "RayDeployment", Deployment)
    cfg = make_config("trainer.total_steps=1", f'run.output_dir="{tmp_path / "run"}"')
    with pytest.raises(ValueError, match="a prompt of 9 tokens"):
        launch.run_with_ray(cfg)
    assert events == [("check", False), ("ray started",), ("actors",), ("shutdown",)]
