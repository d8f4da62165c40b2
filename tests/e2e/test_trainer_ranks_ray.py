"""trainer.num_ranks = 2 on Ray (asyncrl/roles/trainer_ranks.py): two trainer actors train every step together
and end with the weights one process gets from the same groups.

Rank 1 records the groups rank 0 hands it; after the run the test replays them through a one-process Learner
built from the same model folder and seed. The tiny config's step is 16 samples in micro-batches of 8, so each
rank's half of the mini-batch is exactly one of the one-process micro-batches, and the summed gradient is the
same two-term sum: the weights agree to float32 rounding (prepare's forwards pad the halves separately, which may
move the last bits). 1e-5 relative (as an absolute bound on the tiny model's O(1) weights) leaves room for that
and is far below what one step changes (lr = 1e-2: every weight moves ~1e-2 per AdamW step). On CPU they came
out equal bit for bit, for DDP and FSDP2.

In both modes a run stopped at a checkpoint resumes on both ranks (`--resume`, and the automatic resume after a
rank's actor is killed), evaluates on rank 0 and exports rank 0's weights as one HF folder; under FSDP2 the
checkpoint holds each rank's shards (asyncrl/training/sharded.py) and the export gathers them.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _in_actor() -> dict[str, Any]:
    """Functions for `actor.__ray_call__` (inside a RoleActor), made in a function so that Ray pickles them by
    value (the actors cannot import this module)."""

    def record_groups(actor: Any) -> None:  # rank 1: keep every step's groups as they arrive
        rank, seen = actor.role, []
        update = rank.update

        async def recording(groups: list[Any]) -> int:
            seen.append(groups)
            return await update(groups)

        rank.update, actor.seen = recording, seen

    def seen(actor: Any) -> list[list[Any]]:
        return actor.seen

    def weights(actor: Any) -> dict[str, Any]:
        """Rank 0's gathered weights (what it sends); rank 1's replica under DDP (under FSDP2 it holds shards)."""
        role = actor.role
        if hasattr(role, "pipeline"):  # the Trainer: rank 0
            tensors = role.pipeline.learner.state_dict_for_sync()
        else:
            tensors = role.learner.state_dict_for_sync() if role.learner.dp.mode == "ddp" else {}
        return {"version": role.learner.version, "tensors": {k: v.detach().clone() for k, v in tensors.items()}}

    return {"record_groups": record_groups, "seen": seen, "weights": weights}


def _replay(cfg: Any, steps: list[list[Any]], start: Any = None) -> dict[str, Any]:
    """One process trains `steps` from the model folder, or from checkpoint folder `start` (a sharded one too)."""
    import torch

    from asyncrl.checkpoints import store as checkpoint
    from asyncrl.deploy.build import build_learner, derive_seed, load_policy, tokenizer_fns
    from asyncrl.training.sharded import SHARDS

    torch.manual_seed(derive_seed(cfg.run.seed, "trainer"))
    tok, _ = tokenizer_fns(cfg.model.path)
    learner = build_learner(cfg, load_policy(cfg), tok.pad_token_id or 0)  # (with its adapters under [model.lora])
    if start is not None:
        ck = checkpoint.load(start)
        learner.restore_state(ck.tensors, ck.state, shards=ck.path / SHARDS)
    for groups in steps:
        learner.update(groups)
    return learner.state_dict_for_sync()


def _run_capturing(cfg: Any, resume: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run `cfg` on Ray with two trainer ranks; -> (the train rows, what the ranks held at the end: "weights" of
    each rank, "steps": the groups rank 1 was handed)."""
    import ray

    from asyncrl.aio import run_loop
    from asyncrl.control.controller import Controller
    from asyncrl.deploy.launch import RayDeployment

    captured: dict[str, Any] = {}
    call = _in_actor()

    class Capturing(RayDeployment):
        async def shutdown(self) -> None:  # before the actors go: what each rank holds now
            captured["weights"] = ray.get([a.__ray_call__.remote(call["weights"])
                                           for a in (self.trainer_actor, *self.rank_actors)])
            captured["steps"] = ray.get(self.rank_actors[0].__ray_call__.remote(call["seen"]))
            await super().shutdown()

    deployment = Capturing(cfg)
    try:
        deployment.wait_ready()
        ray.get(deployment.rank_actors[0].__ray_call__.remote(call["record_groups"]))
    except BaseException:
        run_loop(RayDeployment.shutdown(deployment))
        raise
    rows = [r for r in run_loop(Controller(cfg, deployment, resume=resume).run()) if "trainer/loss" in r]
    return rows, captured


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == v).all()) for k, v in b.items())


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_train_every_step_to_the_weights_of_one_process_and_a_resumed_run_restores_every_rank(
        ray_cluster, make_config, tmp_path, mode):
    """Two ranks train every step to the weights one process trains from the same groups; the run, resumed from
    its checkpoint, restores both ranks, evaluates and exports rank 0's weights."""
    import json

    from engines.hf import load_model

    run_dir = tmp_path / "resume"
    # the tiny config evaluates every 2 steps and at the end (on rank 0's weights) and exports rank 0's weights
    sets = ("trainer.num_ranks=2", f'trainer.parallel="{mode}"', "run.save_every=2", f'run.output_dir="{run_dir}"')
    rows, captured = _run_capturing(first := make_config(*sets, "trainer.total_steps=2"))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["trainer/samples"] == 16 for r in rows), rows  # the whole step's metrics, not one rank's half
    rank0, rank1 = captured["weights"]
    assert rank0["version"] == rank1["version"] == 2  # both ranks trained every step
    assert [sum(len(g.trajectories) for g in step) for step in captured["steps"]] == [16, 16]
    if mode == "ddp":  # replicas: the same gradients and the same AdamW steps, bit for bit
        assert _same(rank1["tensors"], rank0["tensors"])
    expected = _replay(first, captured["steps"])
    assert expected.keys() == rank0["tensors"].keys()
    worst = max(float((rank0["tensors"][k] - v).abs().max()) for k, v in expected.items())
    moved = max(float((rank0["tensors"][k] - v).abs().max()) for k, v in _replay(first, []).items())
    assert worst < 1e-5, worst
    assert moved > 1e-3, moved  # the run trained: the tolerance is far below what it changed
    saved = run_dir / "checkpoints" / "step_00000002"
    files = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()}
    if mode == "fsdp2":  # each rank wrote its shards, rank 0 the rest
        assert len([f for f in files if f.startswith("shards/")]) == 2 and "policy.safetensors" not in files
    else:  # rank 0's replica is every rank's
        assert "policy.safetensors" in files and not any(f.startswith("shards/") for f in files)
    rows, captured = _run_capturing(make_config(*sets, "trainer.total_steps=3"), resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3]  # steps 1-2 read back, step 3 trained after the resume
    rank0, rank1 = captured["weights"]
    assert rank0["version"] == rank1["version"] == 3 and len(captured["steps"]) == 1
    # both ranks trained step 3 from the checkpoint's weights and AdamW state (not from a fresh model's): one
    # process that loads the checkpoint (FSDP2's 2-rank shards, resharded) and trains those groups agrees
    expected = _replay(cfg := make_config(*sets), captured["steps"], start=saved)
    assert max(float((rank0["tensors"][k] - v).abs().max()) for k, v in expected.items()) < 1e-5
    assert max(float((rank0["tensors"][k] - v).abs().max()) for k, v in _replay(cfg, [], start=saved).items()) > 1e-3
    if mode == "ddp":
        assert _same(rank1["tensors"], rank0["tensors"])
    evaluated = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval/" in line]
    assert [r["step"] for r in evaluated] == [0, 2, 3] and all(r["eval/prompts"] == 20 for r in evaluated)
    exported = dict(load_model(str(run_dir / "checkpoint")).state_dict())
    assert _same({k: exported[k] for k in rank0["tensors"]}, rank0["tensors"])


