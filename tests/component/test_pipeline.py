"""The step pipeline (asyncrl/pipeline.py) with fakes, asserting the recorded order of events (never
wall-clock bounds): the trainer's half (prefetch, update, send, release, steps in order) through the Trainer
role, and the controller's half (ask ahead, arm, receive, publish) with fake trainer, generators and gate."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from asyncrl.messages import Group
from asyncrl.pipeline import StepPipeline
from asyncrl.telemetry.metrics import REPORT_KEY, Last, Max, Rate, RoleStats

torch.set_num_threads(1)


def run(coro: Any, timeout: float = 5.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


# -- the trainer's half, through the Trainer role ---------------------------------------------------
class FakeLearner:
    """Counts versions like the Learner; `update` records what it trained on and when."""

    def __init__(self, log: list[str]) -> None:
        self.version = 0
        self.log = log
        self.weights = {"w": torch.zeros(2)}

    def update(self, groups: list[Group]) -> dict[str, float]:
        self.log.append(f"update {self.version} {[g.group_id for g in groups]}")
        time.sleep(0.05)  # long enough for a prefetch to land meanwhile
        self.log.append(f"updated {self.version}")
        self.version += 1
        self.weights["w"] += 1
        return {"trainer/samples": float(len(groups))}

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        return self.weights


class StepBuffer:
    """`take_step(s)` returns group s at once; records each call (and refuses a wrong step, like the gate)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.taken = 0

    async def take_step(self, step: int, timeout: float | None = None) -> list[Group]:
        if step != self.taken:
            raise ValueError(f"take_step: expected step {self.taken}, got {step}")
        self.taken += 1
        self.log.append(f"take {step}")
        return [Group(group_id=step, min_version=step, trajectories=[])]


class GatedSender:
    """A blocking send (like a collective waiting for its receivers) that proceeds once `release` is set."""

    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log = log
        self.release = threading.Event()
        self.fail = fail
        self.sent: list[tuple[int, float]] = []

    def send(self, tensors: dict[str, torch.Tensor], version: int, *, released: Any = None) -> dict[str, float]:
        self.log.append(f"send {version} start")  # reads `tensors` to the end: never calls released()
        assert self.release.wait(5)
        if self.fail:
            raise RuntimeError("receiver vanished")
        self.sent.append((version, float(tensors["w"][0])))
        self.log.append(f"send {version} done")
        return {"sync/seconds": 0.001, "sync/version": float(version)}


