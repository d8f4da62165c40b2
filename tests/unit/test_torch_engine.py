"""engines.torch_engine: batched KV-cache generation whose logprobs match a teacher-forced pass, whose
greedy path matches HF generate, whose stops/versions/truncation are right, and the engine registry.
Continuous batching, in-flight weight swaps and interrupts: tests/unit/test_continuous_batching.py;
the model forward itself: tests/unit/test_torch_model.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from asyncrl.config.schema import TinyModelConfig
from asyncrl.messages import Completion, SamplingParams
from engines import hf
from engines.base import RolloutEngine, available_engines, create_engine
from engines.torch_engine import TorchEngine

torch.set_num_threads(1)

# init_std 0.2 gives peaky logits (top-2 margins mostly >> 1e-3), so greedy comparisons are meaningful.
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, init_std=0.2)
EOS = hf.EOS_ID
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_engine")
    hf.build_tiny_model(path, TINY)
    return path


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return hf.load_model(model_dir)


@pytest.fixture
def engine(model_dir):
    return TorchEngine(str(model_dir), seed=0)


def generate(engine, prompts, **params) -> list[list[Completion]]:
    return asyncio.run(engine.generate(prompts, SamplingParams(**params)))


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each response token, from one unpadded forward over prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    return scaled.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def top2_margins(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward_with_left_padding(engine, ref_model, temperature):
    """Prompts of different lengths in one batch: each logprob equals log_softmax(logits/T) of an unpadded
    teacher-forced pass within atol 1e-5 (fp32)."""
    out = generate(engine, PROMPTS, n=2, temperature=temperature, max_new_tokens=12, seed=1)
    assert [len(group) for group in out] == [2] * len(PROMPTS)
    checked = 0
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert c.prompt_ids == prompt and len(c.response_ids) == len(c.logprobs) >= 1
            expected = teacher_forced_logprobs(ref_model, prompt, c.response_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
            checked += len(c.response_ids)
    assert checked > 30


def test_top_k_restricts_sampling_but_logprobs_stay_full_vocab(engine, ref_model):
    out = generate(engine, PROMPTS, n=2, temperature=1.0, top_k=3, max_new_tokens=8, seed=2)
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            with torch.no_grad():
                logits = ref_model(torch.tensor([prompt + c.response_ids])).logits[0, len(prompt) - 1 : -1]
            top3 = logits.topk(3, dim=-1).indices
            assert all(tok in top3[i] for i, tok in enumerate(c.response_ids))
            expected = teacher_forced_logprobs(ref_model, prompt, c.response_ids, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


def agree_until_near_tie(model, prompt, ours: list[int], theirs: list[int]) -> int:
    """Assert `ours` == `theirs` up to the first position whose top-2 logit margin is <= 1e-3 (where fp
    noise may legitimately flip the argmax); return how many positions were compared."""
    margins = top2_margins(model, prompt, theirs).tolist() if theirs else []
    compared = 0
    for i, margin in enumerate(margins):
        if margin <= 1e-3:
            break
        assert i < len(ours) and ours[i] == theirs[i], f"prompt {prompt}: greedy diverges at {i}"
        compared += 1
    else:
        assert ours == theirs
    return compared


def test_greedy_matches_hf_generate_token_for_token(engine, ref_model):
    compared = total = 0
    for prompt in PROMPTS:
        (c,) = generate(engine, [prompt], temperature=0.0, max_new_tokens=16)[0]
        with torch.no_grad():
            hf_out = ref_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=16, eos_token_id=EOS, pad_token_id=0
            )
        theirs = hf_out[0, len(prompt) :].tolist()
        compared += agree_until_near_tie(ref_model, prompt, c.response_ids, theirs)
        total += len(theirs)
        torch.testing.assert_close(
            torch.tensor(c.logprobs), teacher_forced_logprobs(ref_model, prompt, c.response_ids, 0.0), atol=1e-5, rtol=0
        )
    # measured: 64 of 64 tokens compared (no eos, no near tie); a margin rule may stop a prompt early elsewhere
    assert compared >= 48 and total == 4 * 16


def test_batched_greedy_equals_one_by_one_greedy(engine, ref_model):
    batched = generate(engine, PROMPTS, n=2, temperature=0.0, max_new_tokens=12)
    compared = 0
    for prompt, group in zip(PROMPTS, batched):
        (alone,) = generate(engine, [prompt], temperature=0.0, max_new_tokens=12)[0]
        for c in group:
            compared += agree_until_near_tie(ref_model, prompt, c.response_ids, alone.response_ids)
    assert compared >= 72  # measured: 96 of 96 (4 prompts x 2 samples x 12 tokens)


def test_one_forward_per_decode_step_for_the_whole_batch(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])  # nothing stops early
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 4] for i in range(8)]
    length = 10
    out = generate(engine, prompts, n=4, temperature=1.0, max_new_tokens=length)
    assert sum(len(group) for group in out) == 32
    assert all(len(c.response_ids) == length and c.finish_reason == "length" for g in out for c in g)
    # one prefill shared by the 4 samples of each prompt, then one decode forward per step for all 32 rows
    assert engine.num_prefill_forwards == 1 and engine.num_decode_forwards == length - 1
    assert engine.num_forwards == length
    assert engine.tokens_generated == 32 * length
    assert list(engine.scheduler.decode_batch_sizes) == [32] * (length - 1)


def test_stop_token_ends_only_its_sequence(engine):
    greedy = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=10)
    long_row = next(g[0] for g in greedy if g[0].finish_reason == "length")
    stop = long_row.response_ids[3]
    out = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=10, stop_token_ids=[stop])
    stopped = 0
    for before, (after,) in zip(greedy, out):
        ref = before[0].response_ids
        if stop in ref:
            cut = ref.index(stop) + 1
            assert after.response_ids == ref[:cut] and after.finish_reason == "stop"
            assert len(after.versions) == len(after.logprobs) == cut
            stopped += 1
        else:
            assert after.response_ids == ref and after.finish_reason == before[0].finish_reason
    assert stopped >= 1


def test_model_eos_ids_stop_like_stop_token_ids(engine, ref_model):
    greedy = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=10)
    stop = greedy[0][0].response_ids[3]
    as_eos = TorchEngine.from_model(ref_model, eos_token_ids=[stop])
    a = generate(as_eos, PROMPTS, temperature=0.0, max_new_tokens=10)
    b = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=10, stop_token_ids=[stop])
    # from a path the engine fuses q/k/v (one matmul), from_model does not: equal up to float rounding
    assert [(c.response_ids, c.finish_reason) for g in a for c in g] == [
        (c.response_ids, c.finish_reason) for g in b for c in g
    ]
    torch.testing.assert_close([c.logprobs for g in a for c in g], [c.logprobs for g in b for c in g],
                               atol=1e-5, rtol=0)


def test_ignore_eos_runs_past_the_model_eos_but_not_past_stop_token_ids(engine, ref_model):
    greedy = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=10)
    stop = greedy[0][0].response_ids[3]
    as_eos = TorchEngine.from_model(ref_model, eos_token_ids=[stop])
    stopped = generate(as_eos, [PROMPTS[0]], temperature=0.0, max_new_tokens=10)[0][0]
    assert stopped.finish_reason == "stop" and len(stopped.response_ids) == 4
    full = generate(as_eos, [PROMPTS[0]], temperature=0.0, max_new_tokens=10, ignore_eos=True)[0][0]
    assert full.finish_reason == "length" and full.response_ids[:4] == stopped.response_ids
    assert len(full.response_ids) == 10
    by_id = generate(as_eos, [PROMPTS[0]], temperature=0.0, max_new_tokens=10, ignore_eos=True, stop_token_ids=[stop])
    assert by_id[0][0].finish_reason == "stop" and len(by_id[0][0].response_ids) == 4


def test_generate_runs_off_the_event_loop(engine):
    async def main() -> int:
        task = asyncio.ensure_future(engine.generate(PROMPTS * 4, SamplingParams(n=4, max_new_tokens=48)))
        ticks = 0
        while not task.done():
            await asyncio.sleep(0.001)
            ticks += 1
        await task
        return ticks

    assert asyncio.run(main()) >= 2


def test_max_new_tokens_gives_length_finish(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[])
    (c,) = generate(engine, [PROMPTS[0]], temperature=1.0, max_new_tokens=5)[0]
    assert len(c.response_ids) == 5 and c.finish_reason == "length"


def test_long_prompt_keeps_its_last_tokens_and_is_flagged(model_dir):
    engine = TorchEngine(str(model_dir), max_prompt_len=4)
    long, short = PROMPTS[1], PROMPTS[0]
    out = generate(engine, [long, short], temperature=0.0, max_new_tokens=6)
    assert out[0][0].prompt_ids == long[-4:] and out[0][0].prompt_truncated
    assert out[1][0].prompt_ids == short and not out[1][0].prompt_truncated
    (direct,) = generate(engine, [long[-4:]], temperature=0.0, max_new_tokens=6)[0]
    assert direct.response_ids == out[0][0].response_ids


def test_n_samples_share_the_prompt_and_differ(engine):
    (group,) = generate(engine, [PROMPTS[1]], n=3, temperature=1.0, max_new_tokens=12)
    assert len(group) == 3 and all(c.prompt_ids == PROMPTS[1] for c in group)
    assert len({tuple(c.response_ids) for c in group}) > 1


def test_request_seed_reproduces_samples_and_engine_seed_varies_them(model_dir):
    a, b = TorchEngine(str(model_dir), seed=0), TorchEngine(str(model_dir), seed=1)
    params = dict(n=2, temperature=1.0, max_new_tokens=12)
    assert generate(a, PROMPTS, seed=7, **params) == generate(b, PROMPTS, seed=7, **params)
    assert generate(a, PROMPTS, **params) != generate(b, PROMPTS, **params)


def test_load_weights_stamps_new_version_and_changes_outputs(engine, ref_model):
    before = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=8)
    assert engine.version == 0 and all(set(c.versions) == {0} for g in before for c in g)
    gen = torch.Generator().manual_seed(0)
    # named_parameters() lists a tied tensor once: a partial dict of the state_dict names
    perturbed = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in ref_model.named_parameters()}
    engine.load_weights(perturbed, version=3)
    after = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=8)
    assert engine.version == 3 and all(set(c.versions) == {3} for g in after for c in g)
    assert [c.logprobs for g in after for c in g] != [c.logprobs for g in before for c in g]
    # the engine now computes what the perturbed weights compute
    ref_model_state = {k: v.clone() for k, v in ref_model.state_dict().items()}
    try:
        ref_model.load_state_dict(perturbed, strict=False)
        c = after[1][0]
        expected = teacher_forced_logprobs(ref_model, c.prompt_ids, c.response_ids, 0.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
    finally:
        ref_model.load_state_dict(ref_model_state)


def test_load_weights_accepts_either_tied_name_or_a_subset(engine):
    emb = engine.model.get_input_embeddings().weight
    assert engine.model.lm_head.weight.data_ptr() == emb.data_ptr()  # qwen2 tiny model ties them
    new = torch.randn(emb.shape)
    engine.load_weights({"lm_head.weight": new}, version=1)
    assert torch.equal(emb, new)
    engine.load_weights({"lm_head.weight": new * 2, "model.embed_tokens.weight": new * 2}, version=2)
    assert torch.equal(emb, new * 2) and engine.version == 2
    with pytest.raises(ValueError, match="tied"):
        engine.load_weights({"lm_head.weight": new, "model.embed_tokens.weight": new * 3}, version=4)


def test_load_weights_keeps_no_reference_to_the_callers_tensors(engine, ref_model):
    """A weight receiver reuses its staging memory for the next sync only once nothing views the last one's
    tensors: once load_weights returned, the engine (its scheduler's thread, idle or generating) holds none."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def staged() -> tuple[dict[str, torch.Tensor], StorageWeakRef]:
        flat = torch.cat([p.detach().reshape(-1) for _, p in ref_model.named_parameters()])
        views, at = {}, 0
        for name, p in ref_model.named_parameters():
            views[name] = flat[at:at + p.numel()].view(p.shape)
            at += p.numel()
        return views, StorageWeakRef(flat.untyped_storage())

    tensors, ref = staged()
    engine.load_weights(tensors, version=1)  # idle: lands at once, the thread then waits for work
    del tensors
    assert ref.expired()
    generate(engine, PROMPTS, temperature=0.0, max_new_tokens=2)
    tensors, ref = staged()
    engine.load_weights(tensors, version=2)
    del tensors
    assert ref.expired() and engine.version == 2


def test_load_weights_rejects_bad_shape_or_name_without_copying(engine):
    norm = engine.model.model.norm.weight
    original = norm.clone()
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \(3,\).*\(32,\)"):
        engine.load_weights({"model.embed_tokens.weight": torch.zeros(47, 32), "model.norm.weight": torch.zeros(3)}, 5)
    with pytest.raises(ValueError, match="unknown tensor 'not.a.param'"):
        engine.load_weights({"model.norm.weight": torch.zeros(32), "not.a.param": torch.zeros(1)}, 5)
    assert torch.equal(norm, original) and engine.version == 0


def test_from_model_shares_weights_and_restores_training_mode(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[EOS])
    assert engine.model is ref_model
    ref_model.train()
    try:
        generate(engine, [PROMPTS[0]], temperature=0.0, max_new_tokens=3)
        assert ref_model.training
    finally:
        ref_model.eval()


@pytest.mark.parametrize(
    "bad", [dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0), dict(n=0)]
)
def test_bad_sampling_params_raise_value_error(engine, bad):
    with pytest.raises(ValueError, match="SamplingParams"):
        generate(engine, PROMPTS, **bad)
    assert engine.num_forwards == 0


