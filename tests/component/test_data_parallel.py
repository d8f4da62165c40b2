"""Data-parallel Learner (training/parallel.py): 2 trainer ranks on gloo train the weights 1 process trains.

Each rank is a spawned process joining the trainer group over a TCPStore on 127.0.0.1; both ranks get the same
step (all groups) and train their half of every mini-batch. The single-process Learner trains the same groups
from the same initial weights; after 3 train steps the full weights (rank 0's `state_dict_for_sync`, for FSDP2
gathered with `full_tensor()` by both ranks) agree within 1e-6, for a token-level and a sequence-level loss
aggregation, with micro-batches, two mini-batches per step and grad clipping in play.

The models are float64: in float32 the order of a sum alone moves weights by ~4e-6 after 3 AdamW steps (one
process, micro-batches of 1 vs 4: Adam's first step divides near-zero gradients by their own magnitude), which
would hide a real error of that size; in float64 that floor is ~1e-13, so 1e-6 tests the maths.
"""

from __future__ import annotations

import queue
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from asyncrl.config.schema import AlgorithmConfig, CriticConfig, TrainerConfig
from asyncrl.messages import Group, Trajectory
from asyncrl.training.critic import Critic
from asyncrl.training.learner import Learner
from asyncrl.training.parallel import DataParallel
from asyncrl.training.reference import ReferencePolicy

PAD, VOCAB, STEPS, WORLD = 0, 24, 3, 2
# token-mean with decoupled PPO + token TIS and a KL loss to a trainer-side reference (proximal and reference
# rows: each rank forwards half and all-gathers); seq-mean-token-mean on the plain PPO path; PPO with a critic
# (values gathered, value loss over the whole mini-batch's tokens, the critic's gradients summed)
CASES = {
    "token-mean": dict(loss_agg="token-mean", decoupled=True, correction="token_tis", kl_mode="loss", kl_coef=0.1),
    "seq-mean-token-mean": dict(loss_agg="seq-mean-token-mean"),
    "gae-critic": dict(advantage="gae", lam=0.9),
}


def _model(seed: int = 0, cls: type = Qwen2ForCausalLM, **kw: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)).double()


def _learner(case: str, micro_batch_size: int, parallel: DataParallel | None = None, compile: bool = False,
             device: str = "cpu", max_tokens: int = 0, chunk: int = 0, share: bool = False) -> Learner:
    algorithm = AlgorithmConfig(**CASES[case])
    trainer = TrainerConfig(lr=1e-3, grad_clip=0.5, mini_batches=2, micro_batch_size=micro_batch_size,
                            compile=compile, max_tokens_per_micro_batch=max_tokens, logprob_chunk_tokens=chunk,
                            share_prompts=share)
    critic = reference = None
    if algorithm.advantage == "gae":
        critic = Critic(_model(2, Qwen2ForTokenClassification, num_labels=1), CriticConfig(lr=1e-3),
                        pad_token_id=PAD, micro_batch_size=micro_batch_size, device=device,
                        max_tokens_per_micro_batch=max_tokens)
    if algorithm.kl_mode != "off":
        reference = ReferencePolicy(_model(1), pad_token_id=PAD, micro_batch_size=micro_batch_size, device=device,
                                    max_tokens_per_micro_batch=max_tokens, logprob_chunk_tokens=chunk)
    return Learner(_model(), algorithm=algorithm, trainer=trainer, pad_token_id=PAD, critic=critic,
                   reference=reference, parallel=parallel, device=device)


