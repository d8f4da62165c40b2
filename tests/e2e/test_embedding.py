"""asyncrl.Runtime drives a short training run from a plain asyncio agent loop on the tiny model: the
loop generates and submits, training runs in the background, and the policy version advances."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl import Runtime
from asyncrl.messages import Trajectory

torch.set_num_threads(1)

TOML = """
[model]
path = "{model_dir}"
[model.build_tiny]
hidden_size = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 64
vocab = "0123456789+-?"

[data]
source = "asyncrl.envs.builtin:guess_rows"
max_prompt_len = 96

[env]
env = "guess"

[rollout]
group_size = 4
max_new_tokens = 1

[trainer]
total_steps = 3
prompts_per_step = 2
micro_batch_size = 16
lr = 1e-2
eval_every = 0

[run]
output_dir = "{run_dir}"
save_checkpoint = false
"""


def tiny_config(tmp_path, *overrides):
    from asyncrl.config import load_config

    path = tmp_path / "config.toml"
    path.write_text(TOML.format(model_dir=tmp_path / "model", run_dir=tmp_path / "run"))
    return load_config(path, list(overrides))


async def play_guess(rt: Runtime, target: int, max_guesses: int = 4):
    """The guessing game, played by the user's own loop (no asyncrl env involved)."""
    ep = rt.episode("?")
    for turn in range(max_guesses):
        text = (await ep.act(max_new_tokens=1)).strip()
        if text[:1].isdigit() and int(text[0]) == target:
            ep.reward = 1.0 - turn / max_guesses
            break
        if turn + 1 < max_guesses:
            ep.observe("?" if not text[:1].isdigit() else ("+" if target > int(text[0]) else "-"))
    return ep


def test_runtime_trains_from_an_agent_loop_and_the_version_advances(tmp_path):
    cfg = tiny_config(tmp_path)

    async def main():
        async with Runtime(cfg) as rt:
            assert rt.version == 0
            c = await rt.generate("?", max_new_tokens=2)
            assert len(c.response_ids) == len(c.logprobs) == len(c.versions) and c.versions[0] == 0
            target, submitted = 0, []
            while rt.version < 2:
                target = (target + 3) % 10
                group = await asyncio.gather(*[play_guess(rt, target) for _ in range(4)])
                submitted.append(await rt.submit(group, timeout=30))
            await rt.wait_for_version(2, timeout=30)
            rows = await asyncio.wait_for(rt.wait_done(), 60) if len(submitted) >= 6 else rt.metrics
            return rt.version, submitted, rows

    version, submitted, rows = asyncio.run(asyncio.wait_for(main(), 120))
    assert version >= 2
    assert all(isinstance(g, int) for g in submitted) and len(set(submitted)) == len(submitted)
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) >= 2 and train[-1]["buffer/submitted_groups"] >= 4
    assert train[-1]["env/episodes"] >= 16 and "staleness/max" in train[-1]


def test_runtime_submit_after_training_ends_raises_and_wait_reports_it(tmp_path):
    from asyncrl.embed import TrainingFinished

    cfg = tiny_config(tmp_path, "trainer.prompts_per_step=1", "trainer.total_steps=1")

    async def main():
        async with Runtime(cfg) as rt:
            ep = rt.episode("?")
            await ep.act(max_new_tokens=1)
            ep.reward = 1.0
            traj = ep.to_trajectory()
            assert isinstance(traj, Trajectory) and traj.env_reward == 1.0
            assert await rt.submit([ep]) is not None
            await rt.wait_for_version(1, timeout=30)
            await asyncio.wait_for(rt.wait_done(), 30)
            with pytest.raises(TrainingFinished):
                await rt.wait_for_version(2, timeout=5)
            with pytest.raises(TrainingFinished):
                await rt.submit([ep])
            c = await rt.generate("?", max_new_tokens=1)  # the engines stay up until the context exits
            assert c.versions == [1]

    asyncio.run(asyncio.wait_for(main(), 90))
