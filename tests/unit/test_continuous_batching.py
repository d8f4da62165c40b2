"""The native engine's scheduler: concurrent requests share decode forwards, late joiners and early
finishers get their solo tokens, seeded requests ignore their companions, in-flight weight swaps land
between two decode steps (versions, bit-identical weights, recomputed or kept KV), interrupts return
partial rollouts that carry over, cancellation and close release what they held.

Determinism: `scheduler.on_step(step)` runs on the engine thread after each decode step; a hook that
blocks there holds the loop at an exact step boundary while the test submits, swaps or interrupts."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import pytest
import torch

from asyncrl.config.schema import TinyModelConfig
from asyncrl.messages import SamplingParams
from engines import hf
from engines.torch_engine import TorchEngine

torch.set_num_threads(1)

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, init_std=0.2)
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_cb")
    hf.build_tiny_model(path, TINY)
    return path


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return hf.load_model(model_dir)


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw)


def run(engine, prompts, params):
    return asyncio.run(engine.generate(prompts, params))


def teacher_forced(model, prompt, response, temperature) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / (temperature or 1.0)
    return scaled.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def assert_same_greedy(model, prompt, ours, theirs) -> int:
    """Equal up to the first position whose top-2 logit margin is <= 1e-3 (fp noise may flip a near tie);
    returns how many positions were compared."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs])).logits[0, len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1).values
    for i, margin in enumerate((top[:, 0] - top[:, 1]).tolist()):
        if margin <= 1e-3:
            return i
        assert ours[i] == theirs[i], f"prompt {prompt}: diverges at {i}"
    assert ours == theirs
    return len(theirs)


def hold_at(engine, step: int):
    """(hook, reached, go): the hook blocks the engine thread after the `step`-th decode step from now
    until go is set."""
    reached, go = threading.Event(), threading.Event()
    base = engine.num_decode_forwards

    def hook(s: int) -> None:
        if s - base == step:
            reached.set()
            assert go.wait(10), "test never released the engine"

    return hook, reached, go


def test_64_concurrent_requests_of_length_L_take_at_most_L_decode_forwards(ref_model):
    """Each sequence needs one prefill (its first token) and L-1 decode steps. 64 coroutines submitting at
    once are admitted as one burst: L-1 shared decode forwards; the asserted bound L leaves room for the
    burst to be split over two admission steps. Nothing can stop early (no eos)."""
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])
    length = 8

    async def main():
        calls = [engine.generate([[4 + i % 40, 5 + i % 7]], SamplingParams(max_new_tokens=length)) for i in range(64)]
        return await asyncio.gather(*calls)

    out = asyncio.run(main())
    assert all(len(g[0][0].response_ids) == length for g in out)
    assert length - 1 <= engine.num_decode_forwards <= length
    assert engine.tokens_generated == 64 * length
    assert engine.stats()["engine/decode_batch/mean"] >= 64 * (length - 2) / length


def test_one_call_with_64_prompts_takes_exactly_L_minus_1_decode_forwards(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])
    out = run(engine, [[4 + i % 40] for i in range(64)], SamplingParams(max_new_tokens=6))
    assert len(out) == 64 and engine.num_prefill_forwards == 1 and engine.num_decode_forwards == 5
    assert list(engine.scheduler.decode_batch_sizes) == [64] * 5


