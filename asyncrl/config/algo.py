"""The reward and algorithm sections of the run's TOML schema (`[reward]`, `[[reward.functions]]`,
`[algorithm]`); `asyncrl.config.schema` holds the rest and re-exports these."""

from __future__ import annotations

from typing import Annotated, Literal

from asyncrl.config.section import Section, _d


class RewardFunctionConfig(Section):
    """One weighted reward function: `[[reward.functions]]` (docs/rewards.md)."""

    fn: Annotated[
        str,
        _d("built-in rule name (e.g. 'gsm8k', 'boxed', 'math_verify', 'exact_match') or 'pkg.module:function'",
           min_length=1),
    ]
    name: Annotated[
        str,
        _d("component name, logged as reward/<name>; empty = the rule's or the function's name"),
    ] = ""
    weight: Annotated[float, _d("its weight in the total reward: sum of weight x value over the functions")] = 1.0


class RewardConfig(Section):
    """How a completion is scored: the reward function(s), a reward model, the cost of Safe-RLHF, the scorers."""

    fn: Annotated[
        str,
        _d("the reward function: a built-in rule name (exact_match, prefix_match, contains, gsm8k, boxed, "
           "math_verify) or 'pkg.module:function' (per-sample, batched or async: docs/rewards.md); empty = "
           "exact_match, unless [[reward.functions]] or reward.model give the reward"),
    ] = ""
    functions: Annotated[
        list[RewardFunctionConfig],
        _d("several weighted reward functions instead of reward.fn: [[reward.functions]] tables with fn, name, "
           "weight; the reward is the weighted sum, each component logged as reward/<name>"),
    ] = []
    answer_key: Annotated[
        str,
        _d("row field holding the reference answer for built-in rules; a dotted path reaches a nested field "
           "(e.g. 'reward_model.ground_truth')", min_length=1),
    ] = "answer"
    timeout_s: Annotated[
        float,
        _d("a reward call that takes longer fails its group (a batched function: its one call for the batch)", gt=0),
    ] = 30.0
    max_concurrency: Annotated[
        int,
        _d("async reward functions: calls of one function in flight at once on a scorer's event loop", ge=1),
    ] = 32
    isolation: Annotated[
        Literal["thread", "process"],
        _d("where reward (and cost) calls run: thread = worker threads (async functions: the event loop) of the "
           "scorer's process (a call past timeout_s is abandoned, not stopped); process = per-sample functions only, "
           "in a pool of `workers` processes per scorer (and one in "
           "the trainer for evaluation): a call past timeout_s kills its worker, a worker that crashes fails only "
           "its call, a fresh one replaces it. Isolates memory, crashes and the interpreter lock, not the "
           "filesystem or the network"),
    ] = "thread"
    workers: Annotated[
        int,
        _d("reward.isolation = 'process': worker processes per scorer; a batch's calls run in parallel across them",
           ge=1),
    ] = 2
    max_memory_mb: Annotated[
        int,
        _d("reward.isolation = 'process': address-space limit (RLIMIT_AS) of each worker in MiB, imports included "
           "(a worker that imports torch needs several GiB); a call that exceeds it fails and its worker is "
           "replaced; 0 = no limit", ge=0),
    ] = 0
    num_scorers: Annotated[int, _d("scorer actors", ge=1)] = 1
    cost_fn: Annotated[
        str,
        _d("Safe-RLHF cost: a built-in cost rule (e.g. 'digit_cost') or 'pkg.module:function' with the reward fn's "
           "calling convention; empty = no cost signal"),
    ] = ""
    cost_threshold: Annotated[
        float,
        _d("Safe-RLHF: the mean cost per sample the policy should stay under (the multiplier grows while the measured "
           "cost exceeds it)"),
    ] = 0.0
    lagrange_init: Annotated[float, _d("Safe-RLHF: initial Lagrange multiplier lambda", ge=0)] = 0.0
    lagrange_lr: Annotated[
        float,
        _d("Safe-RLHF: step size of the multiplier update lambda += lr * (mean_cost - cost_threshold), "
           "clamped at 0", ge=0),
    ] = 0.05
    lagrange_max: Annotated[float, _d("Safe-RLHF: upper bound of the multiplier; 0 = unbounded", ge=0)] = 0.0
    model: Annotated[
        str,
        _d("a learned reward model: a local AutoModelForSequenceClassification folder with num_labels = 1; its "
           "logit on prompt + completion is the component 'reward_model' (beside reward.fn or the functions); "
           "empty = none"),
    ] = ""
    model_weight: Annotated[float, _d("reward.model: its weight in the total reward")] = 1.0
    model_batch_size: Annotated[int, _d("reward.model: texts per forward pass", ge=1)] = 8
    model_max_len: Annotated[
        int,
        _d("reward.model: tokens it reads per text; longer texts lose their beginning", ge=8),
    ] = 1024
    model_transform: Annotated[
        Literal["none", "sigmoid"],
        _d("reward.model: the raw logit (none) or sigmoid(logit), a value in (0, 1)"),
    ] = "none"
    model_chat_template: Annotated[
        bool,
        _d("reward.model: render (prompt, completion) as a user and an assistant message with the model's chat "
           "template instead of concatenating them"),
    ] = False
    model_dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        _d("reward.model: parameter dtype"),
    ] = "float32"


