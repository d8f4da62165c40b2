"""The SmolLM2 example's reward: reasoning-gym's own scorer on the answer extracted from the reply.

Place in the dataflow: `reward.fn = "examples.smollm_arith.reward:score"`; the Scorer (training rollouts)
and the Evaluator (held-out prompts) call it with the decoded completion and the row's fields. Run from
the repository root with it on the import path (`PYTHONPATH=.`): `asyncrl validate` and the driver
import it, and Ray puts the driver's working directory on every actor's path.

The answer is the text inside the last `<answer>...</answer>` tags if the reply has them (reasoning-gym's
convention), else the last number in the reply, so "7 - 5 = 2" and "2" both answer "2". The row's
`metadata.source_dataset` names the reasoning-gym task whose `score_answer` grades it; for
basic_arithmetic that is 1.0 for the exact number, a fraction for a longer answer containing it, else 0.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The answer a reply gives: its last <answer> tag's text, else its last number, else None."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1]
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


@functools.lru_cache(maxsize=None)
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def score(prompt: str, completion: str, answer: str, metadata: dict[str, Any]) -> float:
    """Reward in [0, 1] of `completion` for a reasoning-gym row (`answer` and `metadata` as it made them)."""
    task = metadata["source_dataset"]
    return float(_scorer(task)(extract_answer(completion), {"answer": answer, "metadata": metadata}))
