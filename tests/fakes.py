"""Small stand-ins the unit and component tests share (not library code: the runtime never builds them)."""

from __future__ import annotations

from asyncrl.rewards.combine import RewardSet
from asyncrl.rewards.loader import FunctionComponent
from asyncrl.rewards.rules import RewardFn


class ThreadRewards(RewardSet):
    """One reward function (and a Safe-RLHF cost function) as `Rewards`, run in this process: what
    `reward.fn` with `reward.isolation = "thread"` builds, without a config."""

    def __init__(self, reward_fn: RewardFn, cost_fn: RewardFn | None = None, *, timeout_s: float = 30.0,
                 max_concurrency: int = 32) -> None:
        def part(fn: RewardFn) -> FunctionComponent:
            return FunctionComponent(fn, timeout_s=timeout_s, max_concurrency=max_concurrency)

        super().__init__([part(reward_fn)], part(cost_fn) if cost_fn is not None else None)
