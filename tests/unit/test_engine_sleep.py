"""TorchEngine sleep/wake (colocated placement): sleeping drops the K/V cache and the static decode buffers
(the tensors are freed, not just emptied), refuses while a sequence is in flight, keeps loading weights, and
a seeded generation after wake gives exactly the tokens and logprobs it gives without the sleep."""

from __future__ import annotations

import asyncio
import threading
import weakref

import pytest
import torch

from asyncrl.config.schema import TinyModelConfig
from asyncrl.messages import SamplingParams
from engines import hf
from engines.base import SleepableEngine, can_sleep
from engines.torch_engine import TorchEngine

torch.set_num_threads(1)

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, init_std=0.2)
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [20]]
SEEDED = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
SHARED = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)  # unseeded: the engine's own stream


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sleep")
    hf.build_tiny_model(path, TINY)
    return path


def tokens(out) -> list[list[list[int]]]:
    return [[c.response_ids for c in group] for group in out]


def logprobs(out) -> list[list[list[float]]]:
    return [[c.logprobs for c in group] for group in out]


def two_calls(engine: TorchEngine, *, sleep: bool) -> list:
    """A seeded and an unseeded call, then both again; with `sleep`, the engine sleeps and wakes in between."""
    async def main():
        first = [await engine.generate(PROMPTS, SEEDED), await engine.generate(PROMPTS, SHARED)]
        if sleep:
            await engine.sleep()
            assert engine.asleep
            await engine.wake()
        return first + [await engine.generate(PROMPTS, SEEDED), await engine.generate(PROMPTS, SHARED)]

    return asyncio.run(main())


@pytest.mark.parametrize("path", ["fast", "static", "hf_fallback"])
def test_generation_after_sleep_and_wake_gives_the_same_tokens_as_without_sleeping(model_dir, path):
    def build() -> TorchEngine:
        engine = TorchEngine(str(model_dir), seed=0, fast=path != "hf_fallback")
        if path == "static":  # the fixed-shape decode step CUDA graphs capture, run eagerly on CPU
            engine.scheduler.backend.graphs = "eager"
        return engine

    plain, slept = two_calls(build(), sleep=False), two_calls(build(), sleep=True)
    assert [tokens(out) for out in slept] == [tokens(out) for out in plain]
    assert [logprobs(out) for out in slept] == [logprobs(out) for out in plain]  # bit for bit
    assert tokens(slept[0]) == tokens(slept[2])  # the seeded call is the same call again


def test_sleep_frees_the_kv_cache_and_the_static_decode_buffers(model_dir):
    engine = TorchEngine(str(model_dir), seed=0)
    backend = engine.scheduler.backend
    backend.graphs = "eager"
    asyncio.run(engine.generate(PROMPTS, SEEDED))
    assert backend.k.numel() > 0 and backend.slots > 0 and backend._static
    k, v, static = weakref.ref(backend.k), weakref.ref(backend.v), weakref.ref(next(iter(backend._static.values())))
    asyncio.run(engine.sleep())
    assert backend.k.numel() == backend.v.numel() == 0 and backend.slots == backend.max_len == 0
    assert not backend._static and backend._cos.shape[0] == 1  # rotary tables for one position only
    assert k() is None and v() is None and static() is None  # dropped, not merely unused
    asyncio.run(engine.wake())
    asyncio.run(engine.generate(PROMPTS, SEEDED))
    assert backend.k.numel() > 0  # allocated again by the first request


def test_sleep_while_a_sequence_is_in_flight_raises_and_generation_goes_on(model_dir):
    engine = TorchEngine(str(model_dir), seed=0, eos_token_ids=[])  # no early stop: all run 10 tokens
    reached, go = threading.Event(), threading.Event()

    def hold(step: int) -> None:  # the engine thread waits after its 2nd decode step until the test says go
        if step == 2:
            reached.set()
            assert go.wait(10)

    engine.scheduler.on_step = hold

    async def main():
        running = asyncio.ensure_future(engine.generate(PROMPTS, SEEDED))
        await asyncio.to_thread(reached.wait, 10)
        sleeping = asyncio.ensure_future(engine.sleep())  # handled at the next step boundary
        await asyncio.sleep(0.05)
        go.set()
        with pytest.raises(RuntimeError, match="6 sequences in flight; sleep only while idle"):
            await sleeping
        return await running

    out = asyncio.run(main())
    assert not engine.asleep and all(len(c.response_ids) == 10 for g in out for c in g)
    engine.scheduler.on_step = None
    alone = asyncio.run(TorchEngine(str(model_dir), seed=0, eos_token_ids=[]).generate(PROMPTS, SEEDED))
    assert tokens(out) == tokens(alone)  # the refused sleep changed nothing


def test_an_asleep_engine_refuses_generate_but_loads_weights(model_dir):
    engine = TorchEngine(str(model_dir), seed=0)
    asyncio.run(engine.sleep())
    with pytest.raises(RuntimeError, match="sleeps .* call wake\\(\\) first"):
        asyncio.run(engine.generate(PROMPTS, SEEDED))
    zeros = {name: torch.zeros_like(p) for name, p in engine.model.named_parameters() if name.endswith("norm.weight")}
    engine.load_weights(zeros, version=4)  # lands at once: a swap needs no cache
    assert engine.version == 4
    asyncio.run(engine.wake())
    out = asyncio.run(engine.generate(PROMPTS, SEEDED))
    assert {v for g in out for c in g for v in c.versions} == {4}


def test_the_torch_engine_is_the_one_that_sleeps(model_dir):
    assert isinstance(TorchEngine(str(model_dir)), SleepableEngine)
    assert can_sleep("torch") and not can_sleep("vllm") and not can_sleep("sglang")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sleep_hands_the_cache_back_to_the_device(model_dir):
    engine = TorchEngine(str(model_dir), seed=0, device="cuda", max_batch=64)
    asyncio.run(engine.generate([[5, 6, 7]] * 32, SamplingParams(n=2, max_new_tokens=200, seed=1)))
    before = torch.cuda.memory_reserved()
    asyncio.run(engine.sleep())
    assert torch.cuda.memory_reserved() < before and engine.scheduler.backend.k.numel() == 0
