"""Held-out evaluation: fixed prompts, greedy and sampled, scored with the run's reward function.

Prompts are encoded exactly as the generators encode them (`asyncrl.data.prompts.PromptEncoder`). Runs inside
the trainer process on the trainer's own weights (through the native engine's
`from_model`, which shares the parameters), so the reported numbers belong to an exact policy version.
This is what "the run learns" is judged on.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from asyncrl.data.prompts import Prompt
from asyncrl.messages import SamplingParams
from asyncrl.rewards.base import Call, Rewards
from asyncrl.telemetry.rollouts import EVAL_SAMPLES_KEY
from engines.base import RolloutEngine

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(
        self,
        *,
        engine: RolloutEngine,
        rows: list[dict[str, Any]],
        encode: Callable[[dict[str, Any]], Prompt],
        decode: Callable[[list[int]], str],
        rewards: Rewards,
        max_new_tokens: int,
        temperature: float,
        seed: int = 0,
        samples: bool = False,
    ) -> None:
        self.samples = samples  # return the completions with the metrics (rollouts.jsonl)
        self.engine = engine
        self.rows = rows
        self.encode = encode  # row -> its Prompt (asyncrl.data.prompts.PromptEncoder.encode), as the generators do
        self.decode = decode
        self.rewards = rewards  # the run's reward function, as the scorers call it (reward.isolation)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed

    async def evaluate(self) -> dict[str, Any]:
        """Mean reward of greedy and of sampled (rollout temperature) completions on the held-out rows; with
        `samples`, the completions too (under EVAL_SAMPLES_KEY: the Controller writes them to rollouts.jsonl)."""
        prompts = [self.encode(r) for r in self.rows]
        out: dict[str, Any] = {}
        samples: list[dict[str, Any]] = []
        for name, temp in (("greedy", 0.0), ("sampled", self.temperature)):
            params = SamplingParams(n=1, temperature=temp, max_new_tokens=self.max_new_tokens, seed=self.seed)
            groups = await self.engine.generate([p.ids for p in prompts], params)
            calls = [Call(prompt.text, self.decode(group[0].response_ids), row, group[0].finish_reason,
                          len(group[0].response_ids)) for row, prompt, group in zip(self.rows, prompts, groups)]
            results = await self.rewards.score(calls)
            rewards, errors = [], 0
            for call, result in zip(calls, results):
                if isinstance(result, BaseException):  # a failing or hung reward counts as 0 and is reported
                    errors += 1
                    rewards.append(0.0)
                    log.debug("eval reward failed: %s", result)
                else:
                    rewards.append(result.total)
                if self.samples:
                    samples.append({"split": "eval", "mode": name, "prompt": call.prompt, "completion": call.completion,
                                    "reward": rewards[-1], "components": {} if isinstance(result, BaseException)
                                    else dict(result.components), "finish_reason": call.finish_reason,
                                    "completion_tokens": call.completion_tokens})
            out[f"eval/{name}_reward"] = sum(rewards) / max(1, len(rewards))
            out[f"eval/{name}_errors"] = float(errors)
        out["eval/prompts"] = float(len(prompts))
        if self.samples:
            out[EVAL_SAMPLES_KEY] = samples
        return out
