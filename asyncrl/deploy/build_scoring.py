"""The builders of the buffer and the scorers: the roles of the buffer's process, which needs no torch (a reward
that is a plain function, trajectories decoded by their generator); and of the reference policy a scorer or the
trainer may hold (torch imported where it is built). `asyncrl.deploy.build` builds the others and
re-exports these, so every builder is found there; the buffer's actor imports this module alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl.config.schema import Config, RewardConfig
from asyncrl.deploy.auto import scorers_in_buffer
from asyncrl.deploy.placement import role_device
from asyncrl.rewards.base import Rewards
from asyncrl.rewards.setup import rewards_from_config
from asyncrl.roles.decoding import decode_many
from asyncrl.roles.scorer import Scorer
from buffers.replay import ReplayBuffer
from engines.hf import load_tokenizer

if TYPE_CHECKING:
    from asyncrl.training.reference import ReferencePolicy


def tokenizer_fns(model_path: str) -> tuple[Any, Any]:
    """The tokenizer and its decode (responses, special tokens skipped). Prompts are encoded by
    `asyncrl.data.prompts.PromptEncoder`."""
    tok = load_tokenizer(model_path)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    # Many at once (`decode.many`, the scorer's batch): the Rust tokenizer's own batch decode where the result is
    # the same as `decode`'s (a fast tokenizer without the clean-up pass), else one `decode` each.
    backend = getattr(tok, "_tokenizer", None)
    if hasattr(backend, "decode_batch") and not getattr(tok, "clean_up_tokenization_spaces", True):
        decode.many = lambda seqs: backend.decode_batch(seqs, skip_special_tokens=True)  # type: ignore[attr-defined]
    return tok, decode


class LazyDecode:
    """`tokenizer_fns`' decode with the tokenizer loaded at the first call. A scorer's trajectories arrive decoded
    by the generator (Trajectory.response_text), so a scorer (and the buffer's process that hosts it) usually never
    loads a tokenizer, nor imports transformers (seconds of each run's start); it decodes what arrives without
    text: env episodes, trajectories recorded by the OpenAI endpoint or submitted to asyncrl.Runtime."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._decode: Any = None

    def _loaded(self) -> Any:
        if self._decode is None:
            self._decode = tokenizer_fns(self.model_path)[1]
        return self._decode

    def __call__(self, ids: list[int]) -> str:
        return self._loaded()(ids)

    def many(self, seqs: list[list[int]]) -> list[str]:
        return decode_many(self._loaded(), seqs)



def build_buffer(cfg: Config) -> ReplayBuffer:
    return ReplayBuffer(prompts_per_step=cfg.trainer.prompts_per_step, group_size=cfg.rollout.group_size,
                     max_staleness=cfg.staleness.max_staleness, rollout_capacity=cfg.buffer.rollout_capacity,
                     train_capacity=cfg.buffer.train_capacity,
                     report_filtered=cfg.algorithm.dynamic_sampling or cfg.algorithm.filter_zero_variance,
                     generators=cfg.rollout.num_generators)


def build_rewards(cfg: RewardConfig, *, with_cost: bool = True, device: str = "cpu") -> Rewards:
    """The reward (and, `with_cost`, Safe-RLHF cost) as a role calls it: its weighted functions on threads of
    this process or in worker processes (`reward.isolation`), and the reward model on `device`
    (asyncrl/rewards/setup.py)."""
    return rewards_from_config(cfg, with_cost=with_cost, device=device)


def build_scorer(cfg: Config, scorer_id: int, buffer: Any) -> Scorer:
    decode = LazyDecode(cfg.model.path)
    reference = None
    device = "cpu" if scorers_in_buffer(cfg) else role_device(cfg, "scorer")
    if cfg.algorithm.kl_mode != "off" and cfg.reference.where == "scorer":
        reference = build_reference(cfg, device)
    return Scorer(scorer_id=scorer_id, buffer=buffer, rewards=build_rewards(cfg.reward, device=device),
                  decode=decode,
                  reference=reference,
                  filter_zero_variance=cfg.algorithm.filter_zero_variance or cfg.algorithm.dynamic_sampling)


def build_reference(cfg: Config, device: str = "cpu") -> ReferencePolicy:
    """The frozen reference policy of the KL term ([reference] path, default model.path), on `device` (the
    hosting role's: the trainer's, or the scorer's with reference.where = "scorer")."""
    from asyncrl.training.reference import ReferencePolicy  # torch: only a process that holds the reference

    tok = load_tokenizer(cfg.model.path)
    return ReferencePolicy.load(cfg.reference.path or cfg.model.path, dtype=cfg.model.dtype,
                                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                                micro_batch_size=cfg.trainer.micro_batch_size, device=device,
                                mixed_precision=cfg.trainer.mixed_precision,
                                max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
                                logprob_chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                                lm_head_fp32=cfg.trainer.lm_head_fp32,
                                routing_replay=cfg.algorithm.routing_replay)
