"""Mixture-of-experts policies (issue 41, first part): the tiny MoE folders of each family build offline, load
through the HF Auto* path, generate on the native engine (its HF path) with the trainer's log-probabilities, and
train in the Learner, whose weights then reach the engine as a dense model's do."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
import torch

from asyncrl.config.schema import AlgorithmConfig, TinyModelConfig, TrainerConfig
from asyncrl.messages import Group, SamplingParams, Trajectory
from asyncrl.training.learner import Learner
from engines import hf
from engines.torch_engine import TorchEngine

torch.set_num_threads(1)

ARCHS = sorted(hf.MOE_ARCHS)
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [20]]


def tiny_moe(arch: str, **kw) -> TinyModelConfig:
    return TinyModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           intermediate_size=32, num_experts=4, experts_per_token=2, init_std=0.2, **kw)


@pytest.fixture(scope="module", params=ARCHS)
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf.build_tiny_model(path, tiny_moe(request.param))
    return path


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def test_a_tiny_moe_folder_loads_with_its_experts_and_router_per_layer(moe_dir):
    model = hf.load_model(moe_dir)
    assert model.config.model_type == moe_dir.name.rstrip("0123456789")
    rs = routers(model)
    assert len(rs) == 2 and all((r.num_experts, r.top_k) == (4, 2) for r in rs)
    assert all(r.weight.shape == (4, 32) for r in rs)
    tok = hf.load_tokenizer(moe_dir)
    assert tok.decode(tok.encode("12+3=15")) == "12+3=15"


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_the_native_engine_samples_an_moe_with_the_models_own_logprobs(moe_dir):
    """Prompts of different lengths in one batch: each token's logprob is an unpadded teacher-forced pass's (fp32):
    padding rows are routed too, but no token's experts depend on another's."""
    engine = TorchEngine(str(moe_dir), seed=0)
    model = hf.load_model(moe_dir)
    out = asyncio.run(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=10, seed=1)))
    checked = 0
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            torch.testing.assert_close(torch.tensor(c.logprobs), teacher_forced(model, prompt, c.response_ids),
                                       atol=1e-5, rtol=0)
            checked += len(c.response_ids)
    assert checked > 20
    asyncio.run(engine.close())


def _bandit_group(learner: Learner, prompt: list[int], target: int, n: int, gen: torch.Generator,
                  group_id: int) -> Group:
    with torch.no_grad():
        logp = learner.model(input_ids=torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    tokens = torch.multinomial(logp.exp(), n, replacement=True, generator=gen).tolist()
    trajs = [Trajectory(seq_id=group_id * n + i, group_id=group_id, group_size=n, prompt_ids=prompt,
                        response_ids=[tok], loss_mask=[True], behavior_logprobs=[float(logp[tok])],
                        versions=[learner.version], min_version=learner.version, max_version=learner.version,
                        finish_reason="stop", reward=float(tok == target))
             for i, tok in enumerate(tokens)]
    return Group(group_id=group_id, min_version=learner.version, trajectories=trajs)


def test_the_learner_trains_an_moe_router_and_experts_and_the_engine_takes_its_weights(moe_dir):
    model = hf.load_model(moe_dir).train()
    learner = Learner(model, algorithm=AlgorithmConfig(), pad_token_id=hf.PAD_ID,
                      trainer=TrainerConfig(lr=2e-2, grad_clip=1.0, micro_batch_size=64))
    before = {k: v.clone() for k, v in learner.state_dict_for_sync().items()}
    prompt, target, gen = [5, 6, 7], 9, torch.Generator().manual_seed(0)
    p0 = math.exp(learner.teacher_forced_logprobs(prompt, [target], 1.0)[0])
    for step in range(25):
        learner.update([_bandit_group(learner, prompt, target, 16, gen, step)])
    assert math.exp(learner.teacher_forced_logprobs(prompt, [target], 1.0)[0]) > max(0.8, 4 * p0)
    after = learner.state_dict_for_sync()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert any(k.endswith("mlp.gate.weight") for k in moved)  # the router trains
    assert any(".experts." in k for k in moved)  # and the experts
    engine = TorchEngine(str(moe_dir), seed=0)
    engine.load_weights(dict(after), version=1)
    out = asyncio.run(engine.generate([prompt], SamplingParams(n=4, max_new_tokens=4, seed=2)))
    for c in out[0]:
        torch.testing.assert_close(torch.tensor(c.logprobs), teacher_forced(learner.model.eval(), prompt,
                                                                            c.response_ids), atol=1e-5, rtol=0)
        assert c.versions == [1] * len(c.response_ids)


def test_a_tiny_moe_with_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(ValueError, match="experts_per_token .3. is more than num_experts .2."):
        hf._build_model(msgspec.structs.replace(tiny_moe("qwen3_moe"), num_experts=2, experts_per_token=3),
                        vocab_size=16)


def test_the_engine_records_each_positions_experts_and_replaying_them_gives_its_logprobs(moe_dir):
    """record_routing: a completion carries the routing of every position the engine fed (the prompt's from its
    prefill, then each response token but the last); the model replaying it computes the engine's logprobs."""
    from engines.routing import Routing, unpack_routing

    engine = TorchEngine(str(moe_dir), seed=0, record_routing=True)
    model = hf.load_model(moe_dir)
    routing = Routing(model)
    out = asyncio.run(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=3)))
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert c.routing_shape == [2, 2]
            recorded = unpack_routing(c.routed_experts, c.routing_shape)
            assert recorded.shape == (len(prompt) + len(c.response_ids) - 1, 2, 2)
            ids = torch.tensor([prompt + c.response_ids])
            with torch.no_grad(), routing.recording() as rec:
                model(ids)
            own = torch.stack(rec, dim=1)[:-1]  # the trainer's own routing of the same positions (fp32: the same)
            assert torch.equal(own, recorded)
            forced = torch.cat([recorded, torch.full((1, 2, 2), -1, dtype=recorded.dtype)])
            with torch.no_grad(), routing.replaying(forced):
                logits = model(ids).logits[0].float()
            want = logits[len(prompt) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(c.response_ids)[:, None])
            torch.testing.assert_close(torch.tensor(c.logprobs), want.squeeze(-1), atol=1e-5, rtol=0)
    assert out[0][0].routed_experts[: 2 * 2 * 2 * 3] == out[0][1].routed_experts[: 2 * 2 * 2 * 3]  # one prefill
    asyncio.run(engine.close())


