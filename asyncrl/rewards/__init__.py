"""Rewards: verifiers that score a completion, called by the Scorers (and the held-out Evaluator).

A reward function is called as `fn(prompt, completion, **fields) -> float`, where `fields` are the dataset
row's other fields. `reward.fn` names a built-in rule (`rules.py`: exact_match, prefix_match, contains) or
a user function 'pkg.module:function' (`loader.py` checks its signature). `reward.cost_fn` (Safe-RLHF)
is resolved the same way; `longer_than_answer` is a built-in cost rule.
"""

from asyncrl.rewards.loader import call_reward, check_reward, resolve_cost, resolve_reward
from asyncrl.rewards.rules import RULES, RewardFn

__all__ = ["RULES", "RewardFn", "call_reward", "check_reward", "resolve_cost", "resolve_reward"]
