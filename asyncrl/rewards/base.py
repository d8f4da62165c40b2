"""How a role calls the run's reward function (and Safe-RLHF cost function): the `Rewards` protocol.

Place in the dataflow: building a run makes one `Rewards` per Scorer, and one for the trainer's Evaluator
(`build_rewards` in asyncrl/build.py, from `reward.isolation`); the role hands it batches of
(prompt, completion, row) and gets back, per call, its value or the exception that failed it.

| `reward.isolation` | class                         | a call past `timeout_s`         | a crash, a leak, the GIL held |
|--------------------|-------------------------------|---------------------------------|-------------------------------|
| "thread"           | `ThreadRewards` (loader.py)   | abandoned on its daemon thread  | strike the role's own process |
| "process"          | `ProcessRewards` (process.py) | its worker is killed, replaced  | fail the worker's calls only  |

Either way a failed call is an exception in the result list (asyncio.TimeoutError for one that ran past
`timeout_s`), never raised: the roles count and contain them.
"""

from __future__ import annotations

from typing import Any, Protocol

Call = tuple[str, str, dict[str, Any]]  # (prompt, completion, dataset row)


class Rewards(Protocol):
    has_cost: bool  # a Safe-RLHF cost function is configured: `score(..., cost=True)` calls it

    async def score(self, calls: list[Call], *, cost: bool = False) -> list[float | BaseException]:
        """The reward (with `cost`: the cost) of each call, in order: its value or what failed it. One batch
        at a time per instance."""
        ...

    def close(self) -> None:
        """Stop whatever runs the calls (idempotent); a later `score` is an error."""
        ...