def test_recording_the_routing_of_a_dense_model_is_one_clear_error(tmp_path):
    hf.build_tiny_model(tmp_path, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=32))
    with pytest.raises(ValueError, match="record_routing: the model has no MoE router"):
        TorchEngine(str(tmp_path), record_routing=True)


# ---- the trainer's side of routing replay (algorithm.routing_replay; asyncrl/training/routing.py)

def _engine_group(moe_dir, prompt: list[int], n: int = 4, group_id: int = 0, **engine_kw) -> Group:
    """A group sampled by the native engine recording its routing, as the generator hands it on."""
    engine = TorchEngine(str(moe_dir), seed=0, record_routing=True, **engine_kw)
    (group,) = asyncio.run(engine.generate([prompt], SamplingParams(n=n, max_new_tokens=6, seed=group_id)))
    asyncio.run(engine.close())
    trajs = [Trajectory(seq_id=group_id * n + i, group_id=group_id, group_size=n, prompt_ids=c.prompt_ids,
                        response_ids=c.response_ids, loss_mask=[True] * len(c.response_ids),
                        behavior_logprobs=c.logprobs, versions=c.versions, min_version=0, max_version=0,
                        finish_reason=c.finish_reason, reward=float(i % 2), routed_experts=c.routed_experts,
                        routing_shape=c.routing_shape)
             for i, c in enumerate(group)]
    return Group(group_id=group_id, min_version=0, trajectories=trajs)


