"""Sharded checkpoints and the HF export of 2 FSDP2 trainer ranks (asyncrl/training/sharded.py), no Ray.

Two spawned gloo ranks train the steps of tests/component/test_data_parallel.py with FSDP2. After 2 steps rank 0
writes a checkpoint with asyncrl/checkpoints/store.py's `save`, whose `write` has every rank write its shards into the
temporary folder (rank 1 learns the folder through the store, as rank 0's actor call tells it in a run). Fresh
learners on both ranks load it and train step 3; the uninterrupted learners train step 3 too: the weights agree
within 1e-6 (float64). The same ranks also load a 1-process checkpoint of whole tensors (resharded into their
slices) and gather the weights for the HF export, which rank 0 writes as one folder that `from_pretrained`
loads. In the parent: the 2-rank checkpoint loads into one process, and a truncated or altered shard is refused;
3 spawned ranks load it as FSDP2 ranks and as DDP ranks (resharded: every value as one process reads it).
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2ForTokenClassification

from asyncrl.checkpoints import store as checkpoint
from asyncrl.config.schema import AlgorithmConfig, CriticConfig, TrainerConfig
from asyncrl.roles.trainer_ranks import full_copies
from asyncrl.training import sharded
from asyncrl.training.critic import Critic
from asyncrl.training.learner import Learner
from asyncrl.training.parallel import DataParallel, copy_weights
from asyncrl.training.reference import ReferencePolicy
from tests.component.test_data_parallel import CASES as CASES_KW
from tests.component.test_data_parallel import PAD, _model, _spawn, _steps

pytestmark = pytest.mark.slow  # spawned gloo ranks importing torch: about 90 s on 2 cores

WORLD, CASES = 2, ("token-mean", "gae-critic")  # the second one has a critic with its own optimizer
TOL = 1e-6


def _learner(case: str, micro_batch_size: int, parallel: DataParallel | None = None) -> Learner:
    """test_data_parallel's learner of `case`, its policy with tied embeddings as the runs' tiny models have them
    (one tensor under two names, which a checkpoint writes once and loads into both)."""
    algorithm = AlgorithmConfig(**CASES_KW[case])
    trainer = TrainerConfig(lr=1e-3, grad_clip=0.5, mini_batches=2, micro_batch_size=micro_batch_size)
    critic = reference = None
    if algorithm.advantage == "gae":
        critic = Critic(_model(2, Qwen2ForTokenClassification, num_labels=1), CriticConfig(lr=1e-3),
                        pad_token_id=PAD, micro_batch_size=micro_batch_size)
    if algorithm.kl_mode != "off":
        reference = ReferencePolicy(_model(1), pad_token_id=PAD, micro_batch_size=micro_batch_size)
    return Learner(_model(tie_word_embeddings=True), algorithm=algorithm, trainer=trainer, pad_token_id=PAD,
                   critic=critic, reference=reference, parallel=parallel)


def _full_weights(learner: Learner) -> dict[str, torch.Tensor]:
    """Policy (and critic, "critic."-prefixed) full weights: a collective under FSDP2 (every rank calls it)."""
    out = {k: v.clone() for k, v in learner.state_dict_for_sync().items()}
    if learner.critic is not None:
        out.update({f"critic.{k}": v.clone() for k, v in learner.dp.full_state_dict(learner.critic.model).items()})
    return out


def _save(root: Path, learner: Learner, rank: int, store: dist.Store, case: str) -> Path | None:
    """A checkpoint of `learner` at step 2 (every rank writes its shards; rank 0 seals) -> its folder on rank 0."""
    if rank != 0:
        sharded.save(learner, store.get(f"tmp/{case}").decode())
        return None
    tensors, state = learner.checkpoint_state()
    assert tensors == {}, "a sharded learner hands no whole tensors to rank 0's writer"

    def write(tmp: Path) -> dict[str, Any]:
        store.set(f"tmp/{case}", str(tmp / sharded.SHARDS))
        return sharded.save(learner, tmp / sharded.SHARDS)

    return checkpoint.save(root, step=2, version=learner.version, config_text=case, tensors=tensors, state=state,
                           write=write)


def _restored(case: str, dp: DataParallel, path: Path) -> Learner:
    learner = _learner(case, 1, dp)
    ck = checkpoint.load(path)
    learner.restore_state(ck.tensors, ck.state, shards=ck.path / sharded.SHARDS)
    return learner


def _rank_main(rank: int, port: int, root: str, full_root: str, steps: list, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dp = DataParallel.join("fsdp2", store=store, rank=rank, world_size=WORLD, timeout_s=60)
    try:
        result: dict[str, Any] = {}
        for case in CASES:
            learner = _learner(case, 1, dp)
            for groups in steps[:2]:
                learner.update(groups)
            path = _save(Path(root) / case, learner, rank, store, case)
            dist.broadcast_object_list(paths := [str(path)], src=0, group=dp.group)
            learner.update(steps[2])  # uninterrupted
            uninterrupted = _full_weights(learner)
            resumed = _restored(case, dp, Path(paths[0]))
            assert resumed.version == 2
            resumed.update(steps[2])
            from_full = _restored(case, dp, Path(full_root) / case / "step_00000002")  # 1-process checkpoint
            from_full.update(steps[2])
            copies = full_copies(resumed, rank)  # the HF export's gather
            weights = (_full_weights(resumed), _full_weights(from_full))
            if rank == 0:
                export = checkpoint.export_hf(copies[0], Path(root) / f"export-{case}", copy_model=False)
                # the evaluator's unsharded copy takes rank 0's gathered weights
                evaluated = _model(tie_word_embeddings=True)
                copy_weights(evaluated, {k: v for k, v in weights[0].items() if not k.startswith("critic.")})
                result[case] = {"uninterrupted": uninterrupted, "resumed": weights[0], "from_full": weights[1],
                                "checkpoint": paths[0], "export": str(export), "critic_copy": len(copies) == 2,
                                "evaluated": {k: v.clone() for k, v in evaluated.state_dict().items()}}
        if rank == 0:
            out.put({c: {k: ({n: t.numpy() for n, t in v.items()} if isinstance(v, dict) else v)
                         for k, v in r.items()} for c, r in result.items()})
    finally:
        dp.close()


def _full_checkpoint(root: Path, case: str, steps: list) -> Learner:
    """One process trains 2 steps and writes a checkpoint of whole tensors; -> that learner."""
    learner = _learner(case, 4)
    for groups in steps[:2]:
        learner.update(groups)
    tensors, state = learner.checkpoint_state()
    checkpoint.save(root / case, step=2, version=learner.version, config_text=case, tensors=tensors, state=state)
    return learner


def _worst(a: dict[str, Any], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((torch.as_tensor(a[k]) - b[k]).abs().max()) for k in b)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, Any], list]:
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("sharded")
    steps = _steps()
    for case in CASES:
        _full_checkpoint(tmp / "full", case, steps)
    return tmp, _spawn(_rank_main, WORLD, str(tmp / "ck"), str(tmp / "full"), steps), steps


def _full_state(learner: Learner) -> dict[str, torch.Tensor]:
    """The policy's and the critic's full weights and AdamW state, by name: a collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True) if learner.dp.mode == "fsdp2" else None
    out = {}
    for name, model, opt in sharded._parts(learner):
        msd, osd = get_state_dict(model, opt, options=options)
        out.update({f"{name}/{k}": v.clone() for k, v in msd.items()})
        out.update({f"{name}/{fqn}/{k}": v.clone() for fqn, e in osd["state"].items() for k, v in e.items()})
    return out


