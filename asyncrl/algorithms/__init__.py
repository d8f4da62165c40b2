"""Training algorithms as registered pure tensor functions (advantages, policy losses, aggregations).

Place in the dataflow: used by the Trainer's `Learner` only. Importing this package registers the
built-ins (the one intended import-time effect: filling the registries in `registry.py`).
"""

from asyncrl.algorithms import advantages, diagnostics, losses  # noqa: F401  (registers the built-ins)
from asyncrl.algorithms.advantages import grpo_advantages
from asyncrl.algorithms.diagnostics import approx_kl_k3, entropy_from_logits, masked_mean, masked_sum
from asyncrl.algorithms.losses import ppo_clip_loss, token_mean
from asyncrl.algorithms.registry import (
    ADVANTAGES,
    LOSS_AGGS,
    POLICY_LOSSES,
    AdvantageFn,
    LossAggFn,
    PolicyLossFn,
    available_advantages,
    available_loss_aggs,
    available_policy_losses,
    get_advantage,
    get_loss_agg,
    get_policy_loss,
    register_advantage,
    register_loss_agg,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGES",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "AdvantageFn",
    "LossAggFn",
    "PolicyLossFn",
    "approx_kl_k3",
    "available_advantages",
    "available_loss_aggs",
    "available_policy_losses",
    "entropy_from_logits",
    "get_advantage",
    "get_loss_agg",
    "get_policy_loss",
    "grpo_advantages",
    "masked_mean",
    "masked_sum",
    "ppo_clip_loss",
    "register_advantage",
    "register_loss_agg",
    "register_policy_loss",
    "token_mean",
]