def _moe_learner(moe_dir, mode: str, checkpointing: bool = False, dtype=torch.float32, **trainer_kw) -> Learner:
    model = hf.load_model(moe_dir).to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # transformers' grouped_mm experts take 16- and 32-bit floats
    return Learner(model, algorithm=AlgorithmConfig(routing_replay=mode), pad_token_id=hf.PAD_ID,
                   trainer=TrainerConfig(**{"lr": 1e-3, "micro_batch_size": 64, **trainer_kw}),
                   gradient_checkpointing=checkpointing)


def _rerouted(group: Group, shift: int) -> Group:
    """The group with every recorded expert moved by `shift` (mod 4): a routing the trainer would not choose."""
    from engines.routing import pack_routing, unpack_routing

    trajs = [msgspec.structs.replace(t, **pack_routing((unpack_routing(t.routed_experts, t.routing_shape) + shift) % 4))
             for t in group.trajectories]
    return Group(group_id=group.group_id, min_version=0, trajectories=trajs)


def _experts_used(model: torch.nn.Module, run) -> list[torch.Tensor]:
    """The top-k indices each MoE layer's experts were handed during `run()`, per call."""
    seen: list[torch.Tensor] = []
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())) for e in experts]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _check_used(seen: list[torch.Tensor], trajs: list[Trajectory]) -> None:
    from engines.routing import unpack_routing

    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    for layer in range(2):
        used = seen[layer].view(len(trajs), width, 2)
        for i, t in enumerate(trajs):
            recorded = unpack_routing(t.routed_experts, t.routing_shape)
            assert torch.equal(used[i, : recorded.shape[0]].to(recorded.dtype), recorded[:, layer])


def _assert_replayed(learner: Learner, group: Group) -> dict[str, float]:
    """Train `group`; the step's first forward routed each recorded position to exactly the recorded experts."""
    metrics: dict[str, float] = {}
    seen = _experts_used(learner.model, lambda: metrics.update(learner.update([group])))
    _check_used(seen, group.trajectories)  # the step's first forward: the padded micro-batch
    return metrics


def test_the_trainers_forward_uses_exactly_the_recorded_experts_token_by_token(moe_dir):
    group = _rerouted(_engine_group(moe_dir, [5, 6, 7]), 1)
    metrics = _assert_replayed(_moe_learner(moe_dir, "rollout"), group)
    trajs = group.trajectories
    assert metrics["routing/recorded_share"] == pytest.approx(
        sum(len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajs)
        / sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs))
    assert metrics["routing/agreement"] < 0.5  # every recorded choice moved: the trainer's own router disagrees


def test_a_resumed_run_replays_the_routing_its_checkpoint_kept(moe_dir, tmp_path):
    """The buffer's checkpoint (accepted groups, whole) keeps each trajectory's routing bytes; the resumed trainer
    replays them as the first run would have."""
    import msgspec

    from asyncrl.checkpoints import store
    from buffers.replay import BufferState

    group = _rerouted(_engine_group(moe_dir, [5, 6, 7, 8]), 3)
    state = BufferState(gate=None, train=[group], env_counts={}, submitted={}, window={})
    path = store.save(tmp_path, step=1, version=1, config_text="x", state={"buffer": state})
    restored = msgspec.convert(store.load(path).state["buffer"]["train"], list[Group])[0]
    assert restored == group
    _assert_replayed(_moe_learner(moe_dir, "rollout"), restored)


def test_measure_counts_agreement_and_replay_makes_the_trainer_compute_the_engines_logprobs(moe_dir):
    group = _engine_group(moe_dir, [10, 11, 12, 13])
    measured = _moe_learner(moe_dir, "measure").update([group])
    assert measured["routing/agreement"] == 1.0  # fp32 engine and trainer, same weights: the same experts
    assert measured["trainer/logprob_gap"] < 1e-5
    moved = _rerouted(group, 2)
    off = _moe_learner(moe_dir, "measure").update([moved])
    on = _moe_learner(moe_dir, "rollout").update([moved])
    assert off["routing/agreement"] < 0.5 and on["routing/agreement"] < 0.5
    # replayed, the trainer's logprobs are the ones the moved routing gives; not replayed, its own routing's
    assert on["trainer/logprob_gap"] != pytest.approx(off["trainer/logprob_gap"])


