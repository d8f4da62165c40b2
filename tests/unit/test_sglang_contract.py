"""Contract tests of engines.sglang_engine.SGLangEngine against `FakeSGLangEngine`, a STAND-IN for SGLang.

SGLang cannot run on any machine available to this project, so these tests check the adapter against a
stand-in that follows SGLang's documented request/response shapes and its weight-update procedure; the
same behaviour against a real SGLang is in tests/sglang_engine/ (skipped where SGLang is absent). What the
stand-in reproduces, and from which SGLang source:
* `async_generate(input_ids=, sampling_params=, return_logprob=, logprob_start_len=, ...)` with SGLang's
  keyword names (unknown ones are a TypeError), sampling-param keys checked against SGLang's
  `SamplingParams` fields, one output dict per input: {"text", "output_ids", "meta_info": {"finish_reason":
  {"type": "stop", "matched": ...} | {"type": "length", "length": n}, "output_token_logprobs": [(logprob,
  token_id, None)], "prompt_tokens", "completion_tokens"}};
* SGLang's sampler: temperature 0 becomes top_k = 1 at T = 1; logprobs are log(softmax(logits / T))
  renormalised over the top-p nucleus; stop strings need the tokenizer (ValueError otherwise);
* `init_weights_update_group` exactly as SGLang's model runner: torch tcp:// rendezvous, PrefixStore(group_name),
  torch's `_new_process_group_helper`; `update_weights_from_distributed`: torch.empty(shape, dtype) + one
  `dist.broadcast(src=0, async_op=True)` per tensor, then load by name — a real gloo group, so the
  trainer-side `PerTensorSender` is exercised over the wire;
* `flush_cache` (counted) and SGLang's (success, message) control results.
It is backed by the tiny HF model, so its token ids and logprobs are real. It is stricter than SGLang in
one place: an update while a request runs is an error (SGLang would wait), which checks the adapter's own
between-request gating.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncrl.messages import SamplingParams
from engines.base import CollectiveWeightEngine, RolloutEngine, create_engine
from engines.hf import eos_token_ids, load_model, load_tokenizer
from engines.sglang_engine import SGLangEngine, SGLangResponseError
from transports.bucketing import plan_buckets
from transports.collective import create_store
from transports.sglang import PerTensorSender, broadcast_per_tensor, join_sglang_sender

TIMEOUT_S = 20.0
# The API fields of SGLang's SamplingParams (sglang/srt/sampling/sampling_params.py).
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}


@dataclasses.dataclass
class FlushCacheReqOutput:  # SGLang's tokenizer_manager.flush_cache() result
    success: bool


class FakeSGLangEngine:
    """STAND-IN for sglang.Engine as SGLangEngine drives it (see the module docstring); not SGLang."""

    def __init__(self, *, model_path: str, dtype: str = "auto", random_seed: int = 0,
                 skip_tokenizer_init: bool = False, **server_args: Any) -> None:
        self.kwargs = {"model_path": model_path, "dtype": dtype, "random_seed": random_seed,
                       "skip_tokenizer_init": skip_tokenizer_init, **server_args}
        self.model = load_model(model_path, dtype="float32")
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(model_path)
        self.eos = set(eos_token_ids(model_path))
        self.generator = torch.Generator().manual_seed(random_seed)
        self.requests: list[dict[str, Any]] = []
        self.control: list[tuple[str, dict[str, Any]]] = []
        self.flush_count = 0
        self.active = 0
        self.hold: asyncio.Event | None = None  # a test may hold generation until it sets this
        self.groups: dict[str, Any] = {}
        self.shut_down = False

    # -- generation ------------------------------------------------------------------------------------
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                             return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                             token_ids_logprob=None, lora_path=None, custom_logit_processor=None,
                             return_hidden_states=False, stream=False, rid=None):
        self.requests.append({"input_ids": input_ids, "sampling_params": sampling_params,
                              "return_logprob": return_logprob, "logprob_start_len": logprob_start_len})
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(batch)
        self.active += 1
        try:
            if self.hold is not None:
                await self.hold.wait()
            outs = await asyncio.to_thread(lambda: [self._one(p, s, return_logprob) for p, s in zip(batch, params)])
        finally:
            self.active -= 1
        return outs[0] if single else outs

    @torch.no_grad()
    def _one(self, prompt: list[int], sp: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
        unknown = set(sp) - SGLANG_SAMPLING_KEYS
        if unknown:
            raise TypeError(f"Unexpected keyword argument(s) {sorted(unknown)} for SamplingParams")
        temperature, top_k, top_p = sp.get("temperature", 1.0), sp.get("top_k", -1), sp.get("top_p", 1.0)
        if temperature < 1e-6:
            temperature, top_k = 1.0, 1
        stops = list(sp.get("stop") or [])
        if stops and self.tokenizer is None:
            raise ValueError(f"stop={stops!r} is unavailable when skip_tokenizer_init=True")
        stop_ids = set(sp.get("stop_token_ids") or []) | self.eos
        gen = torch.Generator().manual_seed(sp["sampling_seed"]) if "sampling_seed" in sp else self.generator
        ids, out, lps, reason = list(prompt), [], [], None
        for _ in range(sp.get("max_new_tokens", 128)):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float() / temperature
            probs = torch.softmax(logits, -1)
            sorted_p, order = probs.sort(descending=True)
            sorted_p[(sorted_p.cumsum(0) - sorted_p) > top_p] = 0.0
            nucleus = torch.zeros_like(probs).scatter_(0, order, sorted_p / sorted_p.sum())
            if top_k == 1:
                token = int(probs.argmax())
            else:
                kept = nucleus.clone()
                if top_k > 0:
                    kept[probs.argsort(descending=True)[top_k:]] = 0.0
                token = int(torch.multinomial(kept, 1, generator=gen))
            ids.append(token)
            out.append(token)
            lps.append(float(torch.log(nucleus[token])))
            if token in stop_ids:
                reason = {"type": "stop", "matched": token}
                break
            text = self.tokenizer.decode(out) if stops else ""
            if any(s in text for s in stops):
                reason = {"type": "stop", "matched": next(s for s in stops if s in text)}
                break
        if reason is None:
            reason = {"type": "length", "length": len(out)}
        meta = {"id": uuid.uuid4().hex, "finish_reason": reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(out)}
        if return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(lps, out)]
        res = {"output_ids": out, "meta_info": meta}
        if self.tokenizer is not None:
            res["text"] = self.tokenizer.decode(out)
        return res

    # -- weights (SGLang's model runner, step by step) ----------------------------------------------------
    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                        group_name, backend="nccl"):
        self.control.append(("init_weights_update_group", dict(master_address=master_address,
                            master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                            group_name=group_name, backend=backend)))
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        def init():
            timeout = timedelta(seconds=TIMEOUT_S)
            store, rank, size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank_offset, world_size,
                                                timeout=timeout))
            store.set_timeout(timeout)
            pg, _ = _new_process_group_helper(size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                              group_name=group_name, backend_options=None, timeout=timeout)
            _world.pg_group_ranks[pg] = {i: i for i in range(size)}
            return pg

        try:
            self.groups[group_name] = await asyncio.to_thread(init)
        except Exception as exc:
            return False, f"Failed to initialize custom process group: {exc}."
        return True, "Succeeded to initialize custom process group."

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                              flush_cache=True, load_format=None):
        self.control.append(("update_weights_from_distributed", dict(names=names, dtypes=dtypes, shapes=shapes,
                            group_name=group_name, flush_cache=flush_cache)))
        if self.active:
            raise RuntimeError("stand-in: weight update while a request runs (the adapter must drain first)")
        pg = self.groups[group_name]

        def receive():
            weights, handles = [], []
            for name, dtype, shape in zip(names, dtypes, shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                handles.append(dist.broadcast(weight, src=0, group=pg, async_op=True))
                weights.append((name, weight))
            for handle in handles:
                handle.wait()
            return weights

        return self._load(await asyncio.to_thread(receive))

    async def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.control.append(("update_weights_from_tensor", dict(names=[n for n, _ in named_tensors],
                            load_format=load_format, flush_cache=flush_cache)))
        if self.active:
            raise RuntimeError("stand-in: weight update while a request runs (the adapter must drain first)")
        return self._load(named_tensors)

    def _load(self, weights):
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, _ in weights:
            if name not in params:
                return False, f"Failed to update weights: unknown parameter {name}."
        with torch.no_grad():
            for name, weight in weights:
                params[name].copy_(weight)
        return True, "Succeeded to update parameter online."

    async def flush_cache(self):
        self.flush_count += 1
        return FlushCacheReqOutput(success=True)

    def shutdown(self):
        self.shut_down = True
        for pg in self.groups.values():
            dist.destroy_process_group(pg)
        self.groups.clear()


# ---- fixtures and helpers --------------------------------------------------------------------------
@pytest.fixture
def make_engine(tiny_model_dir):
    engines: list[SGLangEngine] = []

    def make(cls=FakeSGLangEngine, **kwargs) -> SGLangEngine:
        kwargs.setdefault("max_prompt_len", 16)
        engine = SGLangEngine(str(tiny_model_dir), engine_factory=cls, dtype="float32", seed=3, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        asyncio.run(engine.close())


def generate(engine, prompts, **params):
    return asyncio.run(engine.generate(prompts, SamplingParams(**params)))


def encode(tiny_model_dir, text: str) -> list[int]:
    return load_tokenizer(tiny_model_dir).encode(text, add_special_tokens=False)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """HF `generate` greedy (stops at the model's eos, which it keeps, like the engine)."""
    return model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()


@torch.no_grad()
def teacher_forced(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


# ---- construction ------------------------------------------------------------------------------------
def test_registry_builds_the_adapter_with_build_py_kwargs(tiny_model_dir):
    engine = create_engine("sglang", model_path=str(tiny_model_dir), dtype="float32", max_prompt_len=8, seed=5,
                           detokenize=lambda ids: "", kv_on_update="recompute", engine_factory=FakeSGLangEngine,
                           mem_fraction_static=0.5)
    try:
        assert isinstance(engine, RolloutEngine) and isinstance(engine, CollectiveWeightEngine)
        assert engine._engine.kwargs == {"model_path": str(tiny_model_dir), "dtype": "float32", "random_seed": 5,
                                         "skip_tokenizer_init": False, "mem_fraction_static": 0.5}
        assert engine.version == 0
    finally:
        asyncio.run(engine.close())
    assert engine._engine.shut_down


def test_bad_kv_on_update_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_on_update"):
        SGLangEngine(str(tiny_model_dir), kv_on_update="reuse", engine_factory=FakeSGLangEngine)


# ---- request shape -------------------------------------------------------------------------------------
def test_greedy_request_shape(make_engine):
    engine = make_engine()
    generate(engine, [[4, 5, 6]], temperature=0.0, max_new_tokens=3)
    (req,) = engine._engine.requests
    assert req["input_ids"] == [[4, 5, 6]]
    assert req["return_logprob"] is True and req["logprob_start_len"] == -1
    assert req["sampling_params"] == {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                                      "no_stop_trim": True}


def test_n_samples_repeat_each_prompt_in_order_and_seeds_differ_per_sample(make_engine):
    engine = make_engine()
    out = generate(engine, [[4, 5], [7, 8, 9]], n=3, temperature=1.0, max_new_tokens=4, seed=11)
    (req,) = engine._engine.requests
    assert req["input_ids"] == [[4, 5]] * 3 + [[7, 8, 9]] * 3
    seeds = [sp["sampling_seed"] for sp in req["sampling_params"]]
    assert len(set(seeds)) == 6
    assert [len(g) for g in out] == [3, 3]
    assert all(c.prompt_ids == [7, 8, 9] for c in out[1])
    again = generate(engine, [[4, 5], [7, 8, 9]], n=3, temperature=1.0, max_new_tokens=4, seed=11)
    assert [[c.response_ids for c in g] for g in again] == [[c.response_ids for c in g] for g in out]


def test_stop_ids_and_stop_strings_are_passed(make_engine, tiny_model_dir):
    engine = make_engine()
    generate(engine, [[4, 5]], temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=4, stop_token_ids=[9],
             stop=["="])
    sp = engine._engine.requests[0]["sampling_params"]
    assert sp == {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "no_stop_trim": True,
                  "stop_token_ids": [9], "stop": ["="]}


def test_stop_strings_without_sglang_tokenizer_fail_before_the_request(make_engine):
    engine = make_engine(skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        generate(engine, [[4, 5]], stop=["="])
    assert engine._engine.requests == []


def test_original_logprob_mode_refuses_other_temperatures(make_engine, monkeypatch):
    engine = make_engine()
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "true")
    with pytest.raises(ValueError, match="T=1 logprobs"):
        generate(engine, [[4, 5]], temperature=0.7)
    generate(engine, [[4, 5]], temperature=1.0, max_new_tokens=1)  # raw == processed at T = 1


# ---- response parsing ------------------------------------------------------------------------------------
def test_greedy_equals_hf_and_logprobs_match_teacher_forcing(make_engine, tiny_model_dir):
    engine = make_engine()
    model = load_model(tiny_model_dir, dtype="float32")
    prompt = encode(tiny_model_dir, "12+34=")
    (c,), = generate(engine, [prompt], temperature=0.0, max_new_tokens=5)
    steps = len(c.response_ids)
    assert steps >= 4  # tokens compared; measured: 5 (max_new_tokens, no eos)
    assert c.response_ids == hf_greedy(model, prompt, 5)
    assert c.logprobs == pytest.approx(teacher_forced(model, prompt, c.response_ids, 1.0), abs=1e-5)
    assert c.versions == [0] * steps and c.finish_reason in ("stop", "length")


def test_sampled_logprobs_are_post_temperature(make_engine, tiny_model_dir):
    engine = make_engine()
    model = load_model(tiny_model_dir, dtype="float32")
    prompt = encode(tiny_model_dir, "7+8=")
    (c,), = generate(engine, [prompt], temperature=0.6, max_new_tokens=6, seed=1)
    assert c.logprobs == pytest.approx(teacher_forced(model, prompt, c.response_ids, 0.6), abs=1e-5)
    assert len(c.response_ids) >= 4  # tokens compared; measured: 6 (max_new_tokens, no eos)


def test_finish_reasons_length_stop_token_and_stop_string(make_engine, tiny_model_dir):
    engine = make_engine()
    prompt = encode(tiny_model_dir, "12+34=")
    sample = dict(temperature=1.0, max_new_tokens=8, seed=2)
    (free,), = generate(engine, [prompt], **sample)
    assert free.finish_reason == "length" and len(free.response_ids) == 8
    stop_at = free.response_ids[3]
    cut = free.response_ids.index(stop_at) + 1
    (c,), = generate(engine, [prompt], stop_token_ids=[stop_at], **sample)
    assert c.finish_reason == "stop" and c.response_ids == free.response_ids[:cut]  # the stop token is kept
    assert c.logprobs == free.logprobs[:cut] and c.versions == [0] * cut
    text = load_tokenizer(tiny_model_dir).decode(free.response_ids[:4])
    (s,), = generate(engine, [prompt], stop=[text[-1]], **sample)
    assert s.finish_reason == "stop" and len(s.response_ids) <= 4


def test_prompt_truncation_keeps_the_last_tokens(make_engine):
    engine = make_engine(max_prompt_len=4)
    (c,), = generate(engine, [[4, 5, 6, 7, 8, 9]], temperature=0.0, max_new_tokens=1)
    assert engine._engine.requests[0]["input_ids"] == [[6, 7, 8, 9]]
    assert c.prompt_ids == [6, 7, 8, 9] and c.prompt_truncated
    (short,), = generate(engine, [[4, 5]], temperature=0.0, max_new_tokens=1)
    assert not short.prompt_truncated


def test_bad_prompts_are_rejected(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="empty"):
        generate(engine, [[]])
    with pytest.raises(ValueError, match="outside"):
        generate(engine, [[10_000]])


class GarbageSGLang(FakeSGLangEngine):
    """The stand-in with its responses replaced by `self.reply(outputs)`."""

    reply = staticmethod(lambda outs: outs)

    async def async_generate(self, **kwargs):
        return type(self).reply(await super().async_generate(**kwargs))


def _edit(path: str, value):
    def reply(outs):
        out = outs[0]
        *parents, leaf = path.split(".")
        target = out
        for key in parents:
            target = target[key]
        if value is KeyError:
            del target[leaf]
        else:
            target[leaf] = value
        return outs
    return reply


@pytest.mark.parametrize("reply, error, match", [
    (lambda outs: "oops", SGLangResponseError, "outputs for a batch"),
    (lambda outs: outs + outs, SGLangResponseError, "2 outputs for a batch of 1"),
    (_edit("meta_info", KeyError), SGLangResponseError, "meta_info"),
    (_edit("meta_info.output_token_logprobs", KeyError), SGLangResponseError, "return_logprob"),
    (_edit("meta_info.output_token_logprobs", [("x", 1)]), SGLangResponseError, "not \\(logprob, token_id"),
    (_edit("output_ids", [99, 98]), SGLangResponseError, "disagree"),
    (_edit("meta_info.completion_tokens", 42), SGLangResponseError, "42 completion tokens"),
    (_edit("meta_info.finish_reason", None), SGLangResponseError, "finish_reason"),
    (_edit("meta_info.finish_reason", {"type": "paused"}), SGLangResponseError, "finish_reason"),
    (_edit("meta_info.finish_reason", {"type": "abort", "message": "too long"}), RuntimeError, "too long"),
])
def test_unreadable_responses_raise_a_clear_error(make_engine, reply, error, match):
    cls = type("Garbage", (GarbageSGLang,), {"reply": staticmethod(reply)})
    engine = make_engine(cls)
    with pytest.raises(error, match=match):
        generate(engine, [[4, 5]], temperature=0.0, max_new_tokens=2)


# ---- weights ---------------------------------------------------------------------------------------------
def perturbed(model, scale: float = 0.5, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: (p.detach() + scale * torch.randn(p.shape, generator=gen)).to(p.dtype)
            for name, p in model.named_parameters()}


class TrainerSide:
    """Rank 0 of the SGLang weight-update group, as the trainer actor would run it."""

    def __init__(self, meta, world_size: int = 2, group_name: str | None = None):
        self.store, self.port = create_store(world_size, TIMEOUT_S)
        self.meta = meta
        self.world_size = world_size
        self.group_name = group_name or f"g{uuid.uuid4().hex[:8]}"
        self.sender: PerTensorSender | None = None

    def join(self) -> None:
        group = join_sglang_sender(store=self.store, world_size=self.world_size, backend="gloo",
                                   timeout_s=TIMEOUT_S, group_name=self.group_name)
        self.sender = PerTensorSender(group, self.meta)


async def join_all(trainer: TrainerSide, engines: list[SGLangEngine], meta=None) -> None:
    await asyncio.gather(asyncio.to_thread(trainer.join), *[
        e.join_weight_group(host="127.0.0.1", port=trainer.port, rank=r + 1, world_size=trainer.world_size,
                            backend="gloo", timeout_s=TIMEOUT_S, meta=meta or trainer.meta)
        for r, e in enumerate(engines)])


def test_update_through_the_group_changes_outputs_version_and_flushes(make_engine, tiny_model_dir):
    reference = load_model(tiny_model_dir, dtype="float32")
    meta = plan_buckets(dict(reference.named_parameters()), 4096)
    trainer = TrainerSide(meta)
    # One engine: two stand-ins in one process would register the same group name with torch twice
    # (real SGLang engines are separate processes).
    engines = [make_engine(group_name=trainer.group_name)]
    prompt = encode(tiny_model_dir, "12+34=")

    async def main():
        await join_all(trainer, engines)
        before = [await e.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4)) for e in engines]
        for version, seed in ((1, 0), (2, 1)):
            new = perturbed(reference, seed=seed)
            stats = await asyncio.gather(asyncio.to_thread(trainer.sender.send, new, version),
                                         *[e.receive_weights() for e in engines])
            assert all(v == version for v, _ in stats[1:])
            assert stats[0]["sync/buckets"] == len(meta.tensors)
            assert stats[1][1]["sync/bytes"] == meta.total_bytes
        after = [await e.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4)) for e in engines]
        return new, before, after

    new, before, after = asyncio.run(main())
    for name, tensor in new.items():
        reference.get_parameter(name).data.copy_(tensor)
    for engine, b, a in zip(engines, before, after):
        (c,), = a
        assert engine.version == 2 and c.versions == [2] * len(c.response_ids)
        assert c.logprobs != b[0][0].logprobs
        assert c.response_ids == hf_greedy(reference, prompt, 4)
        assert len(c.response_ids) >= 3  # tokens compared; measured: 4 (max_new_tokens, no eos)
        assert c.logprobs == pytest.approx(teacher_forced(reference, prompt, c.response_ids, 1.0), abs=1e-5)
        fake = engine._engine
        assert fake.flush_count == 2  # once after every update
        inits = [kw for name, kw in fake.control if name == "init_weights_update_group"]
        assert inits[0]["rank_offset"] == 1 and inits[0]["world_size"] == 2
        assert inits[0]["group_name"] == trainer.group_name and inits[0]["backend"] == "gloo"
        (_, upd), _ = [x for x in fake.control if x[0] == "update_weights_from_distributed"]
        assert upd["names"] == [m.name for m in meta.tensors] and upd["dtypes"] == [m.dtype for m in meta.tensors]
        assert upd["shapes"] == [m.shape for m in meta.tensors] and upd["flush_cache"] is True