def test_bad_prompts_raise_value_error(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(engine, [[5], []])
    with pytest.raises(ValueError, match="outside"):
        generate(engine, [[5, 10_000]])


def test_generate_after_close_fails(engine):
    asyncio.run(engine.close())
    with pytest.raises(RuntimeError, match="close"):
        generate(engine, PROMPTS)


def test_create_engine_builds_registered_torch_engine(model_dir):
    engine = create_engine("torch", model_path=str(model_dir), seed=3)
    assert isinstance(engine, TorchEngine) and isinstance(engine, RolloutEngine)
    assert {"torch", "vllm", "sglang"} <= set(available_engines())


def test_unknown_engine_name_lists_known_names():
    with pytest.raises(KeyError, match="unknown rollout engine 'tensorrt'.*sglang, torch, vllm"):
        create_engine("tensorrt")


def test_importing_engines_base_imports_no_optional_engine():
    code = (
        "import sys, engines.base\n"
        "bad = [m for m in ('vllm', 'sglang', 'engines.torch_engine', 'engines.vllm_engine') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.build_tiny_model(path, TinyModelConfig(arch="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1,
                                              intermediate_size=64, init_std=0.2, seed=3))
    return path


@pytest.mark.parametrize("arch,fast", [("llama", None), ("qwen2", False)])
def test_logprobs_match_teacher_forced_forward_llama_and_hf_fallback(model_dir, llama_dir, arch, fast):
    """The same check on Llama (untied head, 4:1 GQA) through the fast path, and on the HF fallback path."""
    path = llama_dir if arch == "llama" else model_dir
    engine = TorchEngine(str(path), fast=fast)
    assert engine.fast is (fast is None)
    ref = hf.load_model(path)
    out = generate(engine, PROMPTS, n=2, temperature=0.7, max_new_tokens=10, seed=3)
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            expected = teacher_forced_logprobs(ref, prompt, c.response_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


def test_hf_fallback_greedy_equals_fast_path(model_dir, engine, ref_model):
    slow = TorchEngine(str(model_dir), fast=False)
    fast_out = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=10)
    slow_out = generate(slow, PROMPTS, temperature=0.0, max_new_tokens=10)
    compared = 0
    for prompt, (a,), (b,) in zip(PROMPTS, fast_out, slow_out):
        compared += agree_until_near_tie(ref_model, prompt, a.response_ids, b.response_ids)
    assert compared >= 30  # measured: 40 of 40 (4 prompts x 10 tokens)