def _steps(shared: bool = False) -> list[list[Group]]:
    """STEPS steps of 4 groups × 2 samples: ragged prompts and responses, loss-mask holes, mixed temperatures,
    behaviour logprobs near the initial policy's; `shared`: a group's two samples reply to one prompt (as GRPO's)."""
    probe = _learner("seq-mean-token-mean", 8)
    gen = torch.Generator().manual_seed(1)
    steps = []
    for s in range(STEPS):
        groups = []
        for g in range(4):
            trajs = []
            for i in range(2):
                p_len, r_len = 1 + (g + (0 if shared else i)) % 3, 2 + (5 * g + 3 * i + s) % 9
                if i == 0 or not shared:
                    prompt = torch.randint(1, VOCAB, (p_len,), generator=gen).tolist()
                response = torch.randint(1, VOCAB, (r_len,), generator=gen).tolist()
                temp = [1.0, 0.8, 1.2][(g + i) % 3]
                tf = torch.tensor(probe.teacher_forced_logprobs(prompt, response, temp))
                trajs.append(Trajectory(
                    seq_id=100 * s + 2 * g + i, group_id=10 * s + g, group_size=2, prompt_ids=prompt,
                    response_ids=response, loss_mask=(torch.rand(r_len, generator=gen) > 0.25).tolist(),
                    behavior_logprobs=(tf + 0.2 * torch.randn(r_len, generator=gen)).tolist(),
                    versions=[s] * r_len, min_version=s, max_version=s, finish_reason="stop",
                    reward=float(torch.rand((), generator=gen)), temperature=temp))
            groups.append(Group(group_id=10 * s + g, min_version=s, trajectories=trajs))
        steps.append(groups)
    return steps


