"""asyncrl.Runtime drives a short training run from a plain asyncio agent loop on the tiny model: the
loop generates and submits, training runs in the background, and the policy version advances."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl import Runtime
from asyncrl.messages import Trajectory

pytestmark = pytest.mark.slow  # trains a tiny model in process

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


async def rows_through(rt: Runtime, step: int) -> list[dict]:
    while not any(r.get("step", -1) >= step for r in rt.metrics):
        await asyncio.sleep(0.01)
    return rt.metrics


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
            if len(submitted) >= 6:
                rows = await asyncio.wait_for(rt.wait_done(), 60)
            else:  # version 2 is published inside step 2; its row follows once the roles' stats are gathered
                rows = await asyncio.wait_for(rows_through(rt, 2), 30)
            return rt.version, submitted, rows

    version, submitted, rows = asyncio.run(asyncio.wait_for(main(), 120))
    assert version >= 2
    assert all(isinstance(g, int) for g in submitted) and len(set(submitted)) == len(submitted)
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) >= 2 and train[-1]["buffer/submitted_groups"] >= 4
    assert train[-1]["env/episodes_total"] >= 16 and "staleness/max" in train[-1]
    assert sum(r["env/episodes"] for r in train[:2]) >= 2 * 2 * 4  # two steps of 2 groups of 4, each queued in time


def test_runtime_submit_after_training_ends_raises_and_wait_reports_it(tmp_path):
    from asyncrl.runtime import TrainingFinished

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


def test_runtime_refuses_what_it_cannot_train_with_one_line_before_starting(tmp_path):
    import msgspec

    cfg = tiny_config(tmp_path)  # (with [env] the config check itself refuses ReMax; a Runtime may have none)
    remax = msgspec.structs.replace(cfg, env=None, algorithm=msgspec.structs.replace(cfg.algorithm, advantage="remax"))
    with pytest.raises(ValueError, match="^algorithm.advantage: 'remax' needs a greedy baseline"):
        Runtime(remax)
    rt = Runtime(tiny_config(tmp_path))  # not entered: submit checks its input before touching the buffer

    def traj(**kw) -> Trajectory:
        fields = dict(seq_id=0, group_id=0, group_size=1, prompt_ids=[1], response_ids=[2, 3], loss_mask=[True, True],
                      behavior_logprobs=[-1.0, -1.0], versions=[0, 0], min_version=0, max_version=0,
                      finish_reason="stop", temperature=1.0, env_reward=1.0)
        return Trajectory(**{**fields, **kw})

    for bad, why in [(traj(temperature=0.0), "greedily"), (traj(prompt_ids=[]), "prompt token"),
                     (traj(loss_mask=[True]), "one entry per response token")]:
        with pytest.raises(ValueError, match=why):
            asyncio.run(rt.submit([traj(), bad]))
    with pytest.raises(TypeError, match="AgentEpisodes or Trajectories"):
        asyncio.run(rt.submit(["not a trajectory"]))



def test_runtime_that_fails_to_start_shuts_down_what_it_started(tmp_path, monkeypatch):
    import asyncrl.runtime
    from asyncrl.deploy.local import LocalDeployment

    closed = []
    real_shutdown = LocalDeployment.shutdown

    async def shutdown(self):
        closed.append(self)
        await real_shutdown(self)

    def broken_controller(*args, **kwargs):
        raise RuntimeError("controller could not start")

    monkeypatch.setattr(LocalDeployment, "shutdown", shutdown)
    monkeypatch.setattr(asyncrl.runtime, "Controller", broken_controller)

    async def main():
        async with Runtime(tiny_config(tmp_path)):
            raise AssertionError("the context must not be entered")

    with pytest.raises(RuntimeError, match="controller could not start"):
        asyncio.run(asyncio.wait_for(main(), 60))
    assert len(closed) == 1  # the engines the deployment started were closed


def test_runtime_resumes_from_its_checkpoint_with_the_version_and_metrics_it_had(tmp_path):
    import json

    from asyncrl.runtime import TrainingFinished

    async def train(cfg, resume: bool):
        async with Runtime(cfg, resume=resume) as rt:
            start = rt.version
            target = 0
            try:
                while not rt.training_done:
                    target = (target + 3) % 10
                    group = await asyncio.gather(*[play_guess(rt, target) for _ in range(4)])
                    await rt.submit(group, timeout=30)
            except TrainingFinished:
                pass
            await asyncio.wait_for(rt.wait_done(), 60)
            return start, rt.version

    sets = ("trainer.prompts_per_step=1", "run.save_every=2")
    first = asyncio.run(asyncio.wait_for(train(tiny_config(tmp_path, *sets, "trainer.total_steps=4"), False), 120))
    assert first == (0, 4)
    second = asyncio.run(asyncio.wait_for(train(tiny_config(tmp_path, *sets, "trainer.total_steps=6"), True), 120))
    assert second == (4, 6)  # the version numbering goes on from the checkpoint's
    run_dir = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == [1, 2, 3, 4, 5, 6]
    ids = [g[0] for r in ledger for g in r["groups"]]
    assert len(ids) == len(set(ids)) == 6  # every accepted group trained once


def test_runtime_resume_without_a_checkpoint_fails_in_the_context_entry_with_one_line(tmp_path):
    cfg = tiny_config(tmp_path)

    async def main():
        async with Runtime(cfg, resume=True):
            raise AssertionError("entered without a checkpoint")

    with pytest.raises(RuntimeError, match="no valid checkpoint"):
        asyncio.run(asyncio.wait_for(main(), 60))