def test_stop_string_ends_the_sequence_once_the_text_contains_it(model_dir, ref_model):
    tok = hf.load_tokenizer(model_dir)
    engine = TorchEngine(str(model_dir))  # loads the folder's tokenizer for stop strings
    (free,) = generate(engine, [PROMPTS[1]], temperature=0.0, max_new_tokens=12)[0]
    text = tok.decode(free.response_ids, skip_special_tokens=True)
    assert len(text) >= 6
    stop = text[3:5]
    (c,) = generate(engine, [PROMPTS[1]], temperature=0.0, max_new_tokens=12, stop=[stop, "never-there"])[0]
    got = tok.decode(c.response_ids, skip_special_tokens=True)
    assert c.finish_reason == "stop" and stop in got and stop not in tok.decode(c.response_ids[:-1])
    assert c.response_ids == free.response_ids[: len(c.response_ids)] and len(c.response_ids) <= 5
    # from_model takes a detokenize callable instead
    shared = TorchEngine.from_model(ref_model, eos_token_ids=[EOS], detokenize=lambda ids: tok.decode(ids))
    assert generate(shared, [PROMPTS[1]], temperature=0.0, max_new_tokens=12, stop=[stop])[0][0].response_ids == (
        c.response_ids
    )


def test_stop_strings_without_a_detokenizer_are_an_error(ref_model):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[EOS])
    with pytest.raises(ValueError, match="detokenize"):
        generate(engine, PROMPTS, stop=["x"])


