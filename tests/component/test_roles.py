"""Roles in-process with fakes: a Scorer or Generator talks to a fake hub (records every call) and, for the
generator, a fake RolloutEngine. Bad input — a reward function that raises, hangs or returns garbage, an
engine that raises — is contained: its group is released and counted, the rest of the run goes on."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Callable, Mapping

import pytest
import torch

from asyncrl.messages import Completion, Group, SamplingParams, Trajectory
from asyncrl.roles.generator import Generator
from asyncrl.roles.scorer import Scorer
from asyncrl.telemetry.metrics import Rate, Share, Sum, Total
from engines.base import RolloutEngine

torch.set_num_threads(1)


def run(coro: Any, timeout: float = 5.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


class FakeHub:
    """The async methods a Generator and a Scorer call on the ReplayHub; records every call."""

    def __init__(self, batches: list[list[Trajectory]] | None = None, admit_ids: int = 1_000) -> None:
        self.batches = list(batches or [])
        self.accepted: list[Group] = []
        self.released: dict[str, list[int]] = {"filtered": [], "failed": []}
        self.admits: list[tuple[int, int]] = []  # (max_groups, version) per call
        self.rollouts: list[Trajectory] = []
        self._next_id = 0
        self._admit_ids = admit_ids

    async def admit(self, max_groups: int, version: int, timeout: float | None = None) -> list[int]:
        self.admits.append((max_groups, version))
        n = min(max_groups, self._admit_ids - self._next_id)
        if n <= 0:
            await asyncio.sleep(min(timeout or 0.01, 0.01))
            return []
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        return ids

    async def put_rollouts(self, trajs: list[Trajectory]) -> None:
        self.rollouts.extend(trajs)

    async def get_rollouts(self, max_items: int, timeout: float | None = None) -> list[Trajectory]:
        if self.batches:
            return self.batches.pop(0)
        await asyncio.sleep(0.01)
        return []

    async def accept_groups(self, groups: list[Group]) -> None:
        self.accepted.extend(groups)

    async def release_groups(self, group_ids: list[int], reason: str) -> None:
        self.released[reason].extend(group_ids)


def traj(group_id: int, j: int, text: str, group_size: int = 2) -> Trajectory:
    """One scored-to-be trajectory whose decoded completion is `text` (see `decode` below)."""
    return Trajectory(seq_id=group_id * group_size + j, group_id=group_id, group_size=group_size,
                      prompt_ids=[1], response_ids=[ord(c) for c in text], loss_mask=[True] * len(text),
                      behavior_logprobs=[0.0] * len(text), versions=[0] * len(text), min_version=0,
                      max_version=0, finish_reason="stop", prompt_text=f"p{group_id}",
                      row_json=json.dumps({"answer": "a"}).encode())


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def make_scorer(hub: FakeHub, reward_fn: Callable[..., Any], **kw: Any) -> Scorer:
    return Scorer(scorer_id=0, hub=hub, reward_fn=reward_fn, decode=decode, **kw)


def by_text(prompt: str, completion: str, **fields: Any) -> Any:
    """Reward from the completion text: 'boom' raises, 'nan' / 'str' return garbage, else 1 if 'a'."""
    if completion == "boom":
        raise RuntimeError("user reward bug")
    if completion == "nan":
        return float("nan")
    if completion == "str":
        return "1.0"
    return 1.0 if completion == fields["answer"] else 0.0


# -- Scorer ----------------------------------------------------------------------------------------
def test_scorer_fails_only_the_group_whose_reward_raises_and_accepts_the_others():
    hub = FakeHub()
    scorer = make_scorer(hub, by_text)
    batch = [traj(0, 0, "a"), traj(0, 1, "b"), traj(1, 0, "a"), traj(1, 1, "boom"), traj(2, 0, "b"),
             traj(2, 1, "b")]
    run(scorer.score_batch(batch))
    assert hub.released["failed"] == [1]
    assert [g.group_id for g in hub.accepted] == [0, 2]
    assert [t.reward for t in hub.accepted[0].trajectories] == [1.0, 0.0]
    assert [t.reward for t in hub.accepted[1].trajectories] == [0.0, 0.0]
    assert scorer.counts["reward_errors"] == 1 and scorer.counts["scored"] == 6
    failed = batch[3]
    assert failed.finish_reason == "error" and "RuntimeError: user reward bug" in failed.error
    scorer.stop()


@pytest.mark.parametrize("garbage", ["nan", "str"])
def test_scorer_fails_a_group_whose_reward_is_not_a_finite_number(garbage):
    hub = FakeHub()
    scorer = make_scorer(hub, by_text)
    run(scorer.score_batch([traj(0, 0, garbage), traj(0, 1, "a"), traj(1, 0, "a"), traj(1, 1, "a")]))
    assert hub.released["failed"] == [0]
    assert [g.group_id for g in hub.accepted] == [1]
    assert scorer.counts["reward_errors"] == 1
    scorer.stop()


def test_scorer_times_out_a_hanging_reward_and_fails_its_group_without_hanging():
    hub = FakeHub()
    release = threading.Event()

    def hangs(prompt: str, completion: str, **fields: Any) -> float:
        if completion == "hang":
            release.wait(10)  # far past timeout_s; released at the end so no thread outlives the test
        return 1.0

    scorer = make_scorer(hub, hangs, timeout_s=0.2)
    batch = [traj(0, 0, "a"), traj(0, 1, "hang"), traj(1, 0, "a"), traj(1, 1, "b")]
    t0 = time.monotonic()
    try:
        run(scorer.score_batch(batch))
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        scorer.stop()
    assert 0.15 <= elapsed < 1.5
    assert hub.released["failed"] == [0]
    assert [g.group_id for g in hub.accepted] == [1]
    assert scorer.counts["reward_errors"] == 1
    assert batch[1].finish_reason == "error" and batch[1].error == "reward: timed out"
    assert all(t.error == "" for t in hub.accepted[0].trajectories)


def test_scorer_filters_a_zero_variance_group_and_accepts_a_mixed_one():
    hub = FakeHub()
    scorer = make_scorer(hub, by_text, filter_zero_variance=True)
    run(scorer.score_batch([traj(0, 0, "a"), traj(0, 1, "a"), traj(1, 0, "a"), traj(1, 1, "b")]))
    assert hub.released == {"filtered": [0], "failed": []}
    assert [g.group_id for g in hub.accepted] == [1]
    scorer.stop()


def test_scorer_assembles_a_group_whose_members_arrive_in_separate_batches():
    hub = FakeHub(batches=[[traj(0, 0, "a", group_size=3), traj(1, 0, "b")],
                           [traj(1, 1, "a"), traj(0, 2, "b", group_size=3)],
                           [traj(0, 1, "a", group_size=3)]])
    scorer = make_scorer(hub, by_text)

    async def main() -> None:
        task = asyncio.create_task(scorer.run())
        while len(hub.accepted) < 2:
            await asyncio.sleep(0.005)
        scorer.stop()
        await asyncio.wait_for(task, 2)

    run(main())
    assert [g.group_id for g in hub.accepted] == [1, 0]
    g0 = hub.accepted[1]
    assert [t.seq_id for t in g0.trajectories] == [0, 1, 2]  # members sorted by seq_id
    assert [t.reward for t in g0.trajectories] == [1.0, 1.0, 0.0]
    assert scorer.assembler.pending() == 0


def test_scorer_stats_report_the_window_since_the_previous_read():
    hub = FakeHub()
    scorer = make_scorer(hub, by_text)
    run(scorer.score_batch([traj(0, 0, "a"), traj(0, 1, "boom")]))
    first = scorer.stats()
    assert first.values() == {"scorer/samples_per_s": 2, "scorer/reward_errors": 1}
    assert isinstance(first.metrics["scorer/samples_per_s"], Rate)  # the Controller divides by the window
    assert isinstance(first.metrics["scorer/reward_errors"], Total)  # ... and adds the windows up
    assert "score" in {sp.kind for sp in first.spans}
    again = scorer.stats()  # read resets: nothing scored since
    assert again.values() == {"scorer/samples_per_s": 0, "scorer/reward_errors": 0} and again.spans == []
    run(scorer.score_batch([traj(1, 0, "a"), traj(1, 1, "b")]))
    assert scorer.stats().values() == {"scorer/samples_per_s": 2, "scorer/reward_errors": 0}
    scorer.stop()


# -- Generator -------------------------------------------------------------------------------------
class FakeEngine:
    """A RolloutEngine that answers each prompt with n one-token completions stamped with its version."""

    def __init__(self, fail_calls: set[int] = frozenset()) -> None:
        self.version = 0
        self.calls = 0
        self.fail_calls = set(fail_calls)  # 0-based indices of generate calls that raise
        self.loads: list[int] = []
        self.closed = False

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        call, self.calls = self.calls, self.calls + 1
        await asyncio.sleep(0)
        if call in self.fail_calls:
            raise RuntimeError("engine blew up")
        return [[Completion(prompt_ids=p, response_ids=[7], logprobs=[-0.5], versions=[self.version],
                            finish_reason="stop") for _ in range(params.n)] for p in prompts]

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.loads.append(version)
        self.version = version

    async def close(self) -> None:
        self.closed = True


class FakeReceiver:
    def __init__(self, version: int) -> None:
        self.version = version

    def receive(self) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        return {"w": torch.zeros(1)}, self.version, {"sync/bytes": 4.0}


def make_generator(hub: FakeHub, engine: FakeEngine, concurrency: int = 2, rows: Any = None) -> Generator:
    counter = iter(range(10**6))
    next_row = rows or (lambda: {"prompt": f"q{next(counter)}", "answer": "a"})
    return Generator(generator_id=0, engine=engine, hub=hub, next_row=next_row,
                     encode=lambda s: [ord(c) for c in s], sampling=SamplingParams(n=2, max_new_tokens=1),
                     concurrency=concurrency)


def test_fake_engine_satisfies_the_rollout_engine_protocol():
    assert isinstance(FakeEngine(), RolloutEngine)


async def _run_until(gen: Generator, done: Callable[[], bool], timeout: float = 2.0) -> None:
    task = asyncio.create_task(gen.run())
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        assert not task.done(), f"generator loop died: {task.exception()!r}"
        await asyncio.sleep(0.005)
    gen.stop()
    await asyncio.wait_for(task, 1.0)


def test_generator_releases_groups_as_failed_when_the_engine_raises_and_keeps_going():
    hub = FakeHub()
    engine = FakeEngine(fail_calls={0})
    gen = make_generator(hub, engine)
    run(_run_until(gen, lambda: len(hub.rollouts) >= 4))
    # each group is its own engine request: only the group whose call raised fails
    assert hub.released["failed"] == [0]  # counted once, by the hub (buffer/failed)
    # the loop kept going: groups 1 and 2 were generated, 2 samples each
    assert {t.group_id for t in hub.rollouts[:4]} == {1, 2}
    assert sorted(t.seq_id for t in hub.rollouts[:4]) == [2, 3, 4, 5]


def test_generator_stats_report_the_window_since_the_previous_read():
    hub = FakeHub()
    gen = make_generator(hub, FakeEngine())
    run(_run_until(gen, lambda: len(hub.rollouts) >= 4))
    first = gen.stats()
    assert first.values()["generation/tokens_per_s"] == gen.tokens_generated == len(hub.rollouts)  # 1 token each
    assert {"generate", "wait_gate"} <= {sp.kind for sp in first.spans}
    again = gen.stats()  # read resets: nothing generated since
    assert again.values()["generation/tokens_per_s"] == 0 and again.spans == []
    gen.receiver = FakeReceiver(version=1)
    run(gen.receive_weights())  # in flight: swapped on receipt (the engine keeps no pause record of its own)
    swap = gen.stats()
    assert swap.values()["generation/stall_s"] == swap.values()["generation/stall_s_total"] == gen.swap_s_total > 0
    assert gen.stats().values()["generation/stall_s"] == 0


class PausingEngine(FakeEngine):
    """An engine that keeps its own record of swap pauses (as TorchEngine and vLLM do), since the start."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[float] = []

    def stats(self) -> dict[str, float]:
        return {"engine/swap_pause_s/sum": sum(self.pauses)}


