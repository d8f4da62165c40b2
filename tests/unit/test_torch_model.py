"""engines.torch_model and engines.hf_fallback: the fast slot-cache forward computes HF's logits (Qwen2 and
Llama, GQA, prompts of different lengths, batched prefill and step-by-step decode, slot moves, cache
growth, fused weights, replaced parameters), and configs it does not cover go to the HF fallback, which is
exact too."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engines.hf_fallback import HFDecoder
from engines.torch_model import SlotDecoder, unsupported_reason

torch.set_num_threads(1)

ATOL = 1e-5  # fp32; logits of these models are O(1-10)
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34]]
COMMON = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              initializer_range=0.2)


def make(arch: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "qwen2":  # biased q/k/v, tied head, 2:1 GQA
        cfg = Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **{**COMMON, **overrides})
        return Qwen2ForCausalLM(cfg).eval()
    # untied head, 4:1 GQA, a non-default rope_theta
    cfg = LlamaConfig(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=500.0, **{**COMMON, **overrides})
    return LlamaForCausalLM(cfg).eval()


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def decode_against_hf(model, backend, steps: int = 6) -> None:
    """Prefill PROMPTS (the 2nd prompt shared by 2 slots), then decode step by step over all slots and
    compare every row's logits with HF's unpadded forward of the same sequence."""
    repeats = [1, 2, 1, 1]
    backend.capacity(8, 64)
    with torch.inference_mode():
        logits = backend.prefill(PROMPTS, 0, repeats)
    for p, row in zip(PROMPTS, logits):
        torch.testing.assert_close(row, hf_last_logits(model, p), atol=ATOL, rtol=0)
    seqs = [list(p) for p, r in zip(PROMPTS, repeats) for _ in range(r)]
    for step in range(steps):
        toks = [(7 * step + 3 * j + 4) % 50 for j in range(len(seqs))]
        with torch.inference_mode():
            out = backend.decode(torch.tensor(toks))
        for j, seq in enumerate(seqs):
            seq.append(toks[j])
            torch.testing.assert_close(out[j], hf_last_logits(model, seq), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("fuse", [False, True])
def test_fast_forward_logits_equal_hf_prefill_and_decode(arch, fuse):
    model = make(arch)
    backend = SlotDecoder(model, torch.device("cpu"), fuse=fuse)
    assert unsupported_reason(model) is None
    decode_against_hf(model, backend)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_full_sequence_logits_equal_hf(arch):
    model = make(arch)
    backend = SlotDecoder(model, torch.device("cpu"))
    ids = [3, 9, 27, 31, 12, 8, 44, 1, 5]
    with torch.inference_mode():
        ours = backend.forward_logits(ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_fused_weights_are_the_module_parameters():
    """fuse=True moves q/k/v and gate/up into one buffer each; the Parameters become views of it, so a write
    into a parameter (what load_weights does) reaches the fused matmul, and HF's own forward is unchanged."""
    model = make("qwen2")
    before = hf_last_logits(model, PROMPTS[1])
    params = dict(model.named_parameters())
    backend = SlotDecoder(model, torch.device("cpu"), fuse=True)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(model.get_parameter(k) is p for k, p in params.items())  # same Parameter objects
    torch.testing.assert_close(hf_last_logits(model, PROMPTS[1]), before, atol=0, rtol=0)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.data.add_(0.5)
        attn.v_proj.bias.data.add_(0.5)
        model.model.layers[1].mlp.up_proj.weight.data.mul_(2.0)
    decode_against_hf(model, backend, steps=2)


