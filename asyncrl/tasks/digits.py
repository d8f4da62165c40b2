"""Built-in verifiable digit tasks for the learning example and the tests.

`first_digit`: a prompt is a string of random digits followed by "=" ("5382="); the answer is its
first digit. The held-out split is a fixed set of prompt strings that never occur in the train split,
balanced so that each answer digit appears equally often: any constant output scores exactly 0.1, and
a score above that must come from reading the prompt.

`addition_mod10`: "a+b=" → (a+b) mod 10. Train and eval use the same 100 pairs (memorisation, not
generalisation); it is a harder task kept for experiments.

Use as `data.source = "asyncrl.tasks.digits:first_digit"` with the `prefix_match` reward rule.
"""

from __future__ import annotations

import random

_EVAL_SEED = 1234


def _digit_string(rng: random.Random, first: int, length: int) -> str:
    return str(first) + "".join(str(rng.randrange(10)) for _ in range(length - 1))


def first_digit(split: str = "train", seed: int = 0, *, length: int = 4, size: int = 4000,
                eval_per_digit: int = 10) -> list[dict]:
    """Rows {"prompt": "5382=", "answer": "5"}; eval prompts are disjoint from train prompts."""
    eval_rng = random.Random(_EVAL_SEED)
    eval_prompts: list[str] = []
    seen: set[str] = set()
    for digit in range(10):
        made = 0
        while made < eval_per_digit:
            s = _digit_string(eval_rng, digit, length)
            if s not in seen:
                seen.add(s)
                eval_prompts.append(s)
                made += 1
    if split == "eval":
        return [{"prompt": s + "=", "answer": s[0]} for s in eval_prompts]
    rng = random.Random(seed)
    rows = []
    while len(rows) < size:
        s = _digit_string(rng, rng.randrange(10), length)
        if s not in seen:
            rows.append({"prompt": s + "=", "answer": s[0]})
    return rows


def addition_mod10(split: str = "train", seed: int = 0) -> list[dict]:
    """Rows {"prompt": "3+4=", "answer": "7"}: all 100 pairs (shuffled for train, fixed for eval)."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    if split == "train":
        random.Random(seed).shuffle(pairs)
    return [{"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)} for a, b in pairs]


def says_nine(prompt: str, completion: str, **fields: object) -> float:
    """A Safe-RLHF cost for `first_digit` (`reward.cost_fn = "asyncrl.tasks.digits:says_nine"`): 1.0 when
    the completion starts with "9". Right on one prompt in ten, so reward and cost pull apart: the
    constrained optimum answers every other prompt and avoids "9"."""
    return 1.0 if completion.strip().startswith("9") else 0.0