def test_generator_reports_the_engines_swap_pauses_of_the_window_as_its_stall():
    engine = PausingEngine()
    gen = make_generator(FakeHub(), engine)
    engine.pauses.append(0.25)
    first = gen.stats()
    engine.pauses.append(0.5)
    second = gen.stats().metrics
    assert first.values()["generation/stall_s"] == 0.25
    assert second["generation/stall_s"] == Sum(0.5) and second["generation/stall_s_total"] == Total(0.5)
    assert second["generation/stall_share"] == Share(0.5)  # of this generator's time in the step's window


@pytest.mark.parametrize("mode", ["in_flight", "between_requests"])
def test_generator_applies_received_weights_before_its_next_admission(mode):
    hub = FakeHub()
    engine = FakeEngine()
    gen = make_generator(hub, engine, concurrency=1)
    gen.weight_update = mode
    gen.receiver = FakeReceiver(version=3)

    async def main() -> None:
        stats = await gen.receive_weights()
        assert stats == {"sync/bytes": 4.0}
        # in flight: handed to the engine on receipt; between requests: staged until the loop swaps
        assert engine.loads == ([3] if mode == "in_flight" else [])
        await _run_until(gen, lambda: len(hub.rollouts) >= 2)

    run(main())
    assert engine.loads == [3]
    assert hub.admits[0][1] == 3  # admitted with the new version
    assert all(t.min_version == 3 and t.versions == [3] for t in hub.rollouts)


