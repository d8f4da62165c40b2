"""Training algorithms as registered pure tensor functions: advantage estimators, policy losses, loss
aggregations, KL estimators, off-policy corrections, the critic's value loss.

Place in the dataflow: used by the Trainer's `Learner` only. Importing this package registers the
built-ins (the one intended import-time effect: filling the registries in `registry.py`).

How the named algorithms are composed from the pieces (advantage / policy_loss / loss_agg / extras):

| algorithm   | advantage               | policy_loss | loss_agg                | extras                              |
|-------------|-------------------------|-------------|-------------------------|-------------------------------------|
| PPO         | gae (+ whiten)          | ppo_clip    | token-mean              | value_loss (critic); KL in reward   |
| GRPO        | grpo                    | ppo_clip    | seq-mean-token-mean     | KL k3 as a loss term                |
| Dr. GRPO    | drgrpo                  | ppo_clip    | seq-mean-token-sum-norm | norm_len = max_new_tokens           |
| DAPO        | grpo                    | ppo_clip    | token-mean              | clip_eps_high > clip_eps_low;       |
|             |                         |             |                         | overlong_penalty; dynamic sampling  |
| GSPO        | grpo                    | gspo        | seq-mean-token-mean     | tiny clip_eps_low / clip_eps_high   |
| RLOO        | rloo                    | ppo_clip or | token-mean              |                                     |
|             |                         | vanilla_pg  |                         |                                     |
| REINFORCE++ | reinforce_pp(_baseline) | ppo_clip    | token-mean              | KL k2/k1 in reward (token_rewards)  |
| ReMax       | remax                   | vanilla_pg  | token-mean              | baselines = greedy-rollout rewards  |
| Safe-RLHF   | any, on reward and cost | ppo_clip    | token-mean              | lagrangian_advantages(A_r, A_c, λ); |
|             |                         |             |                         | LagrangeMultiplier.update(cost)     |
Any of them composes with an off-policy correction (offpolicy.py) for stale samples.
"""

from asyncrl.algorithms import advantages, diagnostics, kl, losses, offpolicy, value  # noqa: F401  (registers the built-ins)
from asyncrl.algorithms.advantages import (
    AdvantageInput,
    AdvantageOutput,
    AdvantageParams,
    LagrangeMultiplier,
    compute_drgrpo,
    compute_gae,
    compute_grpo,
    compute_reinforce_pp,
    compute_reinforce_pp_baseline,
    compute_remax,
    compute_rloo,
    grpo_advantages,
    lagrangian_advantages,
    masked_whiten,
    overlong_penalty,
)
from asyncrl.algorithms.diagnostics import approx_kl_k3, entropy_from_logits, masked_mean, masked_sum
from asyncrl.algorithms.kl import kl_estimate
from asyncrl.algorithms.losses import (
    PolicyLossParams,
    gspo_loss,
    ppo_clip_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
    vanilla_pg_loss,
)
from asyncrl.algorithms.offpolicy import CorrectionParams, offpolicy_weights
from asyncrl.algorithms.registry import (
    ADVANTAGE_NEEDS,
    ADVANTAGES,
    CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_AGGS,
    POLICY_LOSSES,
    AdvantageFn,
    AlgorithmNeeds,
    CorrectionFn,
    KLFn,
    LossAggFn,
    PolicyLossFn,
    advantage_needs,
    available_advantages,
    available_corrections,
    available_kl_estimators,
    available_loss_aggs,
    available_policy_losses,
    get_advantage,
    get_correction,
    get_kl_estimator,
    get_loss_agg,
    get_policy_loss,
    register_advantage,
    register_correction,
    register_kl,
    register_loss_agg,
    register_policy_loss,
    unregister_advantage,
)
from asyncrl.algorithms.value import value_loss

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_NEEDS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "AdvantageFn",
    "AdvantageInput",
    "AdvantageOutput",
    "AdvantageParams",
    "AlgorithmNeeds",
    "CorrectionFn",
    "CorrectionParams",
    "KLFn",
    "LagrangeMultiplier",
    "LossAggFn",
    "PolicyLossFn",
    "PolicyLossParams",
    "advantage_needs",
    "approx_kl_k3",
    "available_advantages",
    "available_corrections",
    "available_kl_estimators",
    "available_loss_aggs",
    "available_policy_losses",
    "compute_drgrpo",
    "compute_gae",
    "compute_grpo",
    "compute_reinforce_pp",
    "compute_reinforce_pp_baseline",
    "compute_remax",
    "compute_rloo",
    "entropy_from_logits",
    "get_advantage",
    "get_correction",
    "get_kl_estimator",
    "get_loss_agg",
    "get_policy_loss",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "lagrangian_advantages",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "offpolicy_weights",
    "overlong_penalty",
    "ppo_clip_loss",
    "register_advantage",
    "register_correction",
    "register_kl",
    "register_loss_agg",
    "register_policy_loss",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
    "unregister_advantage",
    "value_loss",
    "vanilla_pg_loss",
]