def test_a_different_meta_is_refused_before_sglang_receives(make_engine, tiny_model_dir):
    reference = load_model(tiny_model_dir, dtype="float32")
    params = dict(reference.named_parameters())
    meta = plan_buckets(params, 4096)
    other = plan_buckets({k: v for k, v in params.items() if "layers.1." not in k}, 4096)
    trainer = TrainerSide(meta)
    engine = make_engine(group_name=trainer.group_name)

    async def main():
        await join_all(trainer, [engine], meta=other)
        trainer.sender.group._timeout = timedelta(seconds=1)  # the trainer's broadcast then times out
        return await asyncio.gather(asyncio.to_thread(trainer.sender.send, params, 1), engine.receive_weights(),
                                    return_exceptions=True)

    sent, received = asyncio.run(main())
    assert isinstance(received, RuntimeError) and "WeightsMeta differs" in str(received)
    assert isinstance(sent, TimeoutError)
    assert engine.version == 0
    assert not [x for x in engine._engine.control if x[0] == "update_weights_from_distributed"]


def test_sender_rejects_tensors_that_do_not_match_the_meta(tiny_model_dir):
    params = dict(load_model(tiny_model_dir, dtype="float32").named_parameters())
    meta = plan_buckets(params, 4096)
    group = type("G", (), {"device": torch.device("cpu"), "broadcast": lambda self, ts: None})()
    with pytest.raises(ValueError, match="re-plan"):  # another shape
        broadcast_per_tensor(group, {k: v.reshape(-1) if v.dim() > 1 else v for k, v in params.items()}, meta)
    with pytest.raises(ValueError, match="re-plan"):  # integers for floats
        broadcast_per_tensor(group, {k: v.long() for k, v in params.items()}, meta)