def _train(learner: Learner, steps: list[list[Group]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """-> the full policy weights (with the critic's, prefixed "critic."), and each step's loss metrics."""
    keys = ("trainer/loss", "critic/value_loss")
    losses = [m.get(k, 0.0) for groups in steps for m in [learner.update(groups)] for k in keys]
    weights = {k: v.clone() for k, v in learner.state_dict_for_sync().items()}
    if learner.critic is not None:
        weights.update({f"critic.{k}": v.clone() for k, v in learner.dp.full_state_dict(learner.critic.model).items()})
    return weights, losses


def _rank_main(rank: int, port: int, mode: str, steps: list[list[Group]], out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dp = DataParallel.join(mode, store=store, rank=rank, world_size=WORLD, timeout_s=60)  # type: ignore[arg-type]
    try:
        result = {}
        for case in CASES:
            # micro-batch of 1: each rank's 2 samples of a mini-batch accumulate over 2 backwards
            weights, losses = _train(_learner(case, 1, dp), steps)
            result[case] = ({k: v.numpy() for k, v in weights.items()}, losses)
        for case in ("token-mean", "gae-critic"):
            # a token budget of 18 (samples of 3-13 tokens): the ranks' shares need different counts of
            # micro-batches (1 vs 2 in gradient passes, 3 vs 2 in the forwards of the first step): they agree;
            # and the head fused with the log-softmax, 4 rows a chunk, through DDP's and FSDP2's wrappers
            weights, losses = _train(_learner(case, 1, dp, max_tokens=18, chunk=4), steps)
            result[f"{case} by tokens"] = ({k: v.numpy() for k, v in weights.items()}, losses)
        # prompt sharing: each rank's share of a mini-batch is a group, its two replies in one row with their
        # prompt (two rows where the budget of 18 splits them), through DDP's and FSDP2's wrappers
        weights, losses = _train(_learner("token-mean", 2, dp, max_tokens=18, share=True), _steps(shared=True))
        result["token-mean shared prompts"] = ({k: v.numpy() for k, v in weights.items()}, losses)
        if rank == 0:
            out.put(result)
    finally:
        dp.close()


def _result(out: Any, procs: list[Any], limit_s: float) -> Any:
    """Rank 0's result; fails as soon as a rank died instead of waiting out the limit."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a trainer rank exited with {dead} (its traceback is above)"
    raise TimeoutError(f"no result from the trainer ranks in {limit_s} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target: Any, world: int, *args: Any, limit_s: float = 300) -> Any:
    """Run `target(rank, port, *args, out)` in `world` spawned processes; -> what rank 0 put into `out`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = _result(out, procs, limit_s=limit_s)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return result


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_train_the_weights_one_process_trains(mode: str) -> None:
    torch.set_num_threads(1)
    steps = _steps()
    result = _spawn(_rank_main, WORLD, mode, steps, limit_s=240)
    for name, (weights, losses) in result.items():
        case = name.removesuffix(" by tokens").removesuffix(" shared prompts")
        ref_learner = _learner(case, 4)  # one process, micro-batches of 4 (a whole mini-batch)
        initial = {k: v.clone() for k, v in ref_learner.state_dict_for_sync().items()}
        if ref_learner.critic is not None:
            initial.update({f"critic.{k}": v.clone() for k, v in ref_learner.critic.model.state_dict().items()})
        ref_weights, ref_losses = _train(ref_learner, _steps(shared=True) if name.endswith("shared prompts") else steps)
        assert set(weights) == set(ref_weights)
        moved = min(float((ref_weights[k] - initial[k]).abs().max()) for k in ref_weights if "proj.weight" in k)
        assert moved > 1e-4, "the steps must change every layer's weights for the comparison to bite"
        worst = max(float((torch.from_numpy(weights[k]) - ref_weights[k]).abs().max()) for k in ref_weights)
        assert worst < 1e-6, f"{mode} {name}: 2 ranks differ from 1 process by {worst}"
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)


def _lora_learner(micro_batch_size: int, parallel: DataParallel | None = None, chunk: int = 0) -> Learner:
    """Rank-4 adapters on every linear layer of the float64 model (peft; the base frozen), token-mean PPO with a KL
    loss to the policy's own module with its adapters off (the reference a LoRA run gets)."""
    from asyncrl.config.schema import LoraConfig
    from asyncrl.training.lora import AdapterOffReference, apply_lora

    model = apply_lora(_model(), LoraConfig(rank=4, alpha=8.0, target_modules="all-linear"))
    trainer = TrainerConfig(lr=1e-2, grad_clip=0.5, mini_batches=2, micro_batch_size=micro_batch_size,
                            logprob_chunk_tokens=chunk)
    reference = AdapterOffReference(model, pad_token_id=PAD, micro_batch_size=micro_batch_size,
                                    logprob_chunk_tokens=chunk)
    return Learner(model, algorithm=AlgorithmConfig(loss_agg="token-mean", kl_mode="loss", kl_coef=0.1),
                   trainer=trainer, pad_token_id=PAD, reference=reference, parallel=parallel)


def _lora_rank_main(rank: int, port: int, steps: list[list[Group]], out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dp = DataParallel.join("ddp", store=store, rank=rank, world_size=WORLD, timeout_s=60)
    try:
        learner = _lora_learner(1, dp, chunk=5)  # the fused head through peft and DDP
        weights, losses = _train(learner, steps)
        adapter = {k: v.numpy() for k, v in learner.checkpoint_state()[0]["policy"].items()}
        if rank == 0:
            out.put(({k: v.numpy() for k, v in weights.items()}, losses, adapter))
    finally:
        dp.close()


def test_two_ddp_ranks_train_the_lora_adapters_one_process_trains() -> None:
    """LoRA with trainer.num_ranks = 2: DDP reduces the adapters' gradients (the frozen base has none); the merged
    weights the generators get and the adapter a checkpoint keeps equal one process's within 1e-6."""
    pytest.importorskip("peft")
    torch.set_num_threads(1)
    steps = _steps()
    weights, losses, adapter = _spawn(_lora_rank_main, WORLD, steps, limit_s=240)
    ref_learner = _lora_learner(4)
    initial = {k: v.clone() for k, v in ref_learner.state_dict_for_sync().items()}
    ref_weights, ref_losses = _train(ref_learner, steps)
    ref_adapter = ref_learner.checkpoint_state()[0]["policy"]
    assert set(weights) == set(ref_weights) and set(adapter) == set(ref_adapter)
    assert {"lora_A", "lora_B"} <= {part for k in ref_adapter for part in k.split(".")}
    moved = min(float((ref_weights[k] - initial[k]).abs().max()) for k in ref_weights if "proj.weight" in k)
    assert moved > 1e-4, "the adapters must move every adapted layer's merged weight for the comparison to bite"
    worst = max(float((torch.from_numpy(weights[k]) - ref_weights[k]).abs().max()) for k in ref_weights)
    worst_adapter = max(float((torch.from_numpy(adapter[k]) - ref_adapter[k]).abs().max()) for k in ref_adapter)
    assert worst < 1e-6 and worst_adapter < 1e-6, f"2 DDP ranks differ from 1 process by {worst}, {worst_adapter}"
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)


def _moe_model() -> torch.nn.Module:
    """A tiny float64 Qwen3-MoE (2 layers of 4 experts, top-2), transformers' eager experts (grouped_mm takes no
    float64)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True)).double()
    model.set_experts_implementation("eager")
    return model


def _moe_learner(micro_batch_size: int, parallel: DataParallel | None = None) -> Learner:
    trainer = TrainerConfig(lr=1e-3, grad_clip=0.5, mini_batches=2, micro_batch_size=micro_batch_size)
    return Learner(_moe_model(), algorithm=AlgorithmConfig(loss_agg="token-mean", routing_replay="rollout"),
                   trainer=trainer, pad_token_id=PAD, parallel=parallel)


def _routed_steps() -> list[list[Group]]:
    """`_steps()` with an engine's routing on every trajectory: random top-2 experts per fed position and layer."""
    import msgspec

    from engines.routing import pack_routing

    gen = torch.Generator().manual_seed(2)
    out = []
    for groups in _steps()[:2]:
        routed = []
        for g in groups:
            trajs = []
            for t in g.trajectories:
                positions = len(t.prompt_ids) + len(t.response_ids) - 1
                experts = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(positions * 2)])
                trajs.append(msgspec.structs.replace(t, **pack_routing(experts.view(positions, 2, 2))))
            routed.append(Group(group_id=g.group_id, min_version=g.min_version, trajectories=trajs))
        out.append(routed)
    return out


