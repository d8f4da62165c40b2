"""The generator's two parts besides its admission loop, each alone with fakes: the weight slot (receive into
staging, hand to the engine, wait until the engine holds a version; asyncrl/roles/weight_slot.py) and the sleep
gate (engine users counted, sleep waits for the last, users wait while asleep and give up when stopped;
asyncrl/roles/sleep_gate.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.roles.sleep_gate import SleepGate
from asyncrl.roles.weight_slot import WeightSlot
from asyncrl.telemetry.spans import SpanRecorder
from tests.component.test_generator_sleep import SleepyEngine
from tests.component.test_roles import FakeEngine, FakeReceiver, run


def _slot(engine, mode: str = "in_flight", held: list[int] | None = None) -> WeightSlot:
    return WeightSlot(engine, SpanRecorder("generator/0"), on_held=(held if held is not None else []).append,
                      stopped=asyncio.Event(), weight_update=mode, name="generator 0")


# -- weight slot -----------------------------------------------------------------------------------
def test_an_in_flight_receive_swaps_at_once_and_reports_the_version_before_the_swap():
    engine, held = FakeEngine(), []

    async def main() -> dict[str, float]:
        slot = _slot(engine, held=held)
        slot.receiver = FakeReceiver(version=3)
        return await slot.receive()

    assert run(main()) == {"sync/bytes": 4.0}
    assert engine.loads == [3] and engine.version == 3 and held == [3]


def test_between_requests_the_received_weights_wait_staged_until_apply_pending():
    engine, held = FakeEngine(), []

    async def main() -> WeightSlot:
        slot = _slot(engine, "between_requests", held)
        slot.receiver = FakeReceiver(version=2)
        await slot.receive()
        assert slot.pending is not None and slot.pending[1] == 2 and engine.loads == [] and held == []
        await slot.apply_pending()
        await slot.apply_pending()  # nothing staged: nothing happens
        return slot

    slot = run(main())
    assert engine.loads == [2] and slot.pending is None and slot.swap_s_total > 0
    assert [sp.kind for sp in slot.recorder.drain()] == ["weights_recv", "weights_swap"]


def test_a_receive_for_another_group_or_armed_without_a_waiting_receiver_is_refused():
    async def main() -> None:
        slot = _slot(FakeEngine())
        with pytest.raises(RuntimeError, match="no weight receiver"):
            await slot.receive()
        slot.receiver = FakeReceiver(version=1)
        assert not slot.can_arm()
        with pytest.raises(RuntimeError, match="cannot wait for the send"):
            await slot.receive(armed=True)
        slot.group = "weights-2"  # re-formed after a death
        with pytest.raises(RuntimeError, match="for group 'weights': this generator 0 is in 'weights-2'"):
            await slot.receive(group="weights")

    run(main())


def test_until_holding_waits_for_a_swap_under_way_and_raises_the_error_of_one_that_failed():
    class FailingEngine(FakeEngine):
        def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
            raise RuntimeError("engine refused the weights")

    async def main() -> None:
        slot = _slot(FakeEngine(), "between_requests")
        slot.receiver = FakeReceiver(version=5)
        await slot.receive()
        waiting = asyncio.ensure_future(slot.until_holding(5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await slot.apply_pending()
        await asyncio.wait_for(waiting, 1)

        failing = _slot(FailingEngine(), "between_requests")
        failing.receiver = FakeReceiver(version=1)
        await failing.receive()
        with pytest.raises(RuntimeError, match="refused"):
            await failing.apply_pending()
        with pytest.raises(RuntimeError, match="the swap to version 1 failed"):
            await failing.until_holding(1)

        stopped = _slot(FakeEngine())
        stopped.stopped.set()
        await asyncio.wait_for(stopped.until_holding(9), 1)  # stopped: no wait

    run(main())


# -- sleep gate ------------------------------------------------------------------------------------
def test_sleep_waits_for_the_last_user_and_a_user_arriving_meanwhile_waits_for_wake():
    async def main() -> None:
        engine = SleepyEngine()
        gate = SleepGate(engine, SpanRecorder("generator/0"), stopped=asyncio.Event())
        assert await gate.use()  # one user: a group being sampled
        sleeping = asyncio.ensure_future(gate.sleep())
        await asyncio.sleep(0.05)
        assert not sleeping.done() and not engine.asleep and not gate.awake  # closed, waiting for the user
        late = asyncio.ensure_future(gate.use())
        gate.let_go()
        await asyncio.wait_for(sleeping, 1)
        assert engine.asleep and not late.done()  # the late user waits while asleep
        await gate.sleep()  # a no-op while asleep
        await gate.wake()
        assert await asyncio.wait_for(late, 1) and gate.awake and not engine.asleep
        gate.let_go()
        kinds = [sp.kind for sp in gate.recorder.drain()]
        assert kinds == ["sleep", "asleep", "wake"]

    run(main())


def test_a_user_waiting_while_asleep_gives_up_when_stopped_and_an_engine_that_cannot_sleep_is_one_line():
    async def main() -> None:
        stopped = asyncio.Event()
        gate = SleepGate(SleepyEngine(), SpanRecorder("generator/0"), stopped=stopped)
        await gate.sleep()
        waiting = asyncio.ensure_future(gate.use())
        await asyncio.sleep(0.02)
        stopped.set()
        assert await asyncio.wait_for(waiting, 1) is False

        plain = SleepGate(object(), SpanRecorder("generator/1"), stopped=asyncio.Event(), name="generator 1")
        with pytest.raises(RuntimeError, match="generator 1: its object cannot sleep; .*rollout.engine = 'torch'"):
            await plain.sleep()
        assert plain.awake

    run(main())


def test_users_counted_at_once_hold_the_sleep_until_each_lets_go():
    async def main() -> None:
        gate = SleepGate(SleepyEngine(), SpanRecorder("generator/0"), stopped=asyncio.Event())
        gate.hold(2)  # two groups posted together (Generator._begin_together)
        sleeping = asyncio.ensure_future(gate.sleep())
        gate.let_go()
        await asyncio.sleep(0.02)
        assert not sleeping.done()
        gate.let_go()
        await asyncio.wait_for(sleeping, 1)
        gate.hold(0)  # nothing to count: sleep is not held
        await gate.wake()
        await asyncio.wait_for(gate.sleep(), 1)

    run(main())