@pytest.mark.parametrize("bad,match", [(dict(stop=[""]), "SamplingParams.stop"), (dict(n=5), "max_batch"),
                                       (dict(top_k=-2), "top_k")])
def test_more_bad_sampling_params_raise_value_error(ref_model, bad, match):
    engine = TorchEngine.from_model(ref_model, eos_token_ids=[EOS], max_batch=4)
    with pytest.raises(ValueError, match=match):
        generate(engine, PROMPTS, **bad)


@pytest.mark.parametrize("bad", [dict(max_batch=0), dict(kv_on_update="sometimes"), dict(max_prefill_tokens=0)])
def test_bad_engine_options_raise_value_error(ref_model, bad):
    with pytest.raises(ValueError, match="TorchEngine"):
        TorchEngine.from_model(ref_model, eos_token_ids=[EOS], **bad)


def test_unknown_engine_option_names_the_known_ones(ref_model):
    with pytest.raises(TypeError, match="unknown option.*max_bach.*known: .*max_batch"):
        TorchEngine.from_model(ref_model, eos_token_ids=[EOS], max_bach=4)


def test_unsupported_model_falls_back_with_a_warning(caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=47, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                                         rope_scaling={"rope_type": "linear", "factor": 2.0})).eval()
    with caplog.at_level("WARNING", logger="engines.torch_engine"):
        engine = TorchEngine.from_model(model, eos_token_ids=[])
    assert not engine.fast and "fallback" in caplog.text and "linear" in caplog.text
    (c,) = generate(engine, [PROMPTS[1]], temperature=1.0, max_new_tokens=6, seed=0)[0]
    expected = teacher_forced_logprobs(model, PROMPTS[1], c.response_ids, 1.0)
    torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


