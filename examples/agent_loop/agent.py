"""A plain asyncio agent loop that trains a policy through `asyncrl.Runtime` (the embedding API).

The agent plays the guessing game itself — a hidden digit, one guess per model turn, "+" / "-" feedback —
with no asyncrl environment involved: it asks the runtime for model turns on the exact token context
(`ep.act`), appends its own feedback (`ep.observe`), sets the reward and submits groups of episodes of
the same target. Training runs in the background; the engines pick up each new policy version.

    python examples/agent_loop/agent.py examples/agent_loop/config.toml      # from the repository root
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time

from asyncrl import Runtime
from asyncrl.runtime import AgentEpisode, TrainingFinished

MAX_GUESSES = 4


async def play(rt: Runtime, target: int) -> AgentEpisode:
    """One episode: guess until found or out of guesses; reward 1 if found."""
    ep = rt.episode("?")
    for turn in range(MAX_GUESSES):
        guess = (await ep.act(max_new_tokens=1)).strip()
        if guess[:1].isdigit() and int(guess[0]) == target:
            ep.reward = 1.0
            break
        if turn + 1 < MAX_GUESSES:
            ep.observe("?" if not guess[:1].isdigit() else ("+" if target > int(guess[0]) else "-"))
    return ep


async def worker(rt: Runtime, seed: int, group_size: int, rewards: dict[int, list[float]]) -> None:
    """Keeps submitting groups (the same target for every episode of a group: GRPO compares them)."""
    rng = random.Random(seed)
    while not rt.training_done:
        target = rng.randrange(10)
        version = rt.version
        group = await asyncio.gather(*[play(rt, target) for _ in range(group_size)])
        try:
            if await rt.submit(group) is None:
                continue  # too stale for the gate: dropped (and counted) by the runtime
        except TrainingFinished:
            return
        rewards.setdefault(version, []).extend(ep.reward for ep in group)


async def main(config: str) -> None:
    t0 = time.time()
    async with Runtime(config) as rt:
        rewards: dict[int, list[float]] = {}
        workers = [asyncio.ensure_future(worker(rt, seed, rt.cfg.rollout.group_size, rewards)) for seed in range(8)]
        last = 0
        while not rt.training_done:
            try:
                last = await rt.wait_for_version(last + 10, timeout=600)
            except TrainingFinished:
                break
            recent = [r for v, rs in rewards.items() if v >= last - 10 for r in rs]
            print(f"version {last:4d} | agent reward (last 10 versions) {sum(recent) / max(1, len(recent)):.3f} "
                  f"| {time.time() - t0:.0f}s", flush=True)
        rows = await rt.wait_done()
        await asyncio.gather(*workers)
    evals = [(r["step"], r["eval/greedy_reward"]) for r in rows if "eval/greedy_reward" in r]
    print("held-out greedy reward by step:", ", ".join(f"{s}: {v:.2f}" for s, v in evals))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "examples/agent_loop/config.toml"))
