"""Name → function registries of the training algorithms (advantages, policy losses, loss aggregations,
KL estimators, off-policy corrections).

Place in the dataflow: the Trainer's `Learner` (asyncrl/training/learner.py) looks up the functions a config
names (`[algorithm] advantage / policy_loss / loss_agg / kl ...`) here once, at construction, so that an
unknown name fails before the first step with a KeyError listing the known ones. Adding an algorithm is one
decorated pure function in advantages.py / losses.py / kl.py / offpolicy.py; nothing dispatches on strings
with if/elif.

An advantage estimator also declares what it needs from the rest of the run (`AlgorithmNeeds`: a critic, a
greedy baseline, groups of at least n samples). Config validation (asyncrl/config/loader.py), the builders
(asyncrl/deploy/build.py: critic, generator's greedy completion), the Learner and the embedding API
(asyncrl/runtime.py) ask `advantage_needs(name)` instead of comparing estimator names:

    @register_advantage("gae", needs=AlgorithmNeeds(critic=True))
    def compute_gae(inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput: ...

The Protocols below are the calling conventions every registered function shares, so a new estimator,
loss or aggregation is a drop-in replacement. Their parameter/input types live beside the functions
(advantages.py: AdvantageInput/Output/Params, losses.py: PolicyLossParams, offpolicy.py: CorrectionParams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from torch import Tensor

from asyncrl.registry import Registry

if TYPE_CHECKING:  # only for annotations: these modules import this one to register their functions
    from asyncrl.algorithms.advantages import AdvantageInput, AdvantageOutput, AdvantageParams
    from asyncrl.algorithms.losses import PolicyLossParams
    from asyncrl.algorithms.offpolicy import CorrectionParams


class AdvantageFn(Protocol):
    def __call__(self, inp: AdvantageInput, params: AdvantageParams) -> AdvantageOutput:
        """Sequence rewards, group ids, loss mask [B, T] (+ values / token rewards / baselines) ->
        advantages [B, T] float32, exactly 0 where ~mask (+ value targets for critic-based estimators)."""
        ...


class PolicyLossFn(Protocol):
    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, params: PolicyLossParams
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """[B, T] each (mask bool) -> (per-token loss [B, T], exactly 0 where ~mask; detached scalar stats)."""
        ...


class LossAggFn(Protocol):
    def __call__(
        self,
        loss_tok: Tensor,
        mask: Tensor,
        *,
        global_tokens: int,
        global_seqs: int | None = None,
        norm_len: int | None = None,
    ) -> Tensor:
        """loss_tok [B, T], mask [B, T] -> scalar. `global_tokens` / `global_seqs` count the loss tokens /
        sequences of the whole optimizer step (all micro-batches), so that summing the micro-batch
        results gives the loss of the full batch; `norm_len` is the constant length of
        seq-mean-token-sum-norm."""
        ...


class KLFn(Protocol):
    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        """logprobs [...] (policy, maybe with grad), ref_logprobs [...] -> per-token KL estimate [...]."""
        ...


class CorrectionFn(Protocol):
    def __call__(
        self, log_ratio: Tensor, mask: Tensor, params: CorrectionParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """log_ratio [B, T] (target − behaviour, 0 where ~mask, clamped), mask [B, T] bool
        -> (ratio the mode judges [B, T], weight [B, T], keep [B, T] bool, clipped [B, T] bool)."""
        ...


@dataclass(frozen=True)
class AlgorithmNeeds:
    """What an advantage estimator needs beyond rewards, group ids and the loss mask; declared at
    registration, read by config validation, the builders, the Learner and the embedding API."""

    # AdvantageInput.values: the trainer builds the [critic] value model
    critic: bool = False
    # AdvantageInput.baselines: generators also decode each prompt greedily and scorers score that completion,
    # which env episodes and groups submitted to asyncrl.Runtime do not have
    greedy_baseline: bool = False
    # rollout.group_size below this gives every sample advantage 0 (a group baseline needs other samples)
    min_group_size: int = 1

    def __post_init__(self) -> None:
        if self.min_group_size < 1:
            raise ValueError(f"AlgorithmNeeds.min_group_size must be >= 1, got {self.min_group_size}")


ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
ADVANTAGE_NEEDS: Registry[AlgorithmNeeds] = Registry("advantage estimator")  # same names as ADVANTAGES
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
LOSS_AGGS: Registry[LossAggFn] = Registry("loss aggregation")
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")
CORRECTIONS: Registry[CorrectionFn] = Registry("off-policy correction")


def register_advantage(name: str, *, needs: AlgorithmNeeds = AlgorithmNeeds()) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under `name` with what it needs (default: nothing beyond rewards and groups of 1)."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES.register(name)(fn)
        ADVANTAGE_NEEDS.register(name)(needs)
        return fn

    return deco


def unregister_advantage(name: str) -> None:
    """Remove an estimator and its needs (a test's throwaway entry); KeyError if it is not registered."""
    ADVANTAGES.unregister(name)
    ADVANTAGE_NEEDS.unregister(name)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    return POLICY_LOSSES.register(name)


def register_loss_agg(name: str) -> Callable[[LossAggFn], LossAggFn]:
    return LOSS_AGGS.register(name)


def register_kl(name: str) -> Callable[[KLFn], KLFn]:
    return KL_ESTIMATORS.register(name)


def register_correction(name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    return CORRECTIONS.register(name)


def get_advantage(name: str) -> AdvantageFn:
    """Raises KeyError naming the known estimators."""
    return ADVANTAGES.get(name)


def advantage_needs(name: str) -> AlgorithmNeeds:
    """What estimator `name` needs; raises KeyError naming the known estimators."""
    return ADVANTAGE_NEEDS.get(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """Raises KeyError naming the known policy losses."""
    return POLICY_LOSSES.get(name)


def get_loss_agg(name: str) -> LossAggFn:
    """Raises KeyError naming the known aggregations."""
    return LOSS_AGGS.get(name)


def get_kl_estimator(name: str) -> KLFn:
    """Raises KeyError naming the known KL estimators."""
    return KL_ESTIMATORS.get(name)


def get_correction(name: str) -> CorrectionFn:
    """Raises KeyError naming the known off-policy corrections."""
    return CORRECTIONS.get(name)


def available_advantages() -> list[str]:
    return ADVANTAGES.names()


def available_policy_losses() -> list[str]:
    return POLICY_LOSSES.names()


def available_loss_aggs() -> list[str]:
    return LOSS_AGGS.names()


def available_kl_estimators() -> list[str]:
    return KL_ESTIMATORS.names()


def available_corrections() -> list[str]:
    return CORRECTIONS.names()