def test_shared_module_updates_are_seen_without_copying():
    """Without fusing nothing is copied: an in-place optimizer-style update shows in the next forward."""
    model = make("llama")
    backend = SlotDecoder(model, torch.device("cpu"))
    backend.capacity(4, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    with torch.inference_mode():
        (logits,) = backend.prefill([PROMPTS[1]], 0, [1])
    torch.testing.assert_close(logits, hf_last_logits(model, PROMPTS[1]), atol=ATOL, rtol=0)


def test_moving_a_slot_and_growing_the_cache_keep_the_sequence():
    model = make("qwen2")
    backend = SlotDecoder(model, torch.device("cpu"))
    backend.capacity(2, 8)
    with torch.inference_mode():
        backend.prefill([PROMPTS[0], PROMPTS[1]], 0, [1, 1])
        backend.move(1, 0)  # slot 0 retires, slot 1 takes its place
        seq = list(PROMPTS[1])
        for step in range(5):  # crosses the initial max_len of 8: grow mid-sequence
            backend.capacity(4, 8 + 4 * step)
            tok = 6 + step
            (out,) = backend.decode(torch.tensor([tok]))
            seq.append(tok)
            torch.testing.assert_close(out, hf_last_logits(model, seq), atol=ATOL, rtol=0)
    assert backend.slots == 4 and backend.max_len == 24


def test_unsupported_configs_are_named():
    assert "rope_scaling" in unsupported_reason(make("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    sliding = make("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding" in unsupported_reason(sliding)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in unsupported_reason(gpt2)


@pytest.mark.parametrize("kind", ["linear_rope", "gpt2"])
def test_hf_fallback_logits_equal_hf(kind):
    if kind == "gpt2":
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2)).eval()
    else:
        model = make("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    decode_against_hf(model, HFDecoder(model, torch.device("cpu")), steps=3)


@pytest.mark.parametrize("fuse", [False, True])
def test_a_replaced_parameter_is_used_from_the_next_refresh(fuse):
    model = make("qwen2")
    backend = SlotDecoder(model, torch.device("cpu"), fuse=fuse)
    attn = model.model.layers[1].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach() + 0.5)  # a new object, not a write
    attn.k_proj.bias = torch.nn.Parameter(attn.k_proj.bias.detach() - 0.5)
    backend.refresh()
    decode_against_hf(model, backend, steps=2)


def test_decode_batch_wider_than_the_cache_length():
    """More running slots than cache positions (e.g. 128 short sequences in a 64-long cache): every slot
    still gets its own K/V row and HF's logits (a slot index once came from the position table)."""
    model = make("qwen2")
    backend = SlotDecoder(model, torch.device("cpu"), fuse=True)
    n = 80
    backend.capacity(n, 8)
    assert backend.max_len < n
    contexts = [[1 + j % 40, 2 + j % 7] for j in range(n)]
    with torch.inference_mode():
        backend.prefill(contexts, 0, [1] * n)
        toks = torch.tensor([(3 * j) % 50 for j in range(n)])
        out = backend.decode(toks)
    for j in (0, 41, n - 1):
        torch.testing.assert_close(out[j], hf_last_logits(model, contexts[j] + [int(toks[j])]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fuse", [False, True])
def test_equal_length_slots_decode_without_a_mask_and_equal_hf(fuse):
    """When every running slot holds the same number of tokens (the n samples of a prompt, or prompts of one
    length) decode skips the padding mask; the logits still equal HF's, before and after lengths diverge."""
    model = make("qwen2")
    backend = SlotDecoder(model, torch.device("cpu"), fuse=fuse)
    backend.capacity(4, 16)
    prompts = [[5, 6, 7], [9, 8, 7]]
    with torch.inference_mode():
        backend.prefill(prompts, 0, [2, 1])  # slots 0, 1: prompt 0 twice; slot 2: prompt 1 (same length)
        assert backend._decode_tables(3).mask is None
        seqs = [list(prompts[0]), list(prompts[0]), list(prompts[1])]
        for step in range(3):
            toks = [11 + step, 20 + step, 30 + step]
            out = backend.decode(torch.tensor(toks))
            for j, seq in enumerate(seqs):
                seq.append(toks[j])
                torch.testing.assert_close(out[j], hf_last_logits(model, seq), atol=ATOL, rtol=0)
        backend.move(2, 1)  # slot 1 retires: slot 0 and the moved slot keep equal lengths
        assert backend._decode_tables(2).mask is None
        backend.prefill([[1, 2]], 2, [1])  # a shorter newcomer: the mask is back
        assert backend._decode_tables(3).mask is not None
        seqs = [seqs[0], seqs[2], [1, 2]]
        out = backend.decode(torch.tensor([3, 4, 5]))
    for j, (seq, tok) in enumerate(zip(seqs, [3, 4, 5])):
        torch.testing.assert_close(out[j], hf_last_logits(model, seq + [tok]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fuse", [False, True])
def test_biased_output_and_down_projections_and_a_non_silu_mlp_equal_hf(fuse):
    """Llama with attention_bias and mlp_bias (o_proj and down_proj add their bias after the matmul instead
    of accumulating into the residual in place) and a GELU MLP (no in-place SiLU)."""
    model = make("llama", attention_bias=True, mlp_bias=True, hidden_act="gelu")
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert model.model.layers[0].mlp.down_proj.bias is not None
    decode_against_hf(model, SlotDecoder(model, torch.device("cpu"), fuse=fuse), steps=3)


def test_kv_only_prefill_writes_every_layers_cache():
    """prefill(logits=False) (the K/V recompute after a weight swap) stops after the last layer's K/V: it
    returns nothing, and decoding from the cache it wrote still gives HF's logits."""
    model = make("llama", num_hidden_layers=3)
    backend = SlotDecoder(model, torch.device("cpu"), fuse=True)
    backend.capacity(2, 16)
    with torch.inference_mode():
        assert backend.prefill([PROMPTS[1], PROMPTS[3]], 0, [1, 1], logits=False) is None
        out = backend.decode(torch.tensor([40, 41]))
    for j, (p, tok) in enumerate(zip([PROMPTS[1], PROMPTS[3]], [40, 41])):
        torch.testing.assert_close(out[j], hf_last_logits(model, p + [tok]), atol=ATOL, rtol=0)


# ---- static decode (the step a CUDA graph captures): checked eagerly on CPU, captured on CUDA ----------

# `-m gpu` selects the CUDA cases (.device/check.sh runs them on a GPU machine)
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def static_backend(model, device: str, fuse: bool = True) -> SlotDecoder:
    return SlotDecoder(model.to(device), torch.device(device), fuse=fuse, graphs="eager" if device == "cpu" else "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_static_decode_equals_hf(arch, device):
    """Fixed shapes: 5 running slots padded to 8 rows, attention over the whole cache under a length mask
    (prompts of different lengths), and the same logits as HF's forward."""
    model = make(arch)
    backend = static_backend(model, device)
    model_cpu = make(arch)  # HF reference on the CPU (the same seed: the same weights)
    repeats = [1, 2, 1, 1]
    backend.capacity(8, 64)
    seqs = [list(p) for p, r in zip(PROMPTS, repeats) for _ in range(r)]
    with torch.inference_mode():
        backend.prefill(PROMPTS, 0, repeats)
        for step in range(4):
            toks = [(7 * step + 3 * j + 4) % 50 for j in range(len(seqs))]
            out = backend.decode(torch.tensor(toks, device=device)).cpu()
            for j, seq in enumerate(seqs):
                seq.append(toks[j])
                torch.testing.assert_close(out[j], hf_last_logits(model_cpu, seq), atol=ATOL, rtol=0)
    assert set(backend._static) == {8}
    assert backend.num_graph_captures == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_static_decode_buckets_moves_growth_and_weight_writes(device):
    """Batch sizes 3 -> 2 -> 1 use buckets 4, 2, 1; a slot move keeps the sequence; an in-place weight write
    (what load_weights does) is computed by the captured step; growing the cache drops the captured steps;
    a replaced Parameter drops them at the next refresh."""
    model = make("qwen2")
    backend = static_backend(model, device)
    ref = make("qwen2")
    backend.capacity(4, 16)
    prompts = [[5, 6, 7], [9, 8], [1, 2, 3, 4]]
    seqs = [list(p) for p in prompts]

    def step(toks):
        out = backend.decode(torch.tensor(toks, device=device)).cpu()
        for j, tok in enumerate(toks):
            seqs[j].append(tok)
            torch.testing.assert_close(out[j], hf_last_logits(ref, seqs[j]), atol=ATOL, rtol=0)

    with torch.inference_mode():
        backend.prefill(prompts, 0, [1, 1, 1])
        step([11, 12, 13])
        backend.move(2, 0)  # slot 0 retires; slot 2's sequence moves into it
        seqs[0] = seqs.pop(2)
        step([14, 15])
        with torch.no_grad():  # in place, as load_weights copies: the same addresses, new values
            for p_dev, p_ref in zip(model.parameters(), ref.parameters()):
                p_ref.add_(0.01)
                p_dev.copy_(p_ref)
        backend.refresh()
        assert backend._static  # still valid: nothing moved
        # the K/V in the cache are the old weights'; recompute them as the scheduler does after a swap
        backend.prefill([list(s) for s in seqs], 0, [1, 1], logits=False)
        step([16, 17])
        seqs.pop(1)
        step([18])
    assert set(backend._static) == {4, 2, 1}
    backend.capacity(4, 80)
    assert not backend._static
    with torch.inference_mode():
        backend.decode(torch.tensor([1], device=device))
        attn = model.model.layers[0].self_attn
        attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.detach() * 1.0)
        backend.refresh()
    assert not backend._static


def test_cuda_graphs_option_needs_cuda():
    model = make("qwen2")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        SlotDecoder(model, torch.device("cpu"), graphs="cuda")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fp32_head_on_bf16_weights_gives_the_logits_before_their_bf16_rounding_and_follows_weight_writes(arch):
    """rollout.lm_head_fp32: on bf16 weights the fast path's logits come from a float32 copy of the head — the
    values the bf16 head rounds (at a real model's logit scale, by up to 1/16) — and a weight write followed by
    `refresh` (what every swap does) reaches that copy."""
    model = make(arch)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits in the tens, as a trained LM's
    model = model.to(torch.bfloat16)
    wide, plain = (SlotDecoder(model, torch.device("cpu"), fp32_head=on) for on in (True, False))

    def logits(backend):
        backend.capacity(4, 32)
        with torch.inference_mode():
            return backend.prefill([PROMPTS[1], PROMPTS[3]], 0, [1, 1])

    for _ in range(2):
        got, rounded = logits(wide), logits(plain)
        assert got.dtype == torch.float32 and rounded.dtype == torch.bfloat16
        assert got.abs().max() > 8  # the scale where bf16 rounding costs hundredths
        torch.testing.assert_close(rounded.float(), got.bfloat16().float(), atol=0, rtol=2 ** -7)
        assert not torch.equal(got, got.bfloat16().float())  # float32 values bf16 cannot hold
        with torch.no_grad():  # a weight write, as an engine's load_weights does, then the swap's refresh
            model.lm_head.weight.add_(0.25 * torch.randn(model.lm_head.weight.shape).bfloat16())
        for backend in (wide, plain):
            backend.refresh()
    assert not SlotDecoder(make(arch), torch.device("cpu"), fp32_head=True).fp32_head  # float32 weights: nothing to do
