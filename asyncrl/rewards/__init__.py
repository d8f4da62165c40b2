"""Rewards: verifiers, user reward functions and a learned reward model that score a completion, called by
the Scorers (and the held-out Evaluator).

A reward function is called as `fn(prompt, completion, **fields) -> float | dict` (per sample), or, batched,
as `fn(prompts=[...], completions=[...], **columns) -> list` (marked with `@batched`, or TRL's convention of
a `completions` parameter), either of them possibly `async def`; `fields` are the dataset row's other fields
and the sample's `finish_reason` and `completion_tokens` (loader.py). `reward.fn` names a built-in rule
(`rules.py`: exact_match, prefix_match, contains; `verifiers.py`: gsm8k, boxed, math_verify) or a user function
'pkg.module:function'; `[[reward.functions]]` weighs several of them, `reward.model` adds a learned reward
model (model.py); the total is their weighted sum (combine.py). `reward.cost_fn` (Safe-RLHF) is resolved the
same way; `longer_than_answer` is a built-in cost rule. docs/rewards.md has the whole story.
"""

from asyncrl.rewards.base import Call, Rewards, Score
from asyncrl.rewards.loader import batched, call_reward, check_reward, resolve_cost, resolve_reward
from asyncrl.rewards.rules import RULES, RewardFn

__all__ = ["RULES", "Call", "RewardFn", "Rewards", "Score", "batched", "call_reward", "check_reward",
           "resolve_cost", "resolve_reward"]
