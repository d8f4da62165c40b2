"""Weighted reward components: `RewardSet`, the `Rewards` a role holds, and the one rule that adds them up.

Place in the dataflow: a Scorer (or the Evaluator) hands `RewardSet.score` a batch of calls; every component
(base.py: a reward function in its form, the worker-process functions, the reward model) scores the whole
batch, the components concurrently; `combine` turns each call's values into its `Score`:

    total = sum over components of weight x value, where a dict value counts as the sum of its entries

and `Score.components` keeps every named value unweighted: a component's own value under its name, each
entry of a dict under its key (the component's name is then not used). A lone function has the name "" and
is not recorded apart (its value is the total). A call fails when any component failed it: the scorer then
fails its group, whatever the other components said. The trainer logs each component as `reward/<name>`
(`component_means`).
"""

from __future__ import annotations

import asyncio
import math
from typing import Iterable, Mapping, Sequence

from asyncrl.rewards.base import Call, Component, Score, Value

RESERVED_NAMES = frozenset({"mean"})  # `reward/mean` is the total


def combine(parts: Sequence[tuple[str, float, Value | Score]]) -> Score:
    """(name, weight, value) of each component of one call -> its Score. Raises ValueError when two components
    share a name, a name is reserved, or the weighted total is not finite."""
    total = 0.0
    components: dict[str, float] = {}

    def record(key: str, value: float) -> None:
        if key in RESERVED_NAMES:
            raise ValueError(f"reward component {key!r} is reserved (reward/{key} is the weighted total) — "
                             f"rename it")
        if key in components:
            raise ValueError(f"two reward components are named {key!r} — give each function (and each key of "
                             f"a dict it returns) its own name")
        components[key] = value

    for name, weight, value in parts:
        if isinstance(value, Score):  # already weighted: several functions combined elsewhere (process.py)
            total += weight * value.total
            for key, v in value.components.items():
                record(key, v)
        elif isinstance(value, dict):
            total += weight * math.fsum(value.values())
            for key, v in value.items():
                record(key, v)
        else:
            total += weight * value
            if name:
                record(name, value)
    if not math.isfinite(total):
        raise ValueError(f"the weighted reward is {total}, not finite (components {components}); check the weights")
    return Score(total=total, components=components)


class RewardSet:
    """`Rewards` (base.py) from weighted components, and an optional Safe-RLHF cost component."""

    def __init__(self, components: Sequence[Component], cost: Component | None = None) -> None:
        if not components:
            raise ValueError("a reward needs at least one component (reward.fn, [[reward.functions]] or reward.model)")
        self.components = list(components)
        self.cost = cost
        self.has_cost = cost is not None
        self._closed = False

    async def score(self, calls: Sequence[Call | tuple], *, cost: bool = False) -> list[Score | BaseException]:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.score after close()")
        if cost and self.cost is None:
            raise ValueError("score(cost=True) without a cost function (reward.cost_fn)")
        batch = [c if isinstance(c, Call) else Call(*c) for c in calls]
        if not batch:
            return []
        parts = [self.cost] if cost and self.cost is not None else self.components
        results = await asyncio.gather(*(p.values(batch) for p in parts))
        out: list[Score | BaseException] = []
        for i in range(len(batch)):
            values = [r[i] for r in results]
            failed = next((v for v in values if isinstance(v, BaseException)), None)
            if failed is not None:
                out.append(failed)
                continue
            try:
                out.append(combine([(p.name, p.weight, v) for p, v in zip(parts, values)]))  # type: ignore[misc]
            except ValueError as exc:
                out.append(exc)
        return out

    @property
    def hung_calls(self) -> int:
        return sum(p.hung_calls for p in [*self.components, *([self.cost] if self.cost is not None else [])])

    def close(self) -> None:
        self._closed = True
        for part in [*self.components, *([self.cost] if self.cost is not None else [])]:
            part.close()


def component_means(components: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """`reward/<name>`: each component's mean over the samples that carry it (Trajectory.reward_components)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for comp in components:
        for key, value in comp.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {f"reward/{key}": sums[key] / counts[key] for key in sorted(sums)}