class ArmedReceiver:
    """Like the collective receiver: may be called ahead of the send (`arms_early`) and waits for it."""

    arms_early = True

    def __init__(self) -> None:
        self.sent = threading.Event()
        self.calls: list[bool] = []

    def receive(self, armed: bool = False) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
        self.calls.append(armed)
        assert self.sent.wait(5)
        time.sleep(0.02)  # the transfer
        return {"w": torch.ones(1)}, 4, {"sync/seconds": 0.02, "sync/bytes": 4.0}


def test_generator_armed_receive_waits_for_the_send_and_records_only_the_transfer():
    engine = FakeEngine()
    gen = make_generator(FakeHub(), engine)
    assert not gen.can_arm_receive()  # no receiver yet
    gen.receiver = FakeReceiver(version=3)
    assert not gen.can_arm_receive()  # a receiver that cannot wait for the send
    with pytest.raises(RuntimeError, match="cannot wait"):
        run(gen.receive_weights(armed=True))
    gen.receiver = ArmedReceiver()
    assert gen.can_arm_receive()

    async def main() -> dict[str, float]:
        armed = asyncio.ensure_future(gen.receive_weights(armed=True))
        await asyncio.sleep(0.3)  # the trainer still trains; the loop is free meanwhile
        assert not armed.done()
        gen.receiver.sent.set()
        return await armed

    assert run(main())["sync/bytes"] == 4.0
    assert gen.receiver.calls == [True] and engine.loads == [4]
    (span,) = [sp for sp in gen.recorder.drain() if sp.kind == "weights_recv"]
    assert span.end - span.start == pytest.approx(0.02, abs=0.01)  # not the 0.3 s spent armed


