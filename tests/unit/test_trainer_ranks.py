"""Rank 0 driving the other trainer ranks (asyncrl/roles/trainer_ranks.py), with fake learners and in-process
ranks: the same groups everywhere, the weights' gather on every rank inside the update (never outside it), the
send reads what rank 0 gathered, a failed rank's error wins, ranks that disagree on the version are an error."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.pipeline import UpdatePipeline
from asyncrl.roles.trainer_ranks import RankedLearner, TrainerRank


class FakeLearner:
    def __init__(self, log: list[str], name: str, fail: BaseException | None = None) -> None:
        self.log, self.name, self.fail, self.version = log, name, fail, 0

    def update(self, groups):
        self.log.append(f"{self.name} update {groups}")
        if self.fail is not None:
            raise self.fail
        self.version += 1
        return {"trainer/loss": 1.0}

    def state_dict_for_sync(self):
        self.log.append(f"{self.name} gather {self.version}")
        return {"w": self.version}

    def restore_state(self, tensors, state):
        self.version = state["version"]


class Store:
    async def take_step(self, step, timeout=None):
        return [f"groups of {step}"]


class Sender:
    def __init__(self) -> None:
        self.sent = []

    def send(self, tensors, version, *, released=None):
        self.sent.append((dict(tensors), version))
        released()
        return {}


def test_every_rank_trains_the_same_groups_and_gathers_inside_the_update_and_the_send_reads_rank_0s_gather():
    log: list[str] = []

    async def main():
        ranked = RankedLearner(FakeLearner(log, "rank0"), [TrainerRank(FakeLearner(log, "rank1"), 1)],
                               asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="no weights gathered"):
            ranked.state_dict_for_sync()
        await ranked.gather_weights()
        pipeline = UpdatePipeline(learner=ranked, source=Store())
        pipeline.sender = sender = Sender()
        for step in range(2):
            out = await pipeline.train_step(step, prefetch=False)
            assert out.metrics == {"trainer/loss": 1.0}
            await pipeline.send_weights()
        return sender.sent

    sent = asyncio.run(main())
    assert sent == [({"w": 1}, 1), ({"w": 2}, 2)]
    for rank in ("rank0", "rank1"):  # gathers only after a change, each after that change, on every rank
        assert [e for e in log if e.startswith(rank)] == [
            f"{rank} gather 0", f"{rank} update ['groups of 0']", f"{rank} gather 1",
            f"{rank} update ['groups of 1']", f"{rank} gather 2"]


def test_a_failed_rank_fails_the_update_with_its_own_error_before_rank_0s():
    class RankDied(Exception):
        pass

    class DeadRank:
        async def update(self, groups):
            raise RankDied("rank 1's actor died")

    async def main():
        own = FakeLearner([], "rank0", fail=RuntimeError("gloo: connection closed by peer"))
        ranked = RankedLearner(own, [DeadRank()], asyncio.get_running_loop())
        await asyncio.to_thread(ranked.update, ["g"])

    with pytest.raises(RankDied, match="rank 1's actor died"):
        asyncio.run(main())


def test_a_rank_that_holds_another_version_after_the_update_is_an_error():
    class Behind:
        async def update(self, groups):
            return 7

    async def main():
        ranked = RankedLearner(FakeLearner([], "rank0"), [Behind()], asyncio.get_running_loop())
        await asyncio.to_thread(ranked.update, ["g"])

    with pytest.raises(RuntimeError, match="rank 0 holds version 1, ranks 1.. hold \\[7\\]"):
        asyncio.run(main())


def test_a_restore_runs_on_every_rank_from_the_same_path():
    loaded: list[str] = []

    class Rank:
        async def load_state(self, path):
            loaded.append(path)
            return 4

    async def main():
        own = FakeLearner([], "rank0")
        ranked = RankedLearner(own, [Rank(), Rank()], asyncio.get_running_loop())
        await ranked.load_state("ckpt/step-4", lambda: own.restore_state({}, {"version": 4}))
        return ranked.state_dict_for_sync()

    assert asyncio.run(main()) == {"w": 4}  # rank 0 gathered after its restore
    assert loaded == ["ckpt/step-4", "ckpt/step-4"]


def test_an_in_process_run_refuses_several_trainer_ranks_in_one_line(make_config):
    from asyncrl.deploy.local import LocalDeployment

    with pytest.raises(ValueError, match=r"^trainer.num_ranks = 2: an in-process run \(--local\) trains in one"):
        LocalDeployment(make_config("trainer.num_ranks=2"))


def test_a_sharded_save_and_the_export_gather_run_on_every_rank_and_gather_no_weights_for_a_send(monkeypatch):
    from asyncrl.roles import trainer_ranks
    from asyncrl.training import sharded

    log: list[str] = []
    monkeypatch.setattr(sharded, "save", lambda learner, folder: log.append(f"{learner.name} save {folder}")
                        or {"sharded": {"world_size": 2}})
    monkeypatch.setattr(trainer_ranks, "full_copies", lambda learner, rank: log.append(f"{learner.name} copies")
                        or [f"{learner.name}'s policy" if rank == 0 else None])

    async def main():
        ranked = RankedLearner(FakeLearner(log, "rank0"), [TrainerRank(FakeLearner(log, "rank1"), 1)],
                               asyncio.get_running_loop())
        state = await asyncio.to_thread(ranked.save_shards, "ck/.tmp/shards")
        copies = await asyncio.to_thread(ranked.full_copies)
        return state, copies

    state, copies = asyncio.run(main())
    assert state == {"sharded": {"world_size": 2}} and copies == ["rank0's policy"]  # rank 0's own results
    assert sorted(log) == ["rank0 copies", "rank0 save ck/.tmp/shards", "rank1 copies", "rank1 save ck/.tmp/shards"]