def test_late_joiners_and_early_finishers_give_their_solo_greedy_tokens(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])
    solo_long = run(engine, [PROMPTS[0]], greedy(20))[0][0]
    solo_short = [run(engine, [p], greedy(4))[0][0] for p in PROMPTS[1:3]]
    stop_tok = run(engine, [PROMPTS[3]], greedy(20))[0][0].response_ids[2]
    solo_stop = run(engine, [PROMPTS[3]], greedy(20, stop_token_ids=[stop_tok]))[0][0]
    assert solo_stop.finish_reason == "stop" and len(solo_stop.response_ids) <= 3
    engine.scheduler.decode_batch_sizes.clear()
    hook, reached, go = hold_at(engine, step=3)
    engine.scheduler.on_step = hook

    async def main():
        long = asyncio.ensure_future(engine.generate([PROMPTS[0]], greedy(20)))
        await asyncio.to_thread(reached.wait, 10)  # the long one has run 3 decode steps alone
        late = [asyncio.ensure_future(engine.generate([p], greedy(4))) for p in PROMPTS[1:3]]
        late.append(asyncio.ensure_future(engine.generate([PROMPTS[3]], greedy(20, stop_token_ids=[stop_tok]))))
        await asyncio.sleep(0.01)  # the tasks submit before their first await
        go.set()
        return await asyncio.gather(long, *late)

    long, *late = [g[0][0] for g in asyncio.run(main())]
    sizes = list(engine.scheduler.decode_batch_sizes)
    assert sizes[:3] == [1, 1, 1] and max(sizes) == 4 and sizes[-1] == 1  # joined late, left early
    compared = assert_same_greedy(ref_model, PROMPTS[0], long.response_ids, solo_long.response_ids)
    for prompt, ours, alone in zip(PROMPTS[1:], late, [*solo_short, solo_stop]):
        assert ours.finish_reason == alone.finish_reason
        compared += assert_same_greedy(ref_model, prompt, ours.response_ids, alone.response_ids)
    assert compared >= 24  # measured: 31 of 31 (20 + 4 + 4 + 3 to the stop token)


def test_mixed_sampling_params_in_one_batch_keep_exact_logprobs(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[hf.EOS_ID])
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=0.0),
                dict(temperature=1.3, top_p=0.8)]

    async def main():
        calls = [engine.generate([p], SamplingParams(n=2, max_new_tokens=9 + i, **kw))
                 for i, (p, kw) in enumerate(zip(PROMPTS, settings))]
        return await asyncio.gather(*calls)

    for prompt, kw, (group,) in zip(PROMPTS, settings, asyncio.run(main())):
        for c in group:
            expected = teacher_forced(ref_model, prompt, c.response_ids, kw["temperature"])
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=ATOL, rtol=0)


def test_seeded_request_does_not_depend_on_its_batch_companions(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[], seed=0)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=11)
    alone = run(engine, PROMPTS, params)
    reached, base = threading.Event(), engine.num_decode_forwards
    engine.scheduler.on_step = lambda step: reached.set() if step - base >= 2 else None

    async def crowded():
        others = [asyncio.ensure_future(engine.generate([p], SamplingParams(n=2, max_new_tokens=5 + 3 * i)))
                  for i, p in enumerate(PROMPTS)]
        await asyncio.to_thread(reached.wait, 10)  # ours joins a batch already running
        ours = await engine.generate(PROMPTS, params)
        await asyncio.gather(*others)
        return ours

    other_engine = TorchEngine.from_model(ref_model, eos_token_ids=[], seed=99)  # its own stream differs
    for got in (asyncio.run(crowded()), run(other_engine, PROMPTS, params)):
        assert [[c.response_ids for c in g] for g in got] == [[c.response_ids for c in g] for g in alone]
        torch.testing.assert_close([c.logprobs for g in got for c in g], [c.logprobs for g in alone for c in g],
                                   atol=ATOL, rtol=0)