def test_generator_stop_ends_run_promptly_while_the_gate_is_closed():
    hub = FakeHub(admit_ids=0)  # the gate never has room
    gen = make_generator(hub, FakeEngine())

    async def main() -> float:
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(0.05)
        assert not task.done()
        t0 = time.monotonic()
        gen.stop()
        await asyncio.wait_for(task, 1.0)
        return time.monotonic() - t0

    assert run(main()) < 0.5


def test_generator_fails_groups_whose_rows_lack_the_prompt_key():
    hub = FakeHub()
    rows = iter([{"question": "no prompt key"}, {"question": "neither"}])

    def next_row() -> dict[str, str]:
        return next(rows, {"prompt": "ok"})

    gen = make_generator(hub, FakeEngine(), rows=next_row)
    run(_run_until(gen, lambda: len(hub.rollouts) >= 2))
    assert hub.released["failed"] == [0, 1]
    assert hub.rollouts[0].group_id == 2 and hub.rollouts[0].prompt_text == "ok"


def test_scorer_keeps_scoring_after_more_hung_rewards_than_worker_threads():
    # A hung call cannot be killed; it must not hold a slot that later calls need (a 4-thread pool
    # once failed every later sample after four hangs, so no group was ever accepted again).
    hub = FakeHub()
    release = threading.Event()

    def hangs(prompt: str, completion: str, **fields: Any) -> float:
        if completion == "hang":
            release.wait(10)
        return 1.0 if completion == "a" else 0.0

    scorer = make_scorer(hub, hangs, timeout_s=0.05)
    try:
        run(scorer.score_batch([traj(g, j, "hang") for g in range(3) for j in range(2)]))
        run(scorer.score_batch([traj(10, 0, "a"), traj(10, 1, "b")]))
    finally:
        release.set()
        scorer.stop()
    assert hub.released["failed"] == [0, 1, 2]
    assert [g.group_id for g in hub.accepted] == [10]
    assert [t.reward for t in hub.accepted[0].trajectories] == [1.0, 0.0]


# -- Trainer: prefetch of the next step's groups, the send started at the end of the update ---------------
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


