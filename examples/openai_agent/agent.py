"""An agent written with the `openai` SDK, trained through asyncrl's OpenAI-compatible endpoint.

`guess_agent` is ordinary OpenAI-client code: it plays the guessing game of examples/guess (a hidden digit,
one guess per reply, "+" / "-" feedback as the next user message) and knows nothing about asyncrl beyond
the base_url it is given. `main` starts a Runtime, serves the policy (`rt.serve_openai`), gives each
episode its own base_url (the endpoint records every request of it: exact token ids, logprobs, policy
versions), sets the reward and submits groups of episodes of the same target. Training runs in the
background and the endpoint answers with the newest weights.

    python examples/openai_agent/agent.py examples/openai_agent/config.toml      # from the repository root
    python examples/openai_agent/agent.py examples/openai_agent/config.toml trainer.total_steps=20  # overrides
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time

import httpx
from openai import AsyncOpenAI

from asyncrl import Runtime
from asyncrl.runtime import TrainingFinished

MAX_GUESSES = 4
# The tiny model's 13-symbol vocabulary has no room for role markers: its chat template concatenates the
# messages' contents, so a conversation is "?" + guess + "+" + guess ... (what examples/agent_loop builds).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


async def guess_agent(client: AsyncOpenAI, target: int) -> float:
    """Black-box agent code: chat with the model until it finds `target`; the reward, 1 if found."""
    messages = [{"role": "user", "content": "?"}]
    for _ in range(MAX_GUESSES):
        reply = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=1)).choices[0]
        guess = (reply.message.content or "").strip()
        if guess[:1].isdigit() and int(guess[0]) == target:
            return 1.0
        hint = "?" if not guess[:1].isdigit() else ("+" if target > int(guess[0]) else "-")
        messages += [{"role": "assistant", "content": reply.message.content}, {"role": "user", "content": hint}]
    return 0.0


async def worker(rt: Runtime, server, http: httpx.AsyncClient, seed: int, rewards: dict[int, list[float]]) -> None:
    """Keeps submitting groups: rollout.group_size episodes of one target (GRPO compares them)."""
    rng = random.Random(seed)

    async def episode(target: int):
        async with server.episode() as ep:  # its base_url ties the agent's requests to this episode
            # one shared connection pool: a client per episode would build its own
            client = AsyncOpenAI(base_url=ep.base_url, api_key="unused", http_client=http)
            ep.reward = await guess_agent(client, target)
        return ep

    while not rt.training_done:
        target, version = rng.randrange(10), rt.version
        group = await asyncio.gather(*[episode(target) for _ in range(rt.cfg.rollout.group_size)])
        try:
            if await rt.submit(group) is None:
                continue  # too stale for the gate: dropped (and counted) by the runtime
        except TrainingFinished:
            return
        rewards.setdefault(version, []).extend(ep.reward for ep in group)


async def main(config: str, overrides: list[str]) -> None:
    t0 = time.time()
    async with Runtime(config, overrides=overrides) as rt, httpx.AsyncClient(timeout=60) as http:
        server = await rt.serve_openai(chat_template=CHAT_TEMPLATE)   # http://127.0.0.1:<free port>
        print(f"serving the policy on {server.url}", flush=True)
        rewards: dict[int, list[float]] = {}
        workers = [asyncio.ensure_future(worker(rt, server, http, seed, rewards)) for seed in range(8)]
        last = 0
        while not rt.training_done:
            try:
                last = await rt.wait_for_version(last + 10, timeout=600)
            except TrainingFinished:
                break
            recent = [r for v, rs in rewards.items() if v >= last - 10 for r in rs]
            print(f"version {last:4d} | agent reward (last 10 versions) {sum(recent) / max(1, len(recent)):.3f} "
                  f"| {server.counters['requests']} requests | {time.time() - t0:.0f}s", flush=True)
        rows = await rt.wait_done()
        await asyncio.gather(*workers)
    evals = [(r["step"], r["eval/greedy_reward"]) for r in rows if "eval/greedy_reward" in r]
    print("held-out greedy reward by step:", ", ".join(f"{s}: {v:.2f}" for s, v in evals))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "examples/openai_agent/config.toml", sys.argv[2:]))