# `-m gpu` selects the CUDA cases (.device/check.sh runs them on a GPU machine)
STATIC_MODES = ["cpu-static"] + ([pytest.param("cuda-graphs", marks=pytest.mark.gpu)]
                                 if torch.cuda.is_available() else [])


def static_engine(model_dir, mode: str) -> TorchEngine:
    """cpu-static: the fixed-shape decode step a CUDA graph captures, run eagerly; cuda-graphs: the engine's
    default on a CUDA device (captured and replayed)."""
    if mode == "cuda-graphs":
        engine = TorchEngine(str(model_dir), seed=0, device="cuda")
        assert engine.scheduler.backend.graphs == "cuda"
        return engine
    engine = TorchEngine(str(model_dir), seed=0)
    engine.scheduler.backend.graphs = "eager"
    return engine


@pytest.mark.parametrize("mode", STATIC_MODES)
def test_static_decode_logprobs_and_in_flight_swap(model_dir, ref_model, mode):
    """Through the scheduler (mixed prompt lengths, n = 2, sequences finishing at different steps, so the
    batch bucket shrinks): every logprob equals the teacher-forced pass; after a weight swap the captured
    step computes with the new weights."""
    engine = static_engine(model_dir, mode)
    try:
        out = generate(engine, PROMPTS, n=2, temperature=1.0, max_new_tokens=12, seed=1)
        for prompt, group in zip(PROMPTS, out):
            for c in group:
                expected = teacher_forced_logprobs(ref_model, prompt, c.response_ids, 1.0)
                torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
        gen = torch.Generator().manual_seed(0)
        perturbed = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in ref_model.named_parameters()}
        engine.load_weights(perturbed, version=1)
        after = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=8)
        saved = {k: v.clone() for k, v in ref_model.state_dict().items()}
        try:
            ref_model.load_state_dict(perturbed, strict=False)
            for prompt, group in zip(PROMPTS, after):
                c = group[0]
                assert set(c.versions) == {1}
                expected = teacher_forced_logprobs(ref_model, prompt, c.response_ids, 0.0)
                torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)
        finally:
            ref_model.load_state_dict(saved)
        assert engine.scheduler.backend._static  # decode went through the static step
    finally:
        asyncio.run(engine.close())