def perturbed(model, scale: float = 0.3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {k: (v + scale * torch.randn(v.shape, generator=gen)).detach() for k, v in model.named_parameters()}


def swap_mid_generation(engine, new, version, at_step, prompts, params):
    """Run generate; after decode step `at_step` start load_weights on another thread and hold the engine
    until the swap is staged, so it lands exactly at the next step boundary."""
    swapper = threading.Thread(target=engine.load_weights, args=(new, version))
    base = engine.num_decode_forwards

    def hook(step: int) -> None:
        if step - base == at_step:
            swapper.start()
            deadline = time.monotonic() + 10
            while engine.scheduler.staged_swaps() == 0 and time.monotonic() < deadline:
                time.sleep(0.001)

    engine.scheduler.on_step = hook
    out = run(engine, prompts, params)
    swapper.join(timeout=10)
    assert not swapper.is_alive() and engine.version == version
    return out


def test_inflight_swap_lands_between_decode_steps_and_recomputes_kv(model_dir, ref_model):
    engine = TorchEngine(str(model_dir), eos_token_ids=[])  # kv_on_update="recompute" is the default
    new = perturbed(ref_model)
    length = 10
    out = swap_mid_generation(engine, new, 1, 3, PROMPTS, SamplingParams(n=2, temperature=1.0,
                                                                         max_new_tokens=length, seed=5))
    before = 4  # 1 token from the prefill logits + 3 decode steps, all under version 0
    engine_params = dict(engine.model.named_parameters())
    assert all(torch.equal(engine_params[k], t) for k, t in new.items())  # bit-identical to what was sent
    assert len(engine.swap_pauses_s) == 1 and engine.swap_pauses_s[0] > 0
    new_model = hf.load_model(model_dir)
    new_model.load_state_dict(new, strict=False)
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert c.versions == [0] * before + [1] * (length - before) and not c.kv_reused
            old_lp = teacher_forced(ref_model, prompt, c.response_ids, 1.0)
            new_lp = teacher_forced(new_model, prompt, c.response_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs[:before]), old_lp[:before], atol=ATOL, rtol=0)
            torch.testing.assert_close(torch.tensor(c.logprobs[before:]), new_lp[before:], atol=ATOL, rtol=0)


def test_inflight_swap_with_kept_kv_is_flagged_as_a_mixture(model_dir, ref_model):
    engine = TorchEngine(str(model_dir), eos_token_ids=[], kv_on_update="keep")
    new = perturbed(ref_model)
    out = swap_mid_generation(engine, new, 7, 2, PROMPTS[:2], greedy(8))
    new_model = hf.load_model(model_dir)
    new_model.load_state_dict(new, strict=False)
    gaps = []
    for prompt, (c,) in zip(PROMPTS, out):
        assert c.versions == [0] * 3 + [7] * 5 and c.kv_reused
        gaps.append((torch.tensor(c.logprobs[3:]) - teacher_forced(new_model, prompt, c.response_ids, 0.0)[3:]).abs())
    assert torch.cat(gaps).max() > 1e-3  # old K/V under new weights: neither version's logprobs


def test_load_weights_on_an_idle_engine_applies_at_once(model_dir):
    engine = TorchEngine(str(model_dir))
    norm = engine.model.model.norm.weight
    engine.load_weights({"model.norm.weight": torch.full_like(norm, 2.0)}, version=4)
    assert engine.version == 4 and torch.equal(norm, torch.full_like(norm, 2.0))
    assert len(engine.swap_pauses_s) == 1 and engine.num_forwards == 0
    (c,) = run(engine, [PROMPTS[0]], greedy(3))[0]
    assert c.versions == [4, 4, 4]


def test_the_engine_keeps_the_last_swap_pauses_and_sums_every_one(model_dir):
    engine = TorchEngine(str(model_dir))
    s = engine.scheduler
    assert all(r.maxlen for r in (s.decode_batch_sizes, s.step_times_s, s.swap_pauses_s))  # a long run: bounded
    s.swap_pauses_s = collections.deque(maxlen=2)  # the record's bound (`history`), made small
    norm = engine.model.model.norm.weight
    for version in (1, 2, 3):
        engine.load_weights({"model.norm.weight": torch.full_like(norm, float(version))}, version=version)
    stats = engine.stats()
    assert len(engine.swap_pauses_s) == 2
    assert stats["engine/swap_pause_s/sum"] > sum(engine.swap_pauses_s) > 0  # the first pause too
    assert stats["engine/swap_pause_s/max"] >= max(engine.swap_pauses_s)


