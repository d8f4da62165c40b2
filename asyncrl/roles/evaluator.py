"""Held-out evaluation: fixed prompts, greedy and sampled, scored with the run's reward function.

Runs inside the trainer process on the trainer's own weights (through the native engine's
`from_model`, which shares the parameters), so the reported numbers belong to an exact policy version.
This is what "the run learns" is judged on.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from asyncrl.messages import SamplingParams
from asyncrl.rewards.loader import HungCalls, call_reward_async
from engines.base import RolloutEngine

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(
        self,
        *,
        engine: RolloutEngine,
        rows: list[dict[str, Any]],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        reward_fn: Callable[..., float],
        prompt_key: str,
        max_new_tokens: int,
        temperature: float,
        seed: int = 0,
        reward_timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.rows = rows
        self.encode = encode
        self.decode = decode
        self.reward_fn = reward_fn
        self.prompt_key = prompt_key
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.reward_timeout_s = reward_timeout_s
        self.hung = HungCalls()  # reward calls past the timeout still running on their threads (bounded)

    async def evaluate(self) -> dict[str, float]:
        """Mean reward of greedy and of sampled (rollout temperature) completions on the held-out rows."""
        prompts = [self.encode(r[self.prompt_key]) for r in self.rows]
        out: dict[str, float] = {}
        for name, temp in (("greedy", 0.0), ("sampled", self.temperature)):
            params = SamplingParams(n=1, temperature=temp, max_new_tokens=self.max_new_tokens, seed=self.seed)
            groups = await self.engine.generate(prompts, params)
            rewards, errors = [], 0
            for row, group in zip(self.rows, groups):
                text = self.decode(group[0].response_ids)
                try:
                    rewards.append(await call_reward_async(self.reward_fn, str(row[self.prompt_key]), text,
                                                           row, self.reward_timeout_s, hung=self.hung))
                except Exception as exc:  # a failing or hung reward counts as 0 and is reported
                    errors += 1
                    rewards.append(0.0)
                    log.debug("eval reward failed: %s", exc)
            out[f"eval/{name}_reward"] = sum(rewards) / max(1, len(rewards))
            out[f"eval/{name}_errors"] = float(errors)
        out["eval/prompts"] = float(len(prompts))
        return out