class StepHub:
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

    def send(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        self.log.append(f"send {version} start")
        assert self.release.wait(5)
        if self.fail:
            raise RuntimeError("receiver vanished")
        self.sent.append((version, float(tensors["w"][0])))
        self.log.append(f"send {version} done")
        return {"sync/seconds": 0.001, "sync/version": float(version)}


def make_trainer(log: list[str], sender: GatedSender | None = None) -> Any:
    from asyncrl.roles.trainer import Trainer

    trainer = Trainer(learner=FakeLearner(log), hub=StepHub(log))  # type: ignore[arg-type]
    trainer.sender = sender
    return trainer


def test_trainer_stats_carry_its_spans_since_the_previous_read():
    trainer = make_trainer([])
    run(trainer.train_step(0))
    first = trainer.stats()
    assert [sp.kind for sp in first.spans] == ["wait_gate", "train"] and first.metrics == {}
    assert trainer.stats().spans == []  # drained by the first read


def test_trainer_prefetches_the_next_steps_groups_while_it_trains():
    log: list[str] = []
    trainer = make_trainer(log)

    async def go() -> None:
        await trainer.train_step(0, prefetch=True)
        await trainer.train_step(1, prefetch=False)

    run(go())
    # step 1's groups were taken while step 0 trained, and taken once
    assert log == ["take 0", "update 0 [0]", "take 1", "updated 0", "update 1 [1]", "updated 1"]
    assert trainer.hub.taken == 2 and trainer._prefetch is None


def test_trainer_send_starts_when_the_update_ends_and_the_next_update_waits_for_it():
    log: list[str] = []
    sender = GatedSender(log)
    trainer = make_trainer(log, sender)

    async def go() -> list[dict[str, float]]:
        await trainer.train_step(0, send=True, prefetch=True)
        await asyncio.sleep(0.05)
        assert log[-1] == "send 1 start"  # began without anyone asking, and waits for its receivers
        sending = asyncio.ensure_future(trainer.send_weights())
        following = asyncio.ensure_future(trainer.train_step(1, send=True))
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
        await trainer.train_step(0, send=True)
        with pytest.raises(RuntimeError, match="receiver vanished"):
            await trainer.send_weights()
        with pytest.raises(RuntimeError, match="the weight send before this step failed: receiver vanished"):
            await trainer.train_step(1)
        await trainer.train_step(1)  # reported once; the caller decides whether to go on

    run(go())
    assert log.count("update 1 []") == 0 and "update 1 [1]" in log


class ReleasingSender(GatedSender):
    """A sender that, like the collective one, releases the weights (packed) before its broadcast ends."""

    releases_early = True

    def send(self, tensors: dict[str, torch.Tensor], version: int, released: Any = None) -> dict[str, float]:
        copy = {k: v.clone() for k, v in tensors.items()}
        self.log.append(f"send {version} packed")
        released()
        return super().send(copy, version)


def test_trainer_next_update_starts_once_the_send_released_the_weights_not_when_it_ends():
    log: list[str] = []
    sender = ReleasingSender(log)
    trainer = make_trainer(log, sender)

    async def go() -> dict[str, float]:
        await trainer.train_step(0, send=True, prefetch=True)
        sending = asyncio.ensure_future(trainer.send_weights())
        await trainer.train_step(1)  # the broadcast is still waiting for its receivers
        assert not sending.done()
        sender.release.set()
        return await sending

    assert run(go())["sync/version"] == 1.0
    assert sender.sent == [(1, 1.0)]  # the copy taken at version 1, though the weights moved on
    assert log.index("update 1 [1]") < log.index("send 1 done")


def test_trainer_runs_a_step_asked_for_ahead_after_the_one_before_and_pairs_sends_in_order():
    log: list[str] = []
    sender = ReleasingSender(log)
    sender.release.set()
    trainer = make_trainer(log, sender)

    async def go() -> list[dict[str, float]]:
        # as the Controller asks: step 1 right behind step 0, then the sends, oldest first
        first = asyncio.ensure_future(trainer.train_step(0, send=True, prefetch=True))
        second = asyncio.ensure_future(trainer.train_step(1, send=True))
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
        second = asyncio.ensure_future(trainer.train_step(1, send=True))  # arrives first (Ray may do this)
        await asyncio.sleep(0.05)
        assert not second.done()
        await trainer.train_step(0, send=True, prefetch=True)
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