def test_sender_sends_each_tensor_in_the_engines_dtype_of_the_meta(tiny_model_dir):
    params = dict(load_model(tiny_model_dir, dtype="float32").named_parameters())
    meta = plan_buckets(params, 4096, dtype=torch.bfloat16)  # float32 master weights, a bfloat16 engine
    sent: list[torch.Tensor] = []
    group = type("G", (), {"device": torch.device("cpu"), "broadcast": lambda self, ts: sent.extend(ts)})()
    nbytes = broadcast_per_tensor(group, params, meta)
    assert nbytes == meta.total_bytes == sum(2 * p.numel() for p in params.values())
    for m, t in zip(meta.tensors, sent):
        assert t.dtype == torch.bfloat16 and torch.equal(t, params[m.name].detach().to(torch.bfloat16)), m.name


def test_load_weights_waits_for_running_requests_and_stamps_versions(make_engine, tiny_model_dir):
    engine = make_engine()
    fake = engine._engine
    new = perturbed(load_model(tiny_model_dir, dtype="float32"))

    async def main():
        fake.hold = asyncio.Event()
        running = asyncio.ensure_future(engine.generate([[4, 5]], SamplingParams(temperature=0.0, max_new_tokens=2)))
        while not fake.active:
            await asyncio.sleep(0.01)
        loading = asyncio.ensure_future(asyncio.to_thread(engine.load_weights, new, 7))
        await asyncio.sleep(0.2)
        assert not loading.done() and not fake.control  # the update waits for the running request
        later = asyncio.ensure_future(engine.generate([[4, 5]], SamplingParams(temperature=0.0, max_new_tokens=2)))
        engine._loop.call_soon_threadsafe(fake.hold.set)
        return await running, await loading, await later

    (first,), _, (second,) = asyncio.run(main())
    assert first[0].versions == [0, 0] and second[0].versions == [7, 7]
    assert engine.version == 7 and fake.flush_count == 1
    assert fake.control[0][0] == "update_weights_from_tensor" and fake.control[0][1]["flush_cache"] is True