class AlgorithmConfig(Section):
    """What the trainer optimises. See docs/algorithms.md for one section per algorithm."""

    advantage: Annotated[
        str,
        _d("advantage estimator: grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, "
           "remax (greedy-rollout baseline, sampled by the generator), gae (PPO with a [critic])", min_length=1),
    ] = "grpo"
    policy_loss: Annotated[
        str,
        _d("policy loss: ppo_clip (token ratio), gspo (sequence-level ratio), vanilla_pg", min_length=1),
    ] = "ppo_clip"
    loss_agg: Annotated[
        str,
        _d("loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm (sum / "
           "rollout.max_new_tokens, Dr.GRPO)", min_length=1),
    ] = "token-mean"
    clip_eps: Annotated[
        float,
        _d("PPO clip range epsilon; the default of clip_eps_low and clip_eps_high", gt=0, lt=1),
    ] = 0.2
    clip_eps_low: Annotated[
        float,
        _d("lower clip range: ratio >= 1 - clip_eps_low; 0 = use clip_eps", ge=0, lt=1),
    ] = 0.0
    clip_eps_high: Annotated[
        float,
        _d("upper clip range: ratio <= 1 + clip_eps_high (DAPO clip-higher, e.g. 0.28); 0 = use clip_eps", ge=0),
    ] = 0.0
    dual_clip: Annotated[
        float,
        _d("dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c*A; 0 = off", ge=0),
    ] = 0.0
    gamma: Annotated[float, _d("discount of GAE and of token-level returns (REINFORCE++)", ge=0, le=1)] = 1.0
    lam: Annotated[float, _d("GAE lambda", ge=0, le=1)] = 0.95
    adv_eps: Annotated[float, _d("epsilon added to standard deviations when normalising advantages", gt=0)] = 1e-6
    whiten_advantages: Annotated[
        bool,
        _d("whiten advantages over the step's loss tokens (mean 0, std 1) where the estimator supports it (gae)"),
    ] = True
    reward_norm: Annotated[
        Literal["none", "whiten", "scale"],
        _d("normalise the step's rewards before the estimator: whiten = (r - mean) / std, scale = r / std, none"),
    ] = "none"
    reward_clip: Annotated[
        float,
        _d("clip rewards (after shaping and normalisation) to [-reward_clip, reward_clip]; 0 = off", ge=0),
    ] = 0.0
    entropy_coef: Annotated[
        float,
        _d("entropy bonus: loss -= entropy_coef * entropy per token (same aggregation); 0 = off", ge=0),
    ] = 0.0
    kl_mode: Annotated[
        Literal["off", "reward", "loss"],
        _d("KL to the [reference] policy: 'reward' subtracts kl_coef*KL from the token rewards, "
           "'loss' adds kl_coef*KL per token to the loss, 'off'"),
    ] = "off"
    kl_coef: Annotated[float, _d("weight of the KL to the reference policy", ge=0)] = 0.001
    kl_estimator: Annotated[
        Literal["k1", "k2", "k3"],
        _d("KL estimator: k1 = log(pi/ref), k2 = 0.5*log(pi/ref)^2, k3 = ref/pi - 1 - log(ref/pi) (low variance, "
           "never negative)"),
    ] = "k3"
    correction: Annotated[
        Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask"],
        _d("off-policy correction of stale samples: truncated importance sampling (token or sequence level, "
           "weights capped at correction_cap) or masking of tokens/sequences whose ratio leaves [correction_low, "
           "correction_high]"),
    ] = "none"
    correction_cap: Annotated[float, _d("cap of the truncated IS weights (token_tis, seq_tis)", gt=0)] = 2.0
    correction_low: Annotated[float, _d("lowest ratio kept by token_mask / seq_mask, in [0, 1]", ge=0, le=1)] = 0.5
    correction_high: Annotated[float, _d("highest ratio kept by token_mask / seq_mask, >= 1", ge=1)] = 2.0
    decoupled: Annotated[
        bool,
        _d("decoupled PPO: the ratio is taken against the proximal policy (the trainer's weights at the start of the "
           "step, logprobs recomputed without grad), and the correction weight is proximal / behaviour"),
    ] = False
    filter_zero_variance: Annotated[
        bool,
        _d("drop groups whose rewards are all equal (their slots are returned)"),
    ] = False
    dynamic_sampling: Annotated[
        bool,
        _d("DAPO dynamic sampling: drop groups whose rewards have zero variance and refill the step with fresh prompts "
           "(implies filter_zero_variance)"),
    ] = False
    overlong_buffer: Annotated[
        int,
        _d("DAPO overlong shaping: responses longer than rollout.max_new_tokens - overlong_buffer are penalised "
           "linearly, up to overlong_penalty at the limit; 0 = off", ge=0),
    ] = 0
    overlong_penalty: Annotated[float, _d("DAPO overlong shaping: the penalty at rollout.max_new_tokens", ge=0)] = 1.0
    safe_rlhf: Annotated[
        bool,
        _d("Safe-RLHF: optimise the reward advantage minus lambda times the cost advantage (reward.cost_fn), "
           "lambda updated from the measured cost against reward.cost_threshold"),
    ] = False
    routing_replay: Annotated[
        Literal["off", "measure", "rollout"],
        _d("mixture-of-experts policies: 'rollout' = the engine records the experts each token was routed to and "
           "the trainer's forwards use them (rollout routing replay); 'measure' = recorded and compared with the "
           "trainer's own routing (routing/agreement), not replayed; 'off' = neither (docs/algorithms.md)"),
    ] = "off"
