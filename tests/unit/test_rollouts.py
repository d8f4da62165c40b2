"""What the model writes (asyncrl/telemetry/rollouts.py): rollouts.jsonl lines, the console's samples, the
sinks' tables; and the Trainer putting a step's decoded samples in its metrics every N steps."""

from __future__ import annotations

import json
import logging

import pytest

from asyncrl.messages import Trajectory
from asyncrl.telemetry.rollouts import RolloutLog, train_samples


def _traj(seq_id: int, response: list[int], reward: float) -> Trajectory:
    return Trajectory(seq_id=seq_id, group_id=seq_id // 2, group_size=2, prompt_ids=[1], response_ids=response,
                      loss_mask=[True] * len(response), behavior_logprobs=[0.0] * len(response),
                      versions=[3] * len(response), min_version=3, max_version=4, finish_reason="stop",
                      prompt_text="2+2=", reward=reward, reward_components={"correct": reward, "format": 1.0})


class Sink:
    def __init__(self):
        self.calls = []

    def log_samples(self, step, samples):
        self.calls.append((step, samples))


def test_train_samples_decode_each_trajectory_with_its_reward_components_and_versions():
    samples = train_samples([_traj(0, [4], 1.0), _traj(1, [5, 6], 0.0)], lambda ids: "".join(map(str, ids)))
    assert samples[1] == {"split": "train", "group_id": 0, "seq_id": 1, "prompt": "2+2=", "completion": "56",
                          "reward": 0.0, "components": {"correct": 0.0, "format": 1.0}, "min_version": 3,
                          "max_version": 4, "finish_reason": "stop", "completion_tokens": 2}


def test_rollout_log_appends_lines_shows_the_first_k_and_feeds_the_sinks(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="asyncrl.telemetry.rollouts")
    sink = Sink()
    out = RolloutLog(tmp_path, shown=1, sinks=[sink])
    samples = train_samples([_traj(0, [4], 1.0), _traj(1, [5], 0.0)], lambda ids: "x\n" * 200)
    out.write(10, samples)
    out.write(20, [{"split": "eval", "mode": "greedy", "prompt": "p", "completion": "c", "reward": 0.5}])
    out.write(30, [])
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in lines] == [(10, "train"), (10, "train"), (20, "eval")]
    assert lines[0]["completion"] == "x\n" * 200  # the file has it whole
    shown = [r.getMessage() for r in caplog.records]
    assert len(shown) == 2 and "step 10 (train, reward 1)" in shown[0] and "step 20 (greedy" in shown[1]
    assert "\n" not in shown[0] and len(shown[0]) < 600  # one console line, cut
    assert [(step, len(s)) for step, s in sink.calls] == [(10, 2), (20, 1)]


@pytest.mark.parametrize("every", [0, 2])
def test_the_trainer_puts_decoded_samples_in_every_nth_steps_metrics(every):
    import asyncio

    from asyncrl.messages import Group
    from asyncrl.roles.trainer import Trainer
    from asyncrl.telemetry.rollouts import ROLLOUTS_KEY

    class Pipeline:  # the update pipeline's result for a step: its groups and metrics
        async def train_step(self, step, prefetch=False):
            class Out:
                groups = [Group(group_id=0, min_version=step, trajectories=[_traj(0, [7], 1.0), _traj(1, [8], 0.0)])]
                metrics = {"trainer/samples": 2.0}
                gate_wait_s = 0.0
                train_s = 0.1
            return Out()

    trainer = Trainer.__new__(Trainer)
    trainer.pipeline, trainer.decode, trainer.rollouts_every = Pipeline(), lambda ids: f"<{ids[0]}>", every
    metrics = {s + 1: asyncio.run(trainer.train_step(s)) for s in range(4, 8)}  # versions 5..8 (data of 3)
    assert [v for v, m in metrics.items() if ROLLOUTS_KEY in m] == ([6, 8] if every else [])
    if every:
        assert [x["completion"] for x in metrics[6][ROLLOUTS_KEY]] == ["<7>", "<8>"]
