"""[env] validation through the config loader, the scorer's env-reward branch, and external submission of
groups at the staleness gate (ReplayBuffer.submit_group, used by asyncrl.Runtime.submit)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import ConfigError
from asyncrl.messages import Trajectory
from asyncrl.roles.scorer import Scorer
from asyncrl.telemetry.metrics import WindowReducer
from buffers.replay import ReplayBuffer
from tests.fakes import ThreadRewards


def errors_of(make_config, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        make_config(*overrides)
    return info.value.errors


def test_env_section_validates_builtin_and_reports_bad_paths_in_one_line(make_config):
    cfg = make_config('env.env="guess"', "env.kwargs.max_guesses=3", "data.max_prompt_len=128")
    assert cfg.env.env == "guess" and cfg.env.kwargs == {"max_guesses": 3}
    (line,) = errors_of(make_config, 'env.env="nosuchpkg.envs:MyEnv"', "data.max_prompt_len=128")
    assert line.startswith("env.env: cannot import module 'nosuchpkg.envs'")
    (line,) = errors_of(make_config, 'env.env="asyncrl.envs.builtin:MyEnv"', "data.max_prompt_len=128")
    assert "has no attribute 'MyEnv'" in line
    (line,) = errors_of(make_config, 'env.env="asyncrl.envs.builtin:guess_rows"', "data.max_prompt_len=128")
    assert "not a class" in line
    lines = errors_of(make_config, 'env.env="asyncrl.messages:Trajectory"', "data.max_prompt_len=128")
    assert "has no reset()" in lines[0] and "has no step()" in lines[1]
    (line,) = errors_of(make_config, 'env.env="guess"', "env.kwargs.colour=1", "data.max_prompt_len=128")
    assert line.startswith("env.kwargs:")
    (line,) = errors_of(make_config, 'env.env="guess"', 'env.chat_template="strict"', "data.max_prompt_len=128")
    assert line.startswith("env.chat_template:") and "has none" in line  # the tiny tokenizer has none
    (line,) = errors_of(make_config, 'env.env="guess"')  # max_prompt_len 16 < max_episode_tokens 64
    assert line.startswith("env.max_episode_tokens:")
    (line,) = errors_of(make_config, 'env.env="guess"', 'algorithm.advantage="remax"', "data.max_prompt_len=128")
    assert line.startswith("env.env: advantage 'remax' needs a greedy completion")
    (line,) = errors_of(make_config, "env.max_turns=3")
    assert line.startswith("env.env: missing required key")


CHECKED_ENV = '''
built = []


class CountdownEnv:
    """Validates its keywords when built, as a user env may; records every instance built and closed."""

    def __init__(self, *, start: int = 3):
        if not isinstance(start, int) or start < 1:
            raise ValueError(f"start must be an int >= 1, got {start!r}")
        self.start, self.closed = start, False
        built.append(self)

    async def reset(self, row):
        return str(row["prompt"])

    async def step(self, action):
        return ("", 0.0, True)

    async def close(self):
        self.closed = True
'''


def test_validate_builds_the_env_once_with_its_kwargs_so_a_wrong_value_is_one_config_line(make_config, tmp_path,
                                                                                           monkeypatch):
    import importlib

    (tmp_path / "checked_env_mod.py").write_text(CHECKED_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = ['env.env="checked_env_mod:CountdownEnv"', "data.max_prompt_len=128"]
    (line,) = errors_of(make_config, *env, "env.kwargs.start=0")  # binds to __init__, fails when built
    assert line.startswith("env.kwargs: 'checked_env_mod:CountdownEnv' cannot be built with {'start': 0}")
    assert "ValueError: start must be an int >= 1, got 0" in line
    mod = importlib.import_module("checked_env_mod")
    mod.built.clear()
    make_config(*env, "env.kwargs.start=2")
    assert [(e.start, e.closed) for e in mod.built] == [(2, True)]  # built once, and closed again


def traj(min_version: int, env_reward: float | None = 1.0) -> Trajectory:
    return Trajectory(seq_id=0, group_id=0, group_size=1, prompt_ids=[1], response_ids=[2], loss_mask=[True],
                      behavior_logprobs=[-0.1], versions=[min_version], min_version=min_version,
                      max_version=min_version, finish_reason="stop", env_reward=env_reward, turns=1)


def test_submitted_groups_are_admitted_at_their_version_and_dropped_when_too_stale():
    async def main():
        buffer = ReplayBuffer(prompts_per_step=1, group_size=2, max_staleness=0, rollout_capacity=8, train_capacity=4)
        gid = await buffer.submit_group([traj(0), traj(0)], timeout=1)
        group = await buffer.get_rollouts(8, timeout=0.1)
        assert gid == 0 and [(t.group_id, t.seq_id, t.group_size) for t in group] == [(0, 0, 2), (0, 1, 2)]
        with pytest.raises(TimeoutError):  # no room at version 0 until the trainer takes the step
            await buffer.submit_group([traj(0)], timeout=0.6)
        from asyncrl.messages import Group

        await buffer.accept_groups([Group(group_id=0, min_version=0, trajectories=group)])
        assert len(await buffer.take_step(0)) == 1
        await buffer.publish(1)
        reducer = WindowReducer()  # as the Controller reduces the buffer's windows into rows
        reducer.reduce([(await buffer.stats()).metrics], window_s=1.0)
        assert await buffer.submit_group([traj(0)], timeout=1) is None  # version 0 is too stale at k = 0
        assert await buffer.submit_group([traj(1)], timeout=1) is not None
        stats = reducer.reduce([(await buffer.stats()).metrics], window_s=1.0)
        assert stats["buffer/submitted_dropped_stale"] == 1.0 and stats["buffer/submitted_groups"] == 2.0
        assert stats["env/episodes_total"] == 3.0 and stats["env/errors_total"] == 0.0
        assert stats["env/episodes"] == 1.0  # this window: queued since the previous stats(); two before it

    asyncio.run(asyncio.wait_for(main(), 10))


class _Buffer:
    async def get_rollouts(self, max_items, timeout=None, holder=None):
        return []

    async def accept_groups(self, groups):
        self.accepted = groups

    async def release_groups(self, group_ids, reason, detail=""):
        pass


def test_scorer_uses_the_env_reward_and_never_calls_the_reward_function():
    def reward_fn(prompt, completion, **row):
        raise AssertionError("reward.fn must not be called for env episodes")

    buffer = _Buffer()
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=ThreadRewards(reward_fn), decode=lambda ids: "")
    t = traj(0, env_reward=0.75)
    asyncio.run(scorer.score_batch([t]))
    assert buffer.accepted[0].trajectories[0].reward == 0.75 and scorer.counts["reward_errors"] == 0
