"""How a role calls the run's reward (and Safe-RLHF cost): the `Rewards` protocol and what crosses it.

Place in the dataflow: building a run makes one `Rewards` per Scorer, and one for the trainer's Evaluator
(`build_rewards` in asyncrl/deploy/build.py, from the [reward] section: asyncrl/rewards/setup.py); the role hands it
batches of `Call`s and gets back, per call, its `Score` or the exception that failed it.

A `Rewards` is a `RewardSet` (combine.py) of weighted, named *components*, each a `Component`:

| component                       | runs                                                 | a call past `timeout_s`  |
|---------------------------------|------------------------------------------------------|--------------------------|
| `FunctionComponent` (loader.py) | one reward function in its form: per sample on a     | abandoned on its daemon  |
|                                 | daemon thread, batched, or `async def` on the loop   | thread (async: cancelled)|
| `PoolFunctions` (process.py)    | the per-sample functions in worker processes         | its worker is killed and |
|                                 | (`reward.isolation = "process"`)                     | replaced                 |
| `RewardModel` (model.py)        | a sequence classifier, batched forwards on a thread  | (not bounded)            |

A failed call is an exception in the result list (asyncio.TimeoutError for one that ran past `timeout_s`),
never raised: the roles count and contain them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import msgspec


class Call(NamedTuple):
    """One sample to score. A plain `(prompt, completion, row)` tuple is a Call whose extras are unknown."""

    prompt: str
    completion: str
    row: dict[str, Any]                 # the dataset row: its fields go to the function as keyword arguments
    finish_reason: str | None = None    # "stop" | "length" (cut at max_new_tokens); None = unknown (ReMax's
                                        # greedy baseline): then not passed to the function
    completion_tokens: int | None = None  # tokens of the completion; None = unknown: not passed


Value = float | dict[str, float]
"""What a reward function gives for one sample: a number, or named components (their sum, weighted)."""


class Score(msgspec.Struct, frozen=True):
    """The reward (or cost) of one call."""

    total: float                         # sum over components of weight x value: the trajectory's reward
    components: dict[str, float] = {}    # each named component, unweighted; {} for one plain function


class FunctionSpec(NamedTuple):
    """One reward function of a run, as the config names it."""

    name: str      # its component name (metrics `reward/<name>`); "" = a lone function, not recorded apart
    fn: str        # a built-in rule name or 'pkg.module:function'
    weight: float = 1.0
    path: str = "reward.fn"  # the TOML key that holds `fn`: error lines name it


class Component(Protocol):
    """A part of the reward, e.g. one function or the reward model; `RewardSet` weighs and adds them up."""

    name: str       # "" = unnamed: a number it returns is not recorded as a component
    weight: float
    hung_calls: int  # calls past the timeout still running where they cannot be stopped (threads); bounded

    async def values(self, calls: list[Call]) -> list[Value | Score | BaseException]:
        """Per call, in order: its value (a `Score` when the component already combined several weighted
        functions), or the exception that failed it. Never raises for a failing call."""
        ...

    def close(self) -> None:
        """Stop whatever runs its calls (idempotent)."""
        ...


class Rewards(Protocol):
    has_cost: bool  # a Safe-RLHF cost function is configured: `score(..., cost=True)` calls it
    hung_calls: int  # its components' calls past the timeout still running on threads (metric, bounded)

    async def score(self, calls: Sequence[Call | tuple], *, cost: bool = False) -> list[Score | BaseException]:
        """The reward (with `cost`: the cost) of each call, in order: its Score or what failed it. One batch
        at a time per instance."""
        ...

    def close(self) -> None:
        """Stop whatever runs the calls (idempotent); a later `score` is an error."""
        ...
