"""Built-in reward rules: string checks of a completion against the row's reference answer.

Place in the dataflow: `reward.fn` is resolved once (`loader.resolve_reward`) and the Scorer calls the
result for every trajectory as `fn(prompt, completion, **fields)`, where `fields` are the dataset row's
other fields. A rule is registered by name as a *factory* taking `answer_key` (the row field holding the
reference answer, `reward.answer_key`; a dotted path such as `reward_model.ground_truth` reaches into nested
fields, as in verl's parquet rows) and returning such a function.

Every rule returns 1.0 or 0.0. Comparisons strip surrounding whitespace on both sides; the answer is
converted with `str()`, so numeric answers in JSON (`"answer": 4`) work. An empty reference answer is
matched by every completion under `prefix_match` and `contains` (that is what the string test says);
keep answers non-empty. The math verifiers `gsm8k`, `boxed` and `math_verify` live in verifiers.py.
"""

from __future__ import annotations

from typing import Any, Callable

from asyncrl.data.rows import MissingField, field_at
from asyncrl.registry import Registry

RewardFn = Callable[..., float]
"""fn(prompt: str, completion: str, **fields) -> float"""

RULES: Registry[Callable[[str], RewardFn]] = Registry("reward rule")


def _answer(rule: str, answer_key: str, fields: dict[str, Any]) -> str:
    """The reference answer of a row (`answer_key` may be a dotted path into nested fields, e.g.
    'reward_model.ground_truth'), or one clear line naming the missing field."""
    try:
        return str(field_at(fields, answer_key)).strip()
    except MissingField as exc:
        known = ", ".join(sorted(fields)) or "none"
        raise ValueError(
            f"reward rule {rule!r}: the row has {exc} (fields: {known}) "
            f"— set reward.answer_key to the field holding the reference answer"
        ) from None


def _rule(name: str, test: Callable[[str, str], bool]) -> Callable[[str], RewardFn]:
    """Make a factory for a rule that compares the stripped completion with the stripped answer."""

    def factory(answer_key: str) -> RewardFn:
        def reward(prompt: str, completion: str, **fields: Any) -> float:
            return 1.0 if test(completion.strip(), _answer(name, answer_key, fields)) else 0.0

        reward.__name__ = reward.__qualname__ = name
        return reward

    factory.__name__ = f"{name}_factory"
    return factory


RULES.register("exact_match")(_rule("exact_match", lambda completion, answer: completion == answer))
RULES.register("prefix_match")(_rule("prefix_match", lambda completion, answer: completion.startswith(answer)))
RULES.register("contains")(_rule("contains", lambda completion, answer: answer in completion))

# Math verifiers (verifiers.py), imported when a config names one: `math_verify` needs an optional package.
RULES.register_lazy("gsm8k", "asyncrl.rewards.verifiers:gsm8k_rule")
RULES.register_lazy("boxed", "asyncrl.rewards.verifiers:boxed_rule")
RULES.register_lazy("math_verify", "asyncrl.rewards.verifiers:math_verify_rule")

# A cost rule (Safe-RLHF, `reward.cost_fn`): 1.0 when the completion says more than the answer — a
# verbosity constraint the reward (prefix_match) is indifferent to, so reward and cost pull apart.
RULES.register("longer_than_answer")(
    _rule("longer_than_answer", lambda completion, answer: len(completion) > len(answer))
)