def test_interrupt_returns_partials_that_carry_over(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[], max_batch=2)
    full = run(engine, [PROMPTS[1]], greedy(30))[0][0]
    hook, reached, go = hold_at(engine, step=5)
    engine.scheduler.on_step = hook

    async def main():
        running = asyncio.ensure_future(engine.generate([PROMPTS[1]], SamplingParams(n=2, temperature=0.0,
                                                                                      max_new_tokens=30)))
        waiting = asyncio.ensure_future(engine.generate([PROMPTS[0]], greedy(5)))  # no free slot: it waits
        await asyncio.to_thread(reached.wait, 10)
        stopper = asyncio.ensure_future(engine.interrupt())
        await asyncio.sleep(0.01)
        go.set()
        return await running, await waiting, await stopper

    running, waiting, aborted = asyncio.run(main())
    engine.scheduler.on_step = None
    assert aborted == 3
    (w,) = waiting[0]
    assert w.finish_reason == "abort" and w.response_ids == [] and w.prompt_ids == PROMPTS[0]
    compared = 0
    for c in running[0]:
        assert c.finish_reason == "abort" and len(c.response_ids) == len(c.logprobs) == len(c.versions) == 6
        compared += assert_same_greedy(ref_model, PROMPTS[1], c.response_ids, full.response_ids[:6])
    assert compared >= 9  # measured: 12 of 12 (2 samples x 6 tokens)
    # carry over: the partial rollout resumes as a continuation and completes like the uninterrupted run
    partial = running[0][0]
    (rest,) = run(engine, [partial.prompt_ids + partial.response_ids], greedy(30 - 6))[0]
    resumed = partial.response_ids + rest.response_ids
    assert assert_same_greedy(ref_model, PROMPTS[1], resumed, full.response_ids) >= 24  # measured: 30 of 30


def test_cancelled_generate_releases_its_slots(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])

    async def main():
        task = asyncio.ensure_future(engine.generate([PROMPTS[0]], greedy(5000)))
        while engine.num_decode_forwards < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.generate([PROMPTS[1]], greedy(3))

    (c,) = asyncio.run(main())[0]
    assert len(c.response_ids) == 3 and engine.tokens_generated < 1000
    assert engine.scheduler.decode_batch_sizes[-1] == 1  # the cancelled sequence no longer decodes


def test_close_fails_requests_in_flight(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])

    async def main():
        task = asyncio.ensure_future(engine.generate([PROMPTS[0]], greedy(5000)))
        while engine.num_decode_forwards < 2:
            await asyncio.sleep(0.001)
        await engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            await task

    asyncio.run(main())
    with pytest.raises(RuntimeError, match="close"):
        engine.load_weights({}, 1)


def test_engine_is_interruptible_and_its_idle_thread_exits(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])
    assert asyncio.run(engine.interrupt()) == 0  # nothing in flight
    engine.scheduler.idle_exit_s = 0.05
    run(engine, [PROMPTS[0]], greedy(2))
    thread = engine.scheduler._thread
    thread.join(timeout=5)
    assert not thread.is_alive() and engine.scheduler._thread is None
    (c,) = run(engine, [PROMPTS[0]], greedy(2))[0]  # a new thread starts on demand
    assert len(c.response_ids) == 2


def test_a_failing_refresh_fails_the_new_requests_instead_of_losing_them(ref_model):
    """The idle -> busy refresh raising (e.g. a module left in a bad state) fails the requests that arrived
    with it, with that error, and the engine serves the next request: nothing hangs."""
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])
    backend = engine.scheduler.backend
    real = backend.refresh
    calls = []

    def refresh_once_broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("refresh broke")
        real()

    backend.refresh = refresh_once_broken

    async def main():
        with pytest.raises(RuntimeError, match="refresh broke"):
            await asyncio.wait_for(engine.generate([PROMPTS[0]], greedy(3)), 30)
        return await asyncio.wait_for(engine.generate([PROMPTS[0]], greedy(3)), 30)

    (c,) = asyncio.run(main())[0]
    assert len(c.response_ids) == 3
    asyncio.run(engine.close())
