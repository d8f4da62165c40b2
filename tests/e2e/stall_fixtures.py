"""User code that blocks a role's event loop, for the stall tests in test_faults.py: the roles import it as
'tests.e2e.stall_fixtures:...', in process and in Ray actors. Nothing here is part of asyncrl."""

from __future__ import annotations

import re
import time

_blocked = False  # BlockingEnv blocks once per process unless every_step


class BlockingEnv:
    """first_digit as an env whose `async step` makes a synchronous call (a blocking HTTP request, a
    subprocess...): it blocks the generator's event loop, where `env.step_timeout_s` cannot fire."""

    def __init__(self, *, seconds: float = 3.0, every_step: bool = False) -> None:
        self.seconds = seconds
        self.every_step = every_step

    async def reset(self, row: dict) -> str:
        self.answer = str(row["answer"])
        return str(row["prompt"])

    async def step(self, action: str) -> tuple[str, float, bool]:
        global _blocked
        if self.every_step or not _blocked:
            _blocked = True
            time.sleep(self.seconds)
        return "", float(action.strip().startswith(self.answer)), True


def gil_holding_reward(prompt: str, completion: str, **row: object) -> float:
    """A reward stuck in one C call that never releases the interpreter lock (a regex that backtracks
    exponentially): it runs on a worker thread, yet nothing else in its process runs."""
    re.match(r"(a|aa)+$", "a" * 80 + "b")
    return 0.0
