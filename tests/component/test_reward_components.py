"""Weighted reward components through the Scorer: each trajectory gets the weighted total as its reward and
the named components beside it; the reward functions see the sample's finish reason and token count; with
`reward.isolation = "process"` the weighted functions share one worker pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from asyncrl.config.schema import RewardConfig, RewardFunctionConfig
from asyncrl.messages import Trajectory
from asyncrl.rewards.base import Score
from asyncrl.rewards.combine import RewardSet
from asyncrl.rewards.loader import FunctionComponent, resolve_reward
from asyncrl.rewards.setup import rewards_from_config
from asyncrl.roles.scorer import Scorer
from tests.component import score_fakes
from tests.component.score_fakes import FakeBuffer

FIX = "asyncrl_unit_fixtures"


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "unit" / "data"))


def traj(group_id: int, j: int, text: str, finish_reason: str = "stop") -> Trajectory:
    return score_fakes.traj(group_id, j, text, finish_reason, answer='ab')


def test_the_scorer_fills_the_weighted_reward_and_its_components_from_what_each_sample_was():
    rewards = RewardSet([
        FunctionComponent(resolve_reward("prefix_match", "answer"), name="correct", weight=2.0),
        FunctionComponent(resolve_reward(f"{FIX}:reward_sees_extras", "answer"), name="tokens", weight=0.5),
    ])
    batch = [traj(0, 0, "ab"), traj(0, 1, "abcd", "length")]
    buffer = FakeBuffer([batch])
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=rewards, decode=lambda ids: "".join(map(chr, ids)))
    asyncio.run(scorer.score_batch(buffer.batches.pop(0)))
    [group] = buffer.accepted
    first, cut = group.trajectories
    assert first.reward_components == {"correct": 1.0, "tokens": 2.0} and first.reward == 2.0 * 1 + 0.5 * 2
    assert cut.reward_components == {"correct": 1.0, "tokens": -1.0} and cut.reward == 2.0 - 0.5
    # the components travel with the trajectory: on the wire, and through the buffer's checkpoint state
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cut), type=Trajectory) == cut
    assert msgspec.convert(msgspec.to_builtins(cut), Trajectory) == cut


def test_a_lone_reward_function_leaves_the_components_empty():
    buffer = FakeBuffer([])
    scorer = Scorer(scorer_id=0, buffer=buffer, rewards=rewards_from_config(RewardConfig(fn="prefix_match")),
                    decode=lambda ids: "".join(map(chr, ids)))
    asyncio.run(scorer.score_batch([traj(0, 0, "ab"), traj(0, 1, "b")]))
    assert [(t.reward, t.reward_components) for t in buffer.accepted[0].trajectories] == [(1.0, {}), (0.0, {})]


def test_process_isolation_runs_the_weighted_functions_in_one_pool():
    cfg = RewardConfig(functions=[RewardFunctionConfig(fn="prefix_match", weight=2.0),
                                  RewardFunctionConfig(fn=f"{FIX}:reward_parts", name="parts")],
                       isolation="process", workers=1)
    rewards = rewards_from_config(cfg)
    try:
        out = asyncio.run(rewards.score([("q", "a", {"answer": "a"}), ("q", "xyz", {"answer": "a"})]))
    finally:
        rewards.close()
    assert out == [Score(total=4.0, components={"prefix_match": 1.0, "correct": 1.0, "short": 1.0}),
                   Score(total=0.0, components={"prefix_match": 0.0, "correct": 0.0, "short": 0.0})]
