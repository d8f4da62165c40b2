"""Wire messages: every payload that crosses an actor boundary is one of these msgspec Structs.

Place in the dataflow: the engine returns `Completion`s to a Generator, which wraps them into
`Trajectory`s (rollout queue) → the Scorer fills rewards and assembles a `Group` (train store) →
the Trainer consumes groups. `WeightsMeta` describes the weight broadcast from the Trainer to the
generators. Structs live here (an importable module) because a Struct defined in `__main__` loses its
fields through Ray's pickling.
"""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base for all wire messages: keyword-only, unknown fields rejected on decode."""


class SamplingParams(Message):
    """How an engine samples. Training rollouts use top_p=1, top_k=-1 (truncation changes the
    distribution the behaviour logprobs describe)."""

    n: int = 1                      # samples per prompt; they share one prefill
    temperature: float = 1.0        # 0 means greedy (never trained; e.g. eval, ReMax baselines)
    top_p: float = 1.0
    top_k: int = -1                 # -1 = whole vocabulary
    max_new_tokens: int = 16
    stop_token_ids: list[int] = []  # besides the model's eos token ids
    ignore_eos: bool = False        # the model's eos does not end a response (stop_token_ids still do)
    stop: list[str] = []            # stop strings: a sequence ends once its decoded response contains one
    seed: int | None = None         # per-request seed; None = the engine's own generator

    def validate(self) -> None:
        """Raise ValueError with one clear line if a parameter is out of range."""
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain an empty string (it would stop at once)")


class Completion(Message):
    """One sampled continuation of one prompt, as an engine returns it (token ids in, token ids out)."""

    prompt_ids: list[int]           # the prompt as the engine saw it (after truncation)
    response_ids: list[int]         # sampled tokens, including a final stop/eos token if one was sampled
    logprobs: list[float]           # behaviour logprob per response token: log_softmax(logits / T)[token]
    versions: list[int]             # policy version that produced each response token
    finish_reason: str              # "stop" (eos/stop token/stop string) | "length" (hit max_new_tokens)
                                    # | "abort" (interrupted: a partial rollout to carry over)
    prompt_truncated: bool = False  # the prompt was cut to the engine's max prompt length
    kv_reused: bool = False         # KV computed under older weights was kept across an in-flight swap, so
                                    # later logprobs belong to a mixture of versions (opt-in; see engine)
    routed_experts: bytes = b""     # an MoE model's routing when the engine records it: int16, row-major
                                    # [positions, layers, top_k], the forward's input positions in order
                                    # (prompt, then each fed response token); engines/routing.py
    routing_shape: list[int] = []   # [layers, top_k] of routed_experts; [] = none recorded


class Trajectory(Message):
    """One finished sample; the rollout queue holds them as whole groups. The trainer trains on exactly these tokens."""

    seq_id: int                      # unique per run: every trajectory is trained once or accounted for
    group_id: int                    # samples of one prompt share it (group advantages, admission)
    group_size: int                  # how many samples the group holds when complete
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool]            # per response token; False on tokens the environment wrote
    behavior_logprobs: list[float]   # log_softmax(logits / T) from the engine that sampled them
    versions: list[int]              # policy version of each response token
    min_version: int                 # staleness is measured from this one
    max_version: int                 # differs from min_version only after an in-flight weight swap
    finish_reason: str               # "stop" | "length" | "error"
    truncated: bool = False          # response cut at max_new_tokens (DAPO shaping reads it)
    prompt_truncated: bool = False
    temperature: float = 1.0         # the trainer divides its logits by the same temperature
    prompt_text: str = ""            # what the reward function sees as the prompt
    response_text: str | None = None  # the response as the reward function sees it (special tokens skipped),
                                     # decoded by the generator that has the tokenizer; None: the scorer decodes
    row_json: bytes = b""            # the dataset row, JSON-encoded; user fields are schemaless, so only
                                     # the scorer decodes them (to call the reward function)
    kv_reused: bool = False          # KV computed under older weights was kept across an in-flight swap
    routed_experts: bytes = b""      # an MoE engine's routing of each position of prompt + response (the last
                                     # response token never fed: no row), int16 [positions, layers, top_k];
                                     # the trainer replays it (algorithm.routing_replay; engines/routing.py)
    routing_shape: list[int] = []    # [layers, top_k] of routed_experts; [] = none recorded
    generator_id: int = 0
    reward: float = 0.0              # filled by the scorer: the weighted sum of its reward components
    reward_components: dict[str, float] = {}  # each named component, unweighted (metrics reward/<name>); {}
                                     # for one plain reward function (asyncrl/rewards/combine.py)
    error: str = ""                  # why it failed, if finish_reason == "error"
    # -- algorithms (docs/algorithms.md) --
    ref_logprobs: list[float] = []   # reference policy's logprob per response token (KL term), filled by
                                     # the scorer when [reference] where = "scorer"; [] = not computed
    cost: float = 0.0                # Safe-RLHF cost, filled by the scorer from reward.cost_fn
    baseline_response_ids: list[int] = []  # ReMax: the greedy completion of the same prompt (generator)
    baseline_text: str | None = None       # ReMax: that completion's text (generator; None: the scorer decodes)
    baseline_reward: float | None = None   # ReMax: reward of that greedy completion (scorer; None = none)
    # -- environments (docs/envs.md) --
    env_reward: float | None = None  # an env episode's summed step rewards: the scorer uses it instead of
                                     # calling reward.fn (None = not an env episode)
    turns: int = 0                   # model turns of an env episode
    env_error: str = ""              # what the env did wrong (raised, hung, garbage), if anything; counted
    tool_calls: int = 0              # tool calls the model made in an env episode (asyncrl/envs/tool_env.py)
    tool_errors: int = 0             # of those, answered with an error (unreadable, unknown, bad arguments, ...)


class Group(Message):
    """All samples of one prompt after scoring: the unit of the train store and of admission."""

    group_id: int
    min_version: int                 # min over members; the staleness gate reads it
    trajectories: list[Trajectory]


class TensorMeta(Message, array_like=True):
    # array_like: sent once per sync setup with one entry per parameter; field order is fixed here.
    name: str
    shape: list[int]
    dtype: str                       # torch dtype name without the "torch." prefix, e.g. "float32"


class WeightsMeta(Message):
    """What a weight receiver must know to take part in the bucketed broadcast."""

    tensors: list[TensorMeta]        # in broadcast order
    buckets: list[list[int]]         # indices into `tensors`, one list per bucket, in broadcast order
    total_bytes: int