@pytest.mark.parametrize("levers", [{"checkpointing": True}, {"pack_sequences": True},
                                    {"max_tokens_per_micro_batch": 16}])
def test_replay_gives_the_same_step_under_checkpointing_packing_and_token_budgets(moe_dir, levers):
    groups = [_rerouted(_engine_group(moe_dir, p, group_id=g), 3) for g, p in enumerate([[5, 6], [7, 8, 9, 10]])]
    f64 = torch.float64  # Adam's first step moves each weight by about lr whatever its gradient's size: float32
    # rounding of another micro-batch cut would show at 1e-6
    plain, other = _moe_learner(moe_dir, "rollout", dtype=f64), _moe_learner(moe_dir, "rollout", dtype=f64, **levers)
    a, b = plain.update(groups), other.update(groups)
    assert a["trainer/loss"] == pytest.approx(b["trainer/loss"], rel=1e-12)
    for p, q in zip(plain.model.parameters(), other.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)


def test_bad_routing_and_replay_on_a_dense_model_get_one_clear_error(moe_dir, tmp_path):
    group = _engine_group(moe_dir, [5, 6, 7], n=2)
    t = group.trajectories[0]
    wrong = Group(group_id=0, min_version=0, trajectories=[
        msgspec.structs.replace(t, routed_experts=t.routed_experts[:8]),
        group.trajectories[1]])
    with pytest.raises(ValueError, match="routing replay: sample 0 carries the routing of 1 positions"):
        _moe_learner(moe_dir, "rollout").update([wrong])
    hf.build_tiny_model(tmp_path, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=32))
    with pytest.raises(ValueError, match="routing_replay = 'rollout': routing: the model has no MoE router"):
        Learner(hf.load_model(tmp_path), algorithm=AlgorithmConfig(routing_replay="rollout"),
                trainer=TrainerConfig(), pad_token_id=0)


def test_a_sequence_spanning_an_in_flight_swap_keeps_each_positions_routing_of_its_sampling_forward(moe_dir):
    """Weights swapped after decode step 3 (K/V recomputed under the new version): the positions fed before the
    swap keep the old version's routing, the ones after carry the new one's; the recompute records nothing."""
    import threading
    import time

    from engines.routing import Routing, unpack_routing

    engine = TorchEngine(str(moe_dir), eos_token_ids=[], record_routing=True)
    old = hf.load_model(moe_dir)
    gen = torch.Generator().manual_seed(1)
    new_weights = {k: (v + 0.3 * torch.randn(v.shape, generator=gen)).detach() for k, v in old.named_parameters()}
    new = hf.load_model(moe_dir)
    new.load_state_dict(new_weights, strict=False)
    swapper = threading.Thread(target=engine.load_weights, args=(new_weights, 1))
    base = engine.num_decode_forwards

    def hook(step: int) -> None:
        if step - base == 3:
            swapper.start()
            deadline = time.monotonic() + 10
            while engine.scheduler.staged_swaps() == 0 and time.monotonic() < deadline:
                time.sleep(0.001)

    engine.scheduler.on_step = hook
    prompt, length, before = [5, 6, 7, 8], 10, 4  # 1 token from the prefill + 3 decode steps under version 0
    (group,) = asyncio.run(engine.generate([prompt], SamplingParams(n=2, max_new_tokens=length, seed=4)))
    swapper.join(timeout=10)
    differs = 0
    for c in group:
        assert c.versions == [0] * before + [1] * (length - before)
        recorded = unpack_routing(c.routed_experts, c.routing_shape)
        assert recorded.shape[0] == len(prompt) + length - 1
        ids = torch.tensor([prompt + c.response_ids])
        own = {}
        for name, model in (("old", old), ("new", new)):
            routing = Routing(model)
            with torch.no_grad(), routing.recording() as rec:
                model(ids)
            own[name] = torch.stack(rec, dim=1)
            routing.remove()
        cut = len(prompt) + before - 1  # the first position fed under version 1
        assert torch.equal(recorded[:cut], own["old"][:cut])
        assert torch.equal(recorded[cut:], own["new"][cut:-1])
        differs += int((own["old"][cut:-1] != own["new"][cut:-1]).any())
    assert differs  # the versions route differently: the record follows each position's own
    asyncio.run(engine.close())


