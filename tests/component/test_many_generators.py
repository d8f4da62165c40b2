"""Several generators in-process: real Generator roles with fake engines of different speeds, the real
ReplayBuffer, and a scorer and a trainer loop. The gate's room goes to the least-loaded generator
(buffers/dispatch.py), so a slow generator holds only the groups handed out before it was known to be slow;
every later step trains the fast one's samples alone, and each generator reports its own throughput."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Mapping

import torch

from asyncrl.data.prompts import Prompt
from asyncrl.messages import Completion, SamplingParams
from asyncrl.roles.generator import Generator
from asyncrl.telemetry.metrics import Rate
from buffers.grouping import GroupAssembler
from buffers.queue import QueueClosed
from buffers.replay import ReplayBuffer


class DecodeEngine:
    """A RolloutEngine that decodes `tokens` steps, each taking `step_s` seconds, for the whole batch."""

    def __init__(self, step_s: float, tokens: int = 2) -> None:
        self.step_s = step_s
        self.tokens = tokens
        self.version = 0

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        for _ in range(self.tokens):
            await asyncio.sleep(self.step_s)
        return [[Completion(prompt_ids=p, response_ids=[7] * self.tokens, logprobs=[-0.5] * self.tokens,
                            versions=[self.version] * self.tokens, finish_reason="length")
                 for _ in range(params.n)] for p in prompts]

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.version = version

    async def close(self) -> None:
        pass


class Receiver:
    """The weights of `version`, there when asked for (like the in-process channel)."""

    arms_early = False

    def __init__(self) -> None:
        self.version = 0

    def receive(self, *, armed: bool = False) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        return {"w": torch.zeros(1)}, self.version, {}


def make_generator(i: int, engine: DecodeEngine, buffer: ReplayBuffer) -> Generator:
    gen = Generator(generator_id=i, engine=engine, buffer=buffer, prompt_row=lambda gid: {"prompt": f"q{gid}"},
                    encode=lambda row: Prompt([1, 2], row["prompt"]), sampling=SamplingParams(n=2, max_new_tokens=2),
                    concurrency=4)
    gen.receiver = Receiver()
    return gen


async def train(buffer: ReplayBuffer, gens: list[Generator], steps: int) -> list[list[int]]:
    """The trainer's part: take each step's groups, "train", send the new weights to every generator (each
    swaps them in), publish. Returns the generator of every trained sample, per step."""
    trained: list[list[int]] = []
    for step in range(steps):
        groups = await buffer.take_step(step)
        trained.append([t.generator_id for g in groups for t in g.trajectories])
        await asyncio.sleep(0.002)
        for g in gens:
            g.receiver.version = step + 1
        await asyncio.gather(*[g.receive_weights() for g in gens])
        await buffer.publish(step + 1)
    return trained


async def score(buffer: ReplayBuffer) -> None:
    """The scorer's part, until the buffer is closed (an empty batch is only a timeout: a slow generator's groups
    may take longer to come; it ended the loop once, and the trainer then waited for groups nobody scored)."""
    assembler = GroupAssembler()
    while not buffer.gate.closed:
        for t in await buffer.get_rollouts(8, timeout=0.2):
            if (group := assembler.add(t)) is not None:
                try:
                    await buffer.accept_groups([group])
                except QueueClosed:  # the test closed the buffer meanwhile
                    return


def test_a_slow_generator_holds_only_the_first_groups_and_every_later_step_trains_the_fast_ones_samples():
    p, k, steps = 2, 1, 12

    async def main():
        buffer = ReplayBuffer(prompts_per_step=p, group_size=2, max_staleness=k, rollout_capacity=16,
                              train_capacity=8, generators=2)
        # generator 0 is the slow one: ties at the start go to the lower index, its worst case. Its 0.5 s a group
        # against the fast one's milliseconds: even on a loaded machine (the fast one's groups then take tens of
        # ms, 4 in flight) the fast one's expected wait stays below the slow one's (at 0.05 s a step it did not)
        gens = [make_generator(0, DecodeEngine(step_s=0.25), buffer), make_generator(1, DecodeEngine(0.0), buffer)]
        loops = [asyncio.ensure_future(g.run()) for g in gens]
        scorer = asyncio.ensure_future(score(buffer))
        trained = await asyncio.wait_for(train(buffer, gens, steps), 20.0)
        stats = [g.stats().metrics for g in gens]  # (their window: since the start)
        produced = [g.samples_generated for g in gens]
        for g in gens:
            g.stop()
        await buffer.close()
        await asyncio.gather(*loops, scorer)
        return trained, stats, produced

    trained, stats, produced = asyncio.run(main())
    assert [len(samples) for samples in trained] == [p * 2] * steps
    per_step = [Counter(samples) for samples in trained]
    # the slow generator's samples are only those of the groups admitted at the start (version 0: the first
    # k + 1 steps); every later step waits for the fast generator alone
    assert all(c[0] == 0 for c in per_step[k + 1:]), per_step
    assert sum(c[1] for c in per_step) >= 0.9 * steps * p * 2
    assert produced[1] > 4 * produced[0]
    assert stats[0]["generator/0/samples_per_s"] == Rate(produced[0])
    assert stats[1]["generator/1/samples_per_s"] == Rate(produced[1])
    assert stats[1]["generator/1/tokens_per_s"] == Rate(2 * produced[1])
    assert "generator/1/samples_per_s" not in stats[0]  # each reports its own


def test_equal_generators_each_produce_about_half_the_samples():
    p, k, steps = 4, 1, 8

    async def main():
        buffer = ReplayBuffer(prompts_per_step=p, group_size=2, max_staleness=k, rollout_capacity=32,
                              train_capacity=16, generators=2)
        gens = [make_generator(i, DecodeEngine(step_s=0.005), buffer) for i in range(2)]
        loops = [asyncio.ensure_future(g.run()) for g in gens]
        scorer = asyncio.ensure_future(score(buffer))
        trained = await asyncio.wait_for(train(buffer, gens, steps), 20.0)
        for g in gens:
            g.stop()
        await buffer.close()
        await asyncio.gather(*loops, scorer)
        return Counter(gid for samples in trained for gid in samples)

    counts = asyncio.run(main())
    total = sum(counts.values())
    assert total == steps * p * 2
    assert 0.3 * total <= counts[0] <= 0.7 * total, counts


class CallCounter:
    """A generator role's `generate` as `Runtime.generate` calls it: sleeps `delay_s`, counts its calls."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return [[Completion(prompt_ids=p, response_ids=[7], logprobs=[-0.5], versions=[0], finish_reason="stop")]
                for p in prompts]


def test_runtime_generate_sends_each_call_to_the_least_loaded_generator_not_round_robin(make_config):
    from types import SimpleNamespace

    from asyncrl.runtime import Runtime

    rt = Runtime(make_config())  # not entered: only its generate is used, on these two generators
    slow, fast = CallCounter(0.2), CallCounter(0.0)
    rt._deployment = SimpleNamespace(generators=[slow, fast])

    async def main() -> list[tuple[int, int]]:
        seen = []
        for _ in range(3):  # waves of 8 concurrent calls (an agent loop's episodes acting at once)
            await asyncio.gather(*[rt.generate([1, 2]) for _ in range(8)])
            seen.append((slow.calls, fast.calls))
        return seen

    seen = asyncio.run(main())
    assert seen[0] == (4, 4)  # nothing known yet: fewest calls in flight, ties to the lower index
    assert seen[-1] == (4, 20)  # then the slow one's seconds per call keep the next waves off it
