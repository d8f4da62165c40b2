"""Name → function registries of the training algorithms (advantages, policy losses, loss aggregations).

Place in the dataflow: the Trainer's `Learner` (asyncrl/roles/learner.py) looks up the functions a config
names (`[algorithm] advantage / policy_loss / loss_agg`) here once, at construction, so that an unknown name
fails before the first step with a KeyError listing the known ones. Adding an algorithm is one decorated
pure function in advantages.py / losses.py; nothing dispatches on strings with if/elif.

The Protocols below are the calling conventions every registered function shares, so a new estimator
or aggregation is a drop-in replacement.
"""

from __future__ import annotations

from typing import Callable, Protocol

from torch import Tensor

from asyncrl.registry import Registry


class AdvantageFn(Protocol):
    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """rewards [N] float, group_ids [N] int64 -> advantages [N] (one per sample)."""
        ...


class PolicyLossFn(Protocol):
    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """[B, T] each (mask bool) -> (per-token loss [B, T], exactly 0 where ~mask; scalar stats)."""
        ...


class LossAggFn(Protocol):
    def __call__(
        self, loss_tok: Tensor, mask: Tensor, *, global_tokens: int, global_seqs: int | None = None
    ) -> Tensor:
        """loss_tok [B, T], mask [B, T] -> scalar. `global_tokens` / `global_seqs` count the loss tokens /
        sequences of the whole optimizer step (all micro-batches), so that summing the micro-batch
        results gives the loss of the full batch."""
        ...


ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
LOSS_AGGS: Registry[LossAggFn] = Registry("loss aggregation")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    return ADVANTAGES.register(name)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    return POLICY_LOSSES.register(name)


def register_loss_agg(name: str) -> Callable[[LossAggFn], LossAggFn]:
    return LOSS_AGGS.register(name)


def get_advantage(name: str) -> AdvantageFn:
    """Raises KeyError naming the known estimators."""
    return ADVANTAGES.get(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """Raises KeyError naming the known policy losses."""
    return POLICY_LOSSES.get(name)


def get_loss_agg(name: str) -> LossAggFn:
    """Raises KeyError naming the known aggregations."""
    return LOSS_AGGS.get(name)


def available_advantages() -> list[str]:
    return ADVANTAGES.names()


def available_policy_losses() -> list[str]:
    return POLICY_LOSSES.names()


def available_loss_aggs() -> list[str]:
    return LOSS_AGGS.names()