# ---- trainer.router_aux_loss_coef: the model family's load-balancing loss (asyncrl/training/routing.py)

def _router_grads(learner: Learner, group: Group) -> list[torch.Tensor]:
    learner.compute_gradients(group.trajectories, torch.tensor([t.reward - 0.5 for t in group.trajectories]))
    grads = [m.weight.grad.clone() for m in routers(learner.model)]
    learner.model.zero_grad()
    return grads


@pytest.mark.parametrize("levers", [{}, {"checkpointing": True}, {"pack_sequences": True}])
def test_the_router_aux_loss_is_the_models_own_load_balancing_loss_and_trains_the_router(moe_dir, levers):
    f64 = torch.float64
    groups = [_engine_group(moe_dir, p, group_id=g) for g, p in enumerate([[5, 6], [7, 8, 9, 10]])]
    trajs = groups[0].trajectories + groups[1].trajectories
    both = Group(group_id=0, min_version=0, trajectories=trajs)
    plain = _router_grads(_moe_learner(moe_dir, "off", dtype=f64), both)
    coef = 0.25
    aux = _moe_learner(moe_dir, "off", dtype=f64, router_aux_loss_coef=coef, **levers)
    with_aux = _router_grads(aux, both)
    assert aux.router_aux is not None and aux.router_aux.weight == pytest.approx(1.0)
    # the model's own: HF's forward with output_router_logits gives the aux loss over the same padded batch
    from asyncrl.training.batch import collate

    model = _moe_learner(moe_dir, "off", dtype=f64).model
    batch = collate(trajs, torch.zeros(len(trajs)), hf.PAD_ID, "cpu")
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    assert aux.router_aux.metrics()["trainer/router_aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-6)
    out.aux_loss.backward()
    for p, q, m in zip(plain, with_aux, routers(model)):
        # float64 models, but transformers' load-balancing loss sums in float32 (and Mixtral routes in float32)
        torch.testing.assert_close(q - p, coef * m.weight.grad, atol=1e-6 * float(q.abs().max()), rtol=0)
        assert (q - p).abs().max() > 1e-6  # the loss reaches the router


def test_the_router_aux_loss_of_micro_batches_is_weighted_by_their_sequences(moe_dir):
    group = _engine_group(moe_dir, [5, 6, 7], n=4)
    learner = _moe_learner(moe_dir, "off", router_aux_loss_coef=0.1, micro_batch_size=1)
    whole = _moe_learner(moe_dir, "off", router_aux_loss_coef=0.1, micro_batch_size=4)
    metrics = learner.update([group])
    assert learner.router_aux.weight == 0.0  # reset by the step's metrics
    assert 0 < metrics["trainer/router_aux_loss"]
    # the same prompt, so similar micro-batches: the mean of their losses is near the whole batch's
    assert metrics["trainer/router_aux_loss"] == pytest.approx(whole.update([group])["trainer/router_aux_loss"],
                                                               rel=0.5)


def test_a_router_aux_loss_on_a_dense_model_is_one_clear_error(tmp_path):
    hf.build_tiny_model(tmp_path, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=32))
    with pytest.raises(ValueError, match=r"router_aux_loss_coef = 0.01: the model has no MoE router"):
        Learner(hf.load_model(tmp_path), algorithm=AlgorithmConfig(), trainer=TrainerConfig(router_aux_loss_coef=0.01),
                pad_token_id=0)