def _moe_rank_main(rank: int, port: int, mode: str, steps: list[list[Group]], out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dp = DataParallel.join(mode, store=store, rank=rank, world_size=WORLD, timeout_s=60)  # type: ignore[arg-type]
    try:
        weights, losses = _train(_moe_learner(1, dp), steps)
        if rank == 0:
            out.put(({k: v.numpy() for k, v in weights.items()}, losses))
    finally:
        dp.close()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_train_an_moe_replaying_its_routing_to_the_weights_one_process_trains(mode: str) -> None:
    """Each rank replays its share's recorded routing (its micro-batches' rows of the step): the experts and
    routers DDP reduces and FSDP2 shards end where one process's do (within 1e-6, float64)."""
    torch.set_num_threads(1)
    steps = _routed_steps()
    weights, losses = _spawn(_moe_rank_main, WORLD, mode, steps, limit_s=240)
    ref_learner = _moe_learner(4)
    initial = {k: v.clone() for k, v in ref_learner.state_dict_for_sync().items()}
    ref_weights, ref_losses = _train(ref_learner, steps)
    assert set(weights) == set(ref_weights)
    for part in ("mlp.gate.weight", "mlp.experts.gate_up_proj"):  # the routers and the experts trained
        assert min(float((ref_weights[k] - initial[k]).abs().max()) for k in ref_weights if k.endswith(part)) > 1e-4
    worst = max(float((torch.from_numpy(weights[k]) - ref_weights[k]).abs().max()) for k in ref_weights)
    assert worst < 1e-6, f"{mode}: 2 ranks differ from 1 process by {worst}"
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