def _three_ranks_main(rank: int, port: int, path: str, out: Any) -> None:
    """3 ranks load the 2-rank checkpoint as FSDP2 ranks, then as DDP ranks (the same process group)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60))
    dp = DataParallel.join("fsdp2", store=store, rank=rank, world_size=3, timeout_s=60)
    try:
        result = {}
        for mode in ("fsdp2", "ddp"):
            learner = _restored("gae-critic", DataParallel(mode, dp.group, rank, 3, dp.device), Path(path))
            result[mode] = {k: v.numpy() for k, v in _full_state(learner).items()}
        if rank == 0:
            out.put(result)
    finally:
        dp.close()


@pytest.mark.parametrize("case", CASES)
def test_two_fsdp2_ranks_resumed_from_their_sharded_checkpoint_train_as_if_never_stopped(two_ranks, case):
    tmp, result, steps = two_ranks
    r = result[case]
    files = checkpoint.verify(r["checkpoint"]).files
    shards = sorted(f for f in files if f.startswith(f"{sharded.SHARDS}/"))
    assert len(shards) == WORLD, f"one shard file per rank, each in the manifest: {sorted(files)}"
    assert "policy.safetensors" not in files and "state.msgpack" in files
    worst = _worst(r["resumed"], {k: torch.as_tensor(v) for k, v in r["uninterrupted"].items()})
    assert worst < TOL, f"{case}: resumed differs from uninterrupted by {worst}"
    one = _learner(case, 4)  # and both equal one process's 3 steps (the comparison bites: the weights moved)
    initial = _full_weights(one)
    for groups in steps:
        one.update(groups)
    reference = _full_weights(one)
    assert min(float((reference[k] - initial[k]).abs().max()) for k in reference if "proj.weight" in k) > 1e-4
    assert _worst(r["resumed"], reference) < TOL
    # a 1-process checkpoint of whole tensors, loaded into the 2 ranks' slices, resumes as exactly
    assert _worst(r["from_full"], reference) < TOL


@pytest.mark.parametrize("case", CASES)
def test_the_hf_export_of_two_fsdp2_ranks_is_one_folder_with_the_one_process_weights(two_ranks, case):
    tmp, result, steps = two_ranks
    r = result[case]
    one = _learner(case, 4)
    for groups in steps:
        one.update(groups)
    exported = AutoModelForCausalLM.from_pretrained(r["export"], torch_dtype=torch.float64)
    assert not any(p.name.startswith("shard") for p in Path(r["export"]).iterdir())
    assert _worst(exported.state_dict(), one.model.state_dict()) < TOL
    assert r["critic_copy"] == (one.critic is not None)  # the critic is gathered too, after the policy
    # what the evaluator runs on: rank 0's unsharded copy holding the gathered weights
    assert _worst(r["evaluated"], one.model.state_dict()) < TOL


def test_a_two_rank_sharded_checkpoint_loads_into_one_process(two_ranks):
    tmp, result, steps = two_ranks
    learner = _learner("gae-critic", 4)
    ck = checkpoint.load(result["gae-critic"]["checkpoint"])
    learner.restore_state(ck.tensors, ck.state, shards=ck.path / sharded.SHARDS)
    learner.update(steps[2])
    one = _learner("gae-critic", 4)
    for groups in steps:
        one.update(groups)
    assert _worst(_full_weights(learner), _full_weights(one)) < TOL


def test_a_sharded_checkpoint_of_another_model_is_refused_before_anything_loads(two_ranks):
    tmp, result, _ = two_ranks
    learner = _learner("token-mean", 4)  # no critic, the checkpoint has one
    ck = checkpoint.load(result["gae-critic"]["checkpoint"])
    with pytest.raises(checkpoint.CheckpointError, match="not this learner's .*not in this learner"):
        learner.restore_state(ck.tensors, ck.state, shards=ck.path / sharded.SHARDS)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_shard_file_fails_verify_and_latest_valid_skips_the_checkpoint(two_ranks, tmp_path, damage):
    tmp, result, _ = two_ranks
    root = tmp_path / "checkpoints"
    good = Path(result["token-mean"]["checkpoint"])
    shutil.copytree(good, root / "step_00000002")
    shard = sorted((root / "step_00000002" / sharded.SHARDS).iterdir())[1]  # rank 1's
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-10] ^= 0xFF  # a tensor byte: the header still parses
    shard.write_bytes(bytes(data))
    match = "truncated" if damage == "truncate" else "sha256"
    with pytest.raises(checkpoint.CheckpointError, match=f"{shard.name}.*{match}"):
        checkpoint.verify(root / "step_00000002")
    with pytest.raises(checkpoint.CheckpointError, match=shard.name):
        checkpoint.load(root / "step_00000002")
    assert checkpoint.latest_valid(root) is None  # never loaded by a resume


def test_a_two_rank_sharded_checkpoint_loads_into_three_fsdp2_ranks_and_into_three_ddp_ranks(two_ranks):
    tmp, result, _ = two_ranks
    path = result["gae-critic"]["checkpoint"]
    loaded = _spawn(_three_ranks_main, 3, path)
    one = _learner("gae-critic", 4)  # one process reading the same shards: the full values, weights and AdamW state
    ck = checkpoint.load(path)
    one.restore_state(ck.tensors, ck.state, shards=ck.path / sharded.SHARDS)
    expected = _full_state(one)
    assert any("/exp_avg" in k for k in expected) and any(k.startswith("critic/") for k in expected)
    assert _worst(_full_state(_learner("gae-critic", 4)), expected) > 1e-4  # a fresh learner's are other values
    for mode in ("fsdp2", "ddp"):
        assert _worst(loaded[mode], expected) == 0.0, mode  # resharded 2 -> 3 (uneven pieces), bit for bit