def test_an_env_episode_replays_each_positions_routing_of_the_turn_that_fed_it_across_a_weight_swap(moe_dir):
    """Two model turns with an observation between them and new weights (version 1) swapped in after the first:
    the positions the first turn fed keep version 0's routing, the ones fed first by the second turn carry version
    1's (its prefill recomputes the whole context, whose routing is not the record); the trainer replays them."""
    from asyncrl.envs.base import StepResult
    from asyncrl.envs.runner import EpisodeLimits, EpisodeRunner
    from asyncrl.envs.transcript import HFCodec
    from engines.routing import Routing, unpack_routing

    engine = TorchEngine(str(moe_dir), eos_token_ids=[], record_routing=True)
    old, new = hf.load_model(moe_dir), hf.load_model(moe_dir)
    gen = torch.Generator().manual_seed(3)
    new.load_state_dict({k: (v + 0.3 * torch.randn(v.shape, generator=gen)).detach()
                         for k, v in old.named_parameters()}, strict=False)

    class SwapEnv:
        async def reset(self, row):
            return row["prompt"]

        async def step(self, action):
            if engine.version == 0:
                await asyncio.to_thread(engine.load_weights, dict(new.named_parameters()), 1)
                return StepResult(observation="7+", reward=0.0, done=False)
            return StepResult(reward=1.0, done=True)

    codec = HFCodec(hf.load_tokenizer(moe_dir))
    play = EpisodeRunner(engine=engine, env_cls=SwapEnv, env_kwargs={}, codec=codec, fmt="none",
                         sampling=SamplingParams(max_new_tokens=3, seed=5), limits=EpisodeLimits())
    (traj,) = asyncio.run(play.run_group(0, {"prompt": "12+3"}, 1))
    asyncio.run(engine.close())
    assert traj.turns == 2 and traj.versions[:3] == [0, 0, 0] and traj.versions[-3:] == [1, 1, 1]
    recorded = unpack_routing(traj.routed_experts, traj.routing_shape)
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    assert recorded.shape[0] == ids.shape[1] - 1
    own = {}
    for name, model in (("old", old), ("new", new)):
        routing = Routing(model)
        with torch.no_grad(), routing.recording() as rec:
            model(ids)
        own[name] = torch.stack(rec, dim=1)[:-1]
        routing.remove()
    cut = len(traj.prompt_ids) + 3 - 1  # the first turn fed the prompt and its tokens but the last
    assert torch.equal(recorded[:cut], own["old"][:cut])
    assert torch.equal(recorded[cut:], own["new"][cut:])
    assert not torch.equal(own["old"][:cut], own["new"][:cut])  # the second turn's prefill routed them otherwise
    _assert_replayed(_moe_learner(moe_dir, "rollout"), Group(group_id=0, min_version=0, trajectories=[
        msgspec.structs.replace(traj, reward=1.0)]))


def test_an_moe_reference_and_critic_replay_the_engines_routing(moe_dir):
    from transformers import AutoConfig, AutoModelForTokenClassification

    from asyncrl.config.schema import CriticConfig
    from asyncrl.training.critic import Critic, load_value_model
    from asyncrl.training.reference import ReferencePolicy

    trajs = _rerouted(_engine_group(moe_dir, [5, 6, 7]), 1).trajectories  # experts the models would not choose
    reference = ReferencePolicy.load(str(moe_dir), dtype="float32", pad_token_id=hf.PAD_ID, routing_replay="rollout")
    _check_used(_experts_used(reference.model, lambda: reference.response_logprobs(trajs)), trajs)
    own = ReferencePolicy.load(str(moe_dir), dtype="float32", pad_token_id=hf.PAD_ID, routing_replay="measure")
    assert own.routing is None  # measuring is the policy's diagnostic: the reference routes on its own
    assert own.response_logprobs(trajs) != reference.response_logprobs(trajs)
    if type(AutoConfig.from_pretrained(moe_dir)) not in AutoModelForTokenClassification._model_mapping:
        return  # this family has no token-classification head in transformers: no critic on it
    critic = Critic(load_value_model(str(moe_dir)), CriticConfig(), pad_token_id=hf.PAD_ID, micro_batch_size=64,
                    routing_replay="rollout")
    width = max(len(t.response_ids) for t in trajs)
    _check_used(_experts_used(critic.model, lambda: critic.values(trajs, width)), trajs)
    from asyncrl.training.critic import CriticStats

    zeros = torch.zeros(len(trajs), width)
    seen = _experts_used(critic.model, lambda: critic.compute_gradients(trajs, zeros, zeros + 1, CriticStats()))
    _check_used(seen, trajs)


