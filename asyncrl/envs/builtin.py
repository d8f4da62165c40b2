"""Built-in environments small enough for a 75k-parameter char-level model to learn on two CPU cores,
and the row sources (`data.source`) that go with them.

| name          | turns | rows (data.source)                      | reward                                         |
|---------------|-------|-----------------------------------------|------------------------------------------------|
| `first_digit` | 1     | `asyncrl.tasks.digits:first_digit`      | 1 if the answer starts with the first digit     |
| `tool_arith`  | <= 3  | `asyncrl.envs.builtin:arith_rows`       | 1 if the final answer is right (calculator tool) |
| `guess`       | <= 4  | `asyncrl.envs.builtin:guess_rows`       | 1 if found within max_guesses (feedback + / -)   |

Place in the dataflow: resolved by name through `asyncrl.envs.base.ENVS`; one instance per episode.
"""

from __future__ import annotations

import random
import re
from typing import Any

from asyncrl.envs.base import StepResult
from asyncrl.envs.tools import TextCall, ToolBox, make_toolbox, parse_call


class FirstDigitEnv:
    """Single-turn wrapper of the first-digit task: the observation is the prompt, one answer, one reward."""

    async def reset(self, row: dict[str, Any]) -> str:
        self.answer = str(row["answer"])
        return str(row["prompt"])

    async def step(self, action: str) -> StepResult:
        return StepResult(reward=float(action.strip().startswith(self.answer)), done=True)


class ToolArithEnv:
    """Multiply two digits with a calculator. The calculator's display starts out holding the question
    ("7*8", the prompt). A model turn ending in "=" presses "=": the calculator evaluates the display
    extended by what the turn typed before the "=" ("=" alone -> "7*8"; "+1=" -> "7*8+1") and shows the
    result, which comes back as the observation ("56,"). "calculator:EXPR" evaluates EXPR alone. Any other
    turn is the final answer, read as its leading digits. Reward: 1 for a right final answer, else
    `partial` x the share of its leading digits that are right; plus `tool_bonus` for an episode that used
    the calculator successfully (shaping: pressing "=" is found by chance at once, copying the result it
    shows takes longer)."""

    stop = ["=", ","]  # a call ends at "=", an answer at ","

    def __init__(self, *, max_calls: int = 2, tool_bonus: float = 0.1, partial: float = 0.5,
                 timeout_s: float = 2.0) -> None:
        self.max_calls = max_calls
        self.tool_bonus = tool_bonus
        self.partial = partial
        self.tools: ToolBox = make_toolbox(["calculator"], timeout_s=timeout_s)

    @property
    def tool_calls(self) -> int:  # env/tool_calls
        return self.tools.calls

    @property
    def tool_errors(self) -> int:  # env/tool_errors
        return self.tools.errors

    async def reset(self, row: dict[str, Any]) -> str:
        self.answer = str(row["answer"])
        self.display = str(row["prompt"])
        self.last_result: str | None = None
        self.used_tool = False
        self.calls = 0
        return self.display

    async def step(self, action: str) -> StepResult:
        call = parse_call(action, self.tools.names, default="=")
        if call is not None and self.calls < self.max_calls:
            self.calls += 1
            if call.name == "=":  # "=" pressed: evaluate the display plus what the turn typed
                call = TextCall("calculator", self.display + call.args)
            result = await self.tools.call(call)
            ok = not result.startswith("error")
            self.last_result = result if ok else None
            if ok:
                self.display = result
                self.used_tool = True
            return StepResult(observation=(result if ok else "?") + ",")
        m = re.match(r"\s*(\d+)", action)
        given = m.group(1) if m else ""
        if given == self.answer:
            reward = 1.0
        else:  # partial credit: the share of leading digits that are right
            right = next((i for i, (a, b) in enumerate(zip(given, self.answer)) if a != b),
                         min(len(given), len(self.answer)))
            reward = self.partial * right / len(self.answer)
        reward += self.tool_bonus if self.used_tool else 0.0
        return StepResult(reward=reward, done=True)


class GuessEnv:
    """Guess a hidden digit. The prompt is "?"; each model turn is one guess; the env answers "+" (higher),
    "-" (lower) or "?" (not a digit). Reward 1 if found within `max_guesses` (binary search always finds
    one of ten digits in 4), minus `turn_cost` per guess before the right one (0 by default)."""

    def __init__(self, *, max_guesses: int = 4, turn_cost: float = 0.0) -> None:
        self.max_guesses = max_guesses
        self.turn_cost = turn_cost

    async def reset(self, row: dict[str, Any]) -> str:
        self.target = int(row["target"])
        self.guesses = 0
        return str(row["prompt"])

    async def step(self, action: str) -> StepResult:
        self.guesses += 1
        text = action.strip()
        last = self.guesses >= self.max_guesses
        if not text[:1].isdigit():
            return StepResult(observation="?", done=last)
        guess = int(text[0])
        if guess == self.target:
            return StepResult(reward=1.0 - self.turn_cost * (self.guesses - 1), done=True)
        return StepResult(observation="+" if self.target > guess else "-", done=last)


def guess_rows(split: str = "train", seed: int = 0, *, size: int = 1000) -> list[dict]:
    """Rows {"prompt": "?", "target": d}; eval holds each digit twice (balanced)."""
    if split == "eval":
        return [{"prompt": "?", "target": d} for d in range(10) for _ in range(2)]
    rng = random.Random(seed)
    return [{"prompt": "?", "target": rng.randrange(10)} for _ in range(size)]


def arith_rows(split: str = "train", seed: int = 0, *, op: str = "-") -> list[dict]:
    """Rows {"prompt": "9-3", "answer": "6"} over digit pairs (for "-": a >= b, so every answer is one
    digit; for "*" and "+": 1..9); eval is a fixed quarter of the pairs that never occurs in training."""
    if op not in _OPS:
        raise ValueError(f"arith_rows: op must be one of {', '.join(_OPS)}, got {op!r}")
    lo = 0 if op == "-" else 1
    pairs = [(a, b) for a in range(lo, 10) for b in range(lo, 10) if op != "-" or a >= b]
    random.Random(1234).shuffle(pairs)
    cut = len(pairs) // 4
    chosen = pairs[:cut] if split == "eval" else pairs[cut:]
    if split == "train":
        random.Random(seed).shuffle(chosen)
    return [{"prompt": f"{a}{op}{b}", "answer": str(_OPS[op](a, b))} for a, b in chosen]


_OPS = {"-": lambda a, b: a - b, "+": lambda a, b: a + b, "*": lambda a, b: a * b}