def test_lora_adapters_train_on_two_ddp_ranks_as_in_one_process_and_a_resumed_run_restores_both(
        ray_cluster, make_config, tmp_path):
    """[model.lora] with trainer.num_ranks = 2: both ranks train the adapters (DDP reduces their gradients), the
    merged weights rank 0 sends are what one process trains from the same groups, and a run resumed from a
    checkpoint (the adapter and its AdamW state) continues on both ranks."""
    pytest.importorskip("peft")
    run_dir = tmp_path / "lora"
    sets = ("model.lora.rank=4", "trainer.num_ranks=2", 'trainer.parallel="ddp"', "trainer.eval_every=0",
            "run.save_checkpoint=false", "run.save_every=2", f'run.output_dir="{run_dir}"')
    rows, captured = _run_capturing(first := make_config(*sets, "trainer.total_steps=2"))
    assert [r["step"] for r in rows] == [1, 2] and all(r["trainer/samples"] == 16 for r in rows)
    rank0, rank1 = captured["weights"]
    assert rank0["version"] == rank1["version"] == 2 and _same(rank1["tensors"], rank0["tensors"])
    cfg = make_config(*sets)
    expected = _replay(cfg, captured["steps"])
    assert expected.keys() == rank0["tensors"].keys()  # the adapted layers' merged weights (the torch engine's)
    assert max(float((rank0["tensors"][k] - v).abs().max()) for k, v in expected.items()) < 1e-5
    assert max(float((rank0["tensors"][k] - v).abs().max()) for k, v in _replay(cfg, []).items()) > 1e-3
    saved = run_dir / "checkpoints" / "step_00000002"
    rows, captured = _run_capturing(make_config(*sets, "trainer.total_steps=3"), resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3]
    rank0, rank1 = captured["weights"]
    assert rank0["version"] == rank1["version"] == 3 and _same(rank1["tensors"], rank0["tensors"])
    expected = _replay(cfg, captured["steps"], start=saved)  # from the checkpoint's adapter and AdamW state
    assert max(float((rank0["tensors"][k] - v).abs().max()) for k, v in expected.items()) < 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_killed_trainer_rank_ends_the_attempt_like_the_trainer_and_the_run_resumes_on_both_ranks(
        ray_cluster, make_config, tmp_path, caplog, mode):
    import asyncio
    import os
    import signal

    from asyncrl.deploy.launch import run_with_ray

    steps = 6
    cfg = make_config("trainer.num_ranks=2", f'trainer.parallel="{mode}"', f"trainer.total_steps={steps}",
                      "trainer.eval_every=0", "run.save_checkpoint=false", "run.save_every=2", "logging.live=false",
                      f'run.output_dir="{tmp_path / "resumed"}"')
    attempts = []

    async def kill_rank_1_once(controller, deployment):
        attempts.append(controller)
        if len(attempts) > 1:
            return
        while max((r["step"] for r in controller.rows if "trainer/samples" in r), default=0) < 3:
            await asyncio.sleep(0.02)
        os.kill(await deployment.rank_actors[0].pid.remote(), signal.SIGKILL)

    with caplog.at_level("WARNING", logger="asyncrl.deploy.launch"):
        rows = run_with_ray(cfg, beside=kill_rank_1_once)
    assert len(attempts) == 2 and attempts[1].first_step in (2, 4)  # resumed from a checkpoint before the kill
    assert [r["step"] for r in rows if "trainer/samples" in r] == list(range(1, steps + 1))
    resumed = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert len(resumed) == 1 and resumed[0].startswith("the trainer/1 actor died"), resumed