class InstantSender:
    """A send that returns at once (the in-process channel)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def send(self, tensors: dict[str, torch.Tensor], version: int, *, released: Any = None) -> dict[str, float]:
        self.log.append(f"send {version}")
        released()
        return {"sync/version": float(version)}


def make_trainer(log: list[str], sender: Any = None) -> Any:
    from asyncrl.roles.trainer import Trainer

    trainer = Trainer(learner=FakeLearner(log), buffer=StepBuffer(log))  # type: ignore[arg-type]
    trainer.sender = sender if sender is not None else InstantSender(log)
    return trainer


def test_trainer_stats_carry_its_spans_since_the_previous_read():
    trainer = make_trainer([])

    async def go() -> None:
        await trainer.train_step(0)
        await trainer.send_weights()

    run(go())
    first = trainer.stats()
    assert [sp.kind for sp in first.spans] == ["wait_gate", "train", "weights_send"]
    keys = {"trainer/rss_mb", "memory/trainer_peak_gb"}  # and memory/trainer_cuda_peak_gb where CUDA is in use
    assert keys <= set(first.metrics) <= keys | {"memory/trainer_cuda_peak_gb"}
    assert first.values()["trainer/rss_mb"] > 0 and first.values()["memory/trainer_peak_gb"] > 0
    assert trainer.stats().spans == []  # drained by the first read


def test_trainer_prefetches_the_next_steps_groups_while_it_trains():
    log: list[str] = []
    trainer = make_trainer(log)

    async def go() -> None:
        await trainer.train_step(0, prefetch=True)
        await trainer.train_step(1, prefetch=False)
        await trainer.send_weights()
        await trainer.send_weights()

    run(go())
    # step 1's groups were taken while step 0 trained, and taken once
    assert log == ["take 0", "update 0 [0]", "take 1", "updated 0", "send 1", "update 1 [1]", "updated 1",
                   "send 2"]  # (every update starts its send)
    assert trainer.buffer.taken == 2 and trainer.pipeline._prefetch is None


def test_trainer_send_starts_when_the_update_ends_and_the_next_update_waits_for_it():
    log: list[str] = []
    sender = GatedSender(log)
    trainer = make_trainer(log, sender)

    async def go() -> list[dict[str, float]]:
        await trainer.train_step(0, prefetch=True)
        await asyncio.sleep(0.05)
        assert log[-1] == "send 1 start"  # began without anyone asking, and waits for its receivers
        sending = asyncio.ensure_future(trainer.send_weights())
        following = asyncio.ensure_future(trainer.train_step(1))
        await asyncio.sleep(0.1)
        assert "update 1 [1]" not in log  # the send reads the weights: the update waits for it
        sender.release.set()
        first = await sending
        await following
        second = await trainer.send_weights()
        third = await trainer.send_weights()  # nothing started by train_step left: a fresh send
        return [first, second, third]

    stats = run(go())
    assert [s["sync/version"] for s in stats] == [1.0, 2.0, 2.0]
    assert sender.sent == [(1, 1.0), (2, 2.0), (2, 2.0)]  # each version's weights as the update left them
    assert log.index("send 1 done") < log.index("update 1 [1]")


def test_trainer_refuses_to_train_over_a_failed_send_and_the_sender_error_reaches_send_weights():
    log: list[str] = []
    sender = GatedSender(log, fail=True)
    sender.release.set()
    trainer = make_trainer(log, sender)

    async def go() -> None:
        await trainer.train_step(0)
        with pytest.raises(RuntimeError, match="receiver vanished"):
            await trainer.send_weights()
        with pytest.raises(RuntimeError, match="the weight send before this step failed: receiver vanished"):
            await trainer.train_step(1)
        await trainer.train_step(1)  # reported once; the caller decides whether to go on

    run(go())
    assert log.count("update 1 []") == 0 and "update 1 [1]" in log


class ReleasingSender(GatedSender):
    """A sender that, like the collective one, releases the weights (packed) before its broadcast ends."""

    def send(self, tensors: dict[str, torch.Tensor], version: int, *, released: Any = None) -> dict[str, float]:
        copy = {k: v.clone() for k, v in tensors.items()}
        self.log.append(f"send {version} packed")
        released()
        return super().send(copy, version)


def test_trainer_next_update_starts_once_the_send_released_the_weights_not_when_it_ends():
    log: list[str] = []
    sender = ReleasingSender(log)
    trainer = make_trainer(log, sender)

    async def go() -> dict[str, float]:
        await trainer.train_step(0, prefetch=True)
        sending = asyncio.ensure_future(trainer.send_weights())
        await trainer.train_step(1)  # the broadcast is still waiting for its receivers
        assert not sending.done()
        sender.release.set()
        return await sending

    assert run(go())["sync/version"] == 1.0
    assert (1, 1.0) in sender.sent  # the copy taken at version 1, though the weights moved on
    assert log.index("update 1 [1]") < log.index("send 1 done")


def test_trainer_runs_a_step_asked_for_ahead_after_the_one_before_and_pairs_sends_in_order():
    log: list[str] = []
    sender = ReleasingSender(log)
    sender.release.set()
    trainer = make_trainer(log, sender)

    async def go() -> list[dict[str, float]]:
        # as the Controller asks: step 1 right behind step 0, then the sends, oldest first
        first = asyncio.ensure_future(trainer.train_step(0, prefetch=True))
        second = asyncio.ensure_future(trainer.train_step(1))
        await first
        sent = [await trainer.send_weights()]
        await second
        sent.append(await trainer.send_weights())
        return sent

    sent = run(go())
    assert [s["sync/version"] for s in sent] == [1.0, 2.0]
    assert log.index("updated 0") < log.index("update 1 [1]")  # one step at a time, in the order asked
    assert sender.sent == [(1, 1.0), (2, 2.0)]


def test_trainer_runs_steps_in_step_order_whatever_order_they_arrive_in_and_a_failure_ends_the_waiters():
    log: list[str] = []
    sender = ReleasingSender(log)
    sender.release.set()
    trainer = make_trainer(log, sender)

    async def go() -> None:
        second = asyncio.ensure_future(trainer.train_step(1))  # arrives first (Ray may do this)
        await asyncio.sleep(0.05)
        assert not second.done()
        await trainer.train_step(0, prefetch=True)
        await second
        for _ in range(2):
            await trainer.send_weights()
        # a step that fails wakes the one asked for behind it, with an error instead of a wait forever
        trainer.learner.update = lambda groups: (_ for _ in ()).throw(RuntimeError("nan loss"))
        behind = asyncio.ensure_future(trainer.train_step(3))
        with pytest.raises(RuntimeError, match="nan loss"):
            await trainer.train_step(2)
        with pytest.raises(RuntimeError, match="an earlier train step failed"):
            await behind

    run(go())
    assert log.index("updated 0") < log.index("update 1 [1]")


# -- the controller's half --------------------------------------------------------------------------
class FakeTrainer:
    """The trainer endpoint: each step waits for `finish[step]`; sends complete at once."""

    def __init__(self, log: list[str], fail_step: int | None = None) -> None:
        self.log = log
        self.finish = {s: asyncio.Event() for s in range(8)}
        self.fail_step = fail_step
        self.sends = 0

    async def train_step(self, step: int, *, prefetch: bool) -> dict[str, float]:
        self.log.append(f"asked {step}" + (" prefetch" if prefetch else ""))
        await self.finish[step].wait()
        if step == self.fail_step:
            raise RuntimeError("nan loss")
        self.log.append(f"trained {step}")
        return {"trainer/step": float(step)}

    async def send_weights(self) -> dict[str, float]:
        self.sends += 1
        self.log.append(f"sent {self.sends}")
        return {"sync/seconds": 0.0}


class FakeGenerator:
    """A generator endpoint; an armed receive waits until the trainer has sent that version."""

    def __init__(self, index: int, log: list[str], trainer: FakeTrainer, armable: bool = True) -> None:
        self.index, self.log, self.trainer, self.armable = index, log, trainer, armable
        self.held = 0
        self.pending: list[asyncio.Task] = []

    async def can_arm_receive(self) -> bool:
        return self.armable

    async def receive_weights(self, *, armed: bool = False) -> dict[str, float]:
        self.log.append(f"g{self.index} receive {self.held + 1}" + (" armed" if armed else ""))
        while self.trainer.sends <= self.held:
            await asyncio.sleep(0.001)
        self.held += 1
        self.log.append(f"g{self.index} holds {self.held}")
        return {}


class FakeGate:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def publish(self, version: int) -> None:
        await asyncio.sleep(0)  # a call to another actor: the tasks already started run first
        self.log.append(f"publish {version}")


def make_steps(log: list[str], total: int = 3, armable: bool = True, fail_step: int | None = None):
    trainer = FakeTrainer(log, fail_step)
    gens = [FakeGenerator(i, log, trainer, armable) for i in range(2)]
    return trainer, gens, StepPipeline(trainer=trainer, generators=gens, buffer=FakeGate(log), total_steps=total)


def test_step_pipeline_asks_the_next_step_behind_the_current_one_and_publishes_after_every_generator_holds_it():
    log: list[str] = []
    trainer, gens, steps = make_steps(log, total=2)

    async def go() -> None:
        await steps.start()
        first = asyncio.ensure_future(steps.step(0))
        await asyncio.sleep(0.02)
        # while step 0 trains: step 1 is already asked for, the receives of version 1 are armed
        assert log == ["asked 0 prefetch", "g0 receive 1 armed", "g1 receive 1 armed", "asked 1"]
        trainer.finish[0].set()
        await first
        trainer.finish[1].set()
        await steps.step(1)
        steps.close()

    run(go())
    assert log.index("trained 0") < log.index("sent 1") < log.index("g0 holds 1") < log.index("publish 1")
    assert log.index("g1 holds 1") < log.index("publish 1")
    # version 2's receives were armed before version 1 was published, and nothing is armed past the end
    assert log.index("g0 receive 2 armed") < log.index("publish 1")
    assert log[-1] == "publish 2" and not any("receive 3" in e for e in log)


def test_step_pipeline_asks_for_the_next_step_after_an_evaluation_not_before():
    log: list[str] = []
    trainer, _, steps = make_steps(log, total=2)
    steps.pause_after = lambda version: version == 1

    async def go() -> None:
        await steps.start()
        trainer.finish[0].set()
        await steps.step(0)
        assert "asked 1" not in log  # the evaluation may still read version 1's weights
        steps.ask_next(1)
        steps.ask_next(1)  # asked once only
        trainer.finish[1].set()
        await steps.step(1)
        steps.close()

    run(go())
    assert log.count("asked 1") == 1 and log.index("publish 1") < log.index("asked 1")
    assert "asked 0 prefetch" in log  # an evaluation does not drain the pipeline


def test_step_pipeline_drains_before_a_checkpoint_no_prefetch_and_nothing_asked_ahead():
    log: list[str] = []
    trainer, _, steps = make_steps(log, total=3)
    steps.drain_after = lambda version: version == 1

    async def go() -> None:
        await steps.start()
        trainer.finish[0].set()
        await steps.step(0)
        assert "asked 1" not in log  # the trainer and the buffer hold all that is not trained yet
        steps.ask_next(1)
        trainer.finish[1].set()
        trainer.finish[2].set()
        await steps.step(1)
        await steps.step(2)

    run(go())
    assert log.index("asked 0") < log.index("publish 1") < log.index("asked 1 prefetch")
    assert "asked 0 prefetch" not in log and "asked 2" in log


def test_step_pipeline_asks_receivers_that_cannot_wait_for_a_send_once_the_step_is_trained():
    log: list[str] = []
    trainer, _, steps = make_steps(log, total=2, armable=False)

    async def go() -> None:
        await steps.start()
        trainer.finish[0].set()
        trainer.finish[1].set()
        for s in range(2):
            await steps.step(s)

    run(go())
    assert not any("armed" in e for e in log)
    assert log.index("trained 0") < log.index("g0 receive 1") < log.index("publish 1")
    assert log.index("trained 1") < log.index("g0 receive 2") < log.index("publish 2")


def test_step_pipeline_failed_step_cancels_its_armed_receives_and_publishes_nothing():
    log: list[str] = []
    trainer, gens, steps = make_steps(log, total=3, fail_step=0)

    async def go() -> None:
        await steps.start()
        trainer.finish[0].set()
        with pytest.raises(RuntimeError, match="nan loss"):
            await steps.step(0)
        steps.close()  # the step asked for ahead is dropped too
        await asyncio.sleep(0.01)
        left = [t for t in asyncio.all_tasks() if t.get_coro().__name__ not in ("go", "wait_for")]
        assert left == []

    run(go())
    assert not any(e.startswith(("publish", "sent")) for e in log)
    assert all(g.held == 0 for g in gens)


def test_the_pipeline_modules_docstring_example_runs_and_holds():
    import doctest

    import asyncrl.pipeline

    result = doctest.testmod(asyncrl.pipeline)
    assert result.attempted >= 10 and result.failed == 0


# -- supervision: a failed sync waits for the re-formed group and syncs again there -------------------
class GroupedGenerator(FakeGenerator):
    """A generator in a named group: a receive made for another group is refused (asyncrl Generator's rule);
    `dead` makes every receive fail, like a generator whose actor died."""

    def __init__(self, index: int, log: list[str], trainer: FakeTrainer) -> None:
        super().__init__(index, log, trainer)
        self.group = "weights"
        self.dead = False

    async def receive_weights(self, *, armed: bool = False, group: str | None = None) -> dict[str, float]:
        if self.dead or group != self.group:
            self.log.append(f"g{self.index} refuses {group}")
            raise RuntimeError("actor died" if self.dead else "another group")
        return await super().receive_weights(armed=armed)


def test_step_pipeline_supervised_sync_waits_for_the_reformed_group_and_syncs_again_there():
    log: list[str] = []
    trainer = FakeTrainer(log)
    gens = [GroupedGenerator(i, log, trainer) for i in range(2)]
    recovered: list[str] = []

    async def recover(exc: BaseException) -> None:  # the supervisor: restart g1, re-form, everyone gets the weights
        recovered.append(str(exc))
        async with steps.sync_lock:
            for g in gens:
                g.group, g.dead = "weights-1", False
            steps.group = "weights-1"
            await trainer.send_weights()
            for g in gens:
                await g.receive_weights(group="weights-1")

    steps = StepPipeline(trainer=trainer, generators=gens, buffer=FakeGate(log), total_steps=2, recover=recover)

    async def go() -> None:
        await steps.start()
        gens[1].dead = True  # dies before step 0's armed receives reach it
        trainer.finish[0].set()
        trainer.finish[1].set()
        await steps.step(0)
        await steps.step(1)
        steps.close()

    run(go())
    assert recovered == ["actor died"]
    # the recovery's sync, step 0's retried one and step 1's: every generator took part in each, and every
    # receive after the recovery was made for the new group (the only refusals are the dead one's)
    assert gens[0].held == gens[1].held == 3
    assert [e for e in log if "refuses" in e] == ["g1 refuses weights"] * log.count("g1 refuses weights")
    assert log[-1] == "publish 2" and log.count("publish 1") == 1


def test_step_pipeline_supervised_sync_raises_what_recover_raises():
    log: list[str] = []
    trainer = FakeTrainer(log)
    gens = [GroupedGenerator(0, log, trainer)]

    async def recover(exc: BaseException) -> None:
        raise RuntimeError("no generator died") from exc

    steps = StepPipeline(trainer=trainer, generators=gens, buffer=FakeGate(log), total_steps=1, recover=recover)

    async def go() -> None:
        await steps.start()
        gens[0].dead = True
        trainer.finish[0].set()
        with pytest.raises(RuntimeError, match="no generator died"):
            await steps.step(0)
        steps.close()

    run(go())
    assert not any(e.startswith("publish") for e in log)


def test_trainer_drop_sender_ends_a_claimed_send_and_the_next_send_waits_for_the_new_sender():
    log: list[str] = []
    old = GatedSender(log)
    trainer = make_trainer(log, old)
    trainer.pipeline.supervised = True

    async def go() -> None:
        await trainer.train_step(0)
        claim = asyncio.ensure_future(trainer.send_weights())
        await asyncio.sleep(0.02)
        trainer.pipeline.drop_sender()  # a generator died: the group is re-formed
        with pytest.raises(RuntimeError, match="re-formed during the send"):
            await claim
        with pytest.raises(RuntimeError, match="being re-formed"):
            await trainer.send_weights()
        step1 = asyncio.ensure_future(trainer.train_step(1))  # the update goes on; its send waits
        await asyncio.sleep(0.1)
        assert "update 1 [1]" in log and "send 2 start" not in log
        trainer.sender = InstantSender(log)
        await step1
        assert (await trainer.send_weights())["sync/version"] == 2.0
        old.release.set()

    run(go())
    assert log.count("send 2") == 1


class ReportingTrainer(FakeTrainer):
    async def send_weights(self, *, report: bool = False) -> dict[str, Any]:
        sent: dict[str, Any] = dict(await super().send_weights())
        if report:
            sent[REPORT_KEY] = RoleStats(metrics={"trainer/rss_mb": Max(float(self.sends))})
        return sent


class ReportingGenerator(FakeGenerator):
    async def receive_weights(self, *, armed: bool = False, report: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = dict(await super().receive_weights(armed=armed))
        if report:
            out[REPORT_KEY] = RoleStats(metrics={"generation/tokens_per_s": Rate(10.0 * (self.index + 1))})
        return out


class ReportingGate(FakeGate):
    async def publish(self, version: int, *, report: bool = False) -> RoleStats | None:
        await super().publish(version)
        return RoleStats(metrics={"buffer/train_depth": Last(float(version))}) if report else None


def test_step_pipeline_with_reports_keeps_each_roles_window_report_from_the_replies_it_awaits():
    log: list[str] = []
    trainer = ReportingTrainer(log)
    gens = [ReportingGenerator(i, log, trainer) for i in range(2)]
    steps = StepPipeline(trainer=trainer, generators=gens, buffer=ReportingGate(log), total_steps=2,
                         with_reports=True)

    async def go() -> list:
        await steps.start()
        trainer.finish[0].set()
        trainer.finish[1].set()
        out = []
        for s in range(2):
            metrics, sent = await steps.step(s)
            assert REPORT_KEY not in sent and sent == {"sync/seconds": 0.0}  # the row gets the send's statistics only
            out.append(steps.take_reports())
        steps.close()
        return out

    first, second = run(go())
    for version, reports in ((1, first), (2, second)):
        by_role = {role: r.metrics for role, r in reports}
        assert sorted(by_role) == ["buffer", "generator/0", "generator/1", "trainer"]
        assert by_role["trainer"]["trainer/rss_mb"] == Max(float(version))  # this step's send's report
        assert by_role["generator/1"]["generation/tokens_per_s"] == Rate(20.0)
        assert by_role["buffer"]["buffer/train_depth"] == Last(float(version))
    assert steps.take_reports() == []