def test_failed_sglang_update_raises_and_keeps_the_version(make_engine):
    engine = make_engine()
    with pytest.raises(RuntimeError, match="unknown parameter"):
        engine.load_weights({"no.such.weight": torch.zeros(2)}, 1)
    assert engine.version == 0 and engine._engine.flush_count == 0


def test_join_checks_rank_and_tensor_parallel_size(make_engine):
    engine = make_engine()
    meta = plan_buckets({"w": torch.zeros(2)}, 1024)
    with pytest.raises(ValueError, match="receiver"):
        asyncio.run(engine.join_weight_group(host="127.0.0.1", port=1, rank=0, world_size=2, backend="gloo",
                                             timeout_s=1, meta=meta))
    tp = make_engine(tp_size=2)
    with pytest.raises(NotImplementedError, match="tp_size=2"):
        asyncio.run(tp.join_weight_group(host="127.0.0.1", port=1, rank=1, world_size=2, backend="gloo",
                                         timeout_s=1, meta=meta))
    with pytest.raises(RuntimeError, match="join_weight_group"):
        asyncio.run(engine.receive_weights())


def test_close_fails_requests_in_flight_and_later_calls(make_engine):
    engine = make_engine()
    fake = engine._engine

    async def main():
        fake.hold = asyncio.Event()
        running = asyncio.ensure_future(engine.generate([[4, 5]], SamplingParams(max_new_tokens=2)))
        while not fake.active:
            await asyncio.sleep(0.01)
        await engine.close()
        return await asyncio.gather(running, return_exceptions=True)

    (err,) = asyncio.run(main())
    assert isinstance(err, RuntimeError) and "closed" in str(err)
    assert fake.shut_down
    with pytest.raises(RuntimeError, match="after close"):
        generate(engine, [[4, 5]])
    with pytest.raises(RuntimeError, match="after close"):
        engine.load_weights({}, 1)
    assert threading.active_count() >= 1