def test_cuda_graphs_option_is_refused_without_cuda(model_dir):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        TorchEngine(str(model_dir), cuda_graphs=True)


def test_submit_many_posts_its_calls_together_and_each_gives_what_its_own_generate_would(model_dir):
    """The calls of `submit_many` reach the engine at once: they are prefilled in one forward and decoded in one
    batch, however long the caller takes to await them; each call's samples (seeded) are those of a `generate`
    of its own. A call that fails validation raises before anything is posted."""
    calls = [([p], SamplingParams(n=2, max_new_tokens=3, temperature=1.0, seed=7 + i)) for i, p in enumerate(PROMPTS)]

    async def together(engine):
        waits = engine.submit_many(calls)
        await asyncio.sleep(0.05)  # a slow caller: the calls are in the engine's inbox already
        return await asyncio.gather(*waits)

    engine = TorchEngine(str(model_dir), seed=0)
    out = asyncio.run(together(engine))
    assert engine.scheduler.num_prefill_forwards == 1 and engine.scheduler.decode_batch_sizes[0] == 2 * len(PROMPTS)
    alone = TorchEngine(str(model_dir), seed=0)
    for (prompts, params), got in zip(calls, out):
        want = asyncio.run(alone.generate(prompts, params))
        assert [c.response_ids for c in got[0]] == [c.response_ids for c in want[0]]

    too_many = [calls[0], ([PROMPTS[1]], SamplingParams(n=10**6, max_new_tokens=1))]
    before = engine.scheduler.num_prefill_forwards

    async def refused():
        with pytest.raises(ValueError, match="max_batch"):
            engine.submit_many(too_many)
        await asyncio.sleep(0.05)

    asyncio.run(refused())
    assert engine.scheduler.num_prefill_forwards == before  # nothing was posted
