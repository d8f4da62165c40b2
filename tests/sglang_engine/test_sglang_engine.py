"""SGLangEngine against a REAL SGLang (marked `sglang`; skipped where SGLang or CUDA is absent).

These tests have never run: no machine available to this project can install SGLang. They are the same
behavioural checks as tests/unit/test_sglang_contract.py (which runs them against a stand-in), on a real
`sglang.Engine` with a tiny Qwen2 model written offline:
* greedy output equals HF `generate` greedy token for token (float32 on both sides; the model is
  initialised with a large std so that no step is a near tie);
* returned logprobs equal a teacher-forced HF forward, log_softmax(logits / T), within 2e-3 (float32;
  GPU matmul and attention kernels differ from HF's);
* a weight update through SGLang's weight-update group (trainer side: `join_sglang_sender` +
  `PerTensorSender`, gloo — two NCCL ranks cannot share one GPU) changes the outputs to those of the new
  weights and stamps the new version; the same through `load_weights` (update_weights_from_tensor).
Run: pytest tests/sglang -m sglang (about a minute: one SGLang start per module).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

# A submodule, not the top-level package: skips cleanly wherever the SGLang server code is absent.
pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")

from asyncrl.config.schema import TinyModelConfig  # noqa: E402
from asyncrl.messages import SamplingParams  # noqa: E402
from engines.hf import build_tiny_model, load_model, load_tokenizer  # noqa: E402
from engines.sglang_engine import SGLangEngine  # noqa: E402
from transports.bucketing import plan_buckets  # noqa: E402
from transports.collective import create_store  # noqa: E402
from transports.sglang import PerTensorSender, join_sglang_sender  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang needs CUDA")]

LOGPROB_TOL = 2e-3
TIMEOUT_S = 120.0
GROUP = "asyncrl_test_weights"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sglang") / "tiny"
    # head_dim 64 (hidden 128 / 2 heads): a size every SGLang attention backend supports.
    build_tiny_model(path, TinyModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                                           intermediate_size=256, vocab="0123456789+=", init_std=0.2))
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = SGLangEngine(str(model_dir), dtype="float32", max_prompt_len=64, seed=0, group_name=GROUP,
                       mem_fraction_static=0.3, disable_cuda_graph=True, attention_backend="torch_native")
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def prompt(model_dir):
    return load_tokenizer(model_dir).encode("12+34=", add_special_tokens=False)


def run(engine, prompt, **params):
    ((c,),) = asyncio.run(engine.generate([prompt], SamplingParams(**params)))
    return c


@torch.no_grad()
def hf_greedy(model, prompt, steps):
    return model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()


@torch.no_grad()
def teacher_forced(model, prompt, response, temperature):
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.1 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def check_against(model, engine, prompt, version):
    greedy = run(engine, prompt, temperature=0.0, max_new_tokens=8)
    assert greedy.response_ids == hf_greedy(model, prompt, 8)
    assert greedy.logprobs == pytest.approx(teacher_forced(model, prompt, greedy.response_ids, 1.0), abs=LOGPROB_TOL)
    sampled = run(engine, prompt, temperature=0.7, max_new_tokens=8)
    assert sampled.logprobs == pytest.approx(teacher_forced(model, prompt, sampled.response_ids, 0.7),
                                             abs=LOGPROB_TOL)
    assert greedy.versions == [version] * len(greedy.response_ids)


def test_greedy_and_logprobs_match_hf(engine, model_dir, prompt):
    check_against(load_model(model_dir, dtype="float32"), engine, prompt, engine.version)


def test_update_through_the_weight_group(engine, model_dir, prompt):
    model = load_model(model_dir, dtype="float32")
    meta = plan_buckets(dict(model.named_parameters()), 1 << 20)
    store, port = create_store(2, TIMEOUT_S)
    box = {}

    def trainer_join():
        box["sender"] = PerTensorSender(join_sglang_sender(store=store, world_size=2, backend="gloo",
                                                           timeout_s=TIMEOUT_S, group_name=GROUP), meta)

    async def join_and_send(new):
        await asyncio.gather(asyncio.to_thread(trainer_join), engine.join_weight_group(
            host="127.0.0.1", port=port, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S, meta=meta))
        _, (version, stats) = await asyncio.gather(asyncio.to_thread(box["sender"].send, new, 5),
                                                   engine.receive_weights())
        return version, stats

    new = perturbed(model, seed=1)
    version, stats = asyncio.run(join_and_send(new))
    assert version == 5 == engine.version and stats["sync/bytes"] == meta.total_bytes
    model.load_state_dict(new, strict=False)
    check_against(model, engine, prompt, 5)


def test_load_weights_through_update_from_tensor(engine, model_dir, prompt):
    model = load_model(model_dir, dtype="float32")
    new = perturbed(model, seed=2)
    engine.load_weights(new, 9)
    model.load_state_dict(new, strict=False)
    check_against(model, engine, prompt, 9)