def test_lora_on_an_moe_trains_its_adapters_under_replay_and_the_engine_takes_the_merged_weights(moe_dir):
    """peft's all-linear adapts the attention's linear layers and, through its ParamWrapper, the fused expert weights
    and the router's weight (transformers 5's MoE parameters): replay holds through the adapted model, the
    adapter-off reference shares its routers and replay, and the sync's merged weights (each adapted parameter with
    its delta) reach a recording engine, which then computes the trainer's logprobs."""
    from asyncrl.config.schema import LoraConfig
    from asyncrl.training import lora

    torch.manual_seed(0)
    policy = lora.apply_lora(hf.load_model(moe_dir), LoraConfig(rank=4, alpha=8.0))
    reference = lora.AdapterOffReference(policy, pad_token_id=hf.PAD_ID)
    learner = Learner(policy, algorithm=AlgorithmConfig(routing_replay="rollout"), pad_token_id=hf.PAD_ID,
                      trainer=TrainerConfig(lr=5e-2, micro_batch_size=64), reference=reference)
    assert reference.routing is learner.routing
    group = _rerouted(_engine_group(moe_dir, [5, 6, 7]), 1)
    trajs = group.trajectories
    _check_used(_experts_used(policy, lambda: reference.response_logprobs(trajs)), trajs)
    before = {k: v.clone() for k, v in learner.state_dict_for_sync().items()}
    _assert_replayed(learner, group)
    learner.update([_engine_group(moe_dir, [8, 9], group_id=1)])
    after = learner.state_dict_for_sync()
    assert any(not torch.equal(after[k], before[k]) for k in after)  # the merged adapters moved the weights
    assert set(after) == set(lora.adapted_weights(policy))  # a subset: the adapted weights only
    experts = [k for k in after if k.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"))]
    assert experts or any("shared_expert" in k for k in after)  # Qwen2-MoE: peft reaches its shared expert only
    assert all(not torch.equal(after[k], before[k]) for k in experts)  # merged with their deltas
    engine = TorchEngine(str(moe_dir), seed=0, record_routing=True)
    try:
        engine.load_weights(dict(after), version=2)
        (out,) = asyncio.run(engine.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=3)))
    finally:
        asyncio.run(engine.close())
    for c in out:
        want = torch.tensor(learner.teacher_forced_logprobs([5, 6, 7], c.response_ids, 1.0))
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)
        assert c.versions == [2] * len(c.response_ids) and c.routing_shape == [2, 2]


def test_the_trainers_fused_experts_split_into_the_checkpoints_tensors_bit_for_bit(moe_dir):
    """What vLLM loads (engines/moe_names.py): the trainer's state dict under the checkpoint file's names and
    values, every fused expert tensor split per expert."""
    import json

    from safetensors.torch import load_file

    from engines.moe_names import checkpoint_shapes, checkpoint_tensors

    model_type = json.loads((moe_dir / "config.json").read_text())["model_type"]
    files = sorted(moe_dir.glob("*.safetensors"))
    saved = {k: v for f in files for k, v in load_file(f).items()}
    state = hf.load_model(moe_dir).state_dict()
    split = checkpoint_tensors(state, model_type)
    assert set(split) - {"lm_head.weight"} == set(saved) - {"lm_head.weight"}
    for name, tensor in saved.items():
        assert torch.equal(split[name], tensor), name
    assert checkpoint_shapes({k: tuple(v.shape) for k, v in state.items()}, model_type) == \
        {k: tuple(v.shape) for k, v in split.items()}
    assert checkpoint_tensors(split, model_type).keys() == split.keys()  # already the checkpoint's: unchanged
