"""Generator sleep/wake (colocated placement) with fakes: sleep lets the groups being sampled finish and admits
nothing more, groups an admit hands out while asleep hold their slot and are sampled after wake, the engine
is never asked to generate while asleep, and stopping while asleep gives the held slots back. No admitted group
is lost: each is queued for scoring or released, and released only when the run stops."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.messages import SamplingParams
from tests.component.test_roles import FakeBuffer, FakeEngine, make_generator, run


class SleepyEngine(FakeEngine):
    """A fake SleepableEngine that refuses to generate while asleep and to sleep with a call in flight (as
    TorchEngine does); each generate call waits until `go` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.asleep = False
        self.running = 0
        self.go = asyncio.Event()
        self.generated_asleep = 0

    async def generate(self, prompts, params: SamplingParams):
        if self.asleep:
            self.generated_asleep += 1
            raise RuntimeError("generate while asleep")
        self.running += 1
        try:
            await self.go.wait()
            return await super().generate(prompts, params)
        finally:
            self.running -= 1

    async def sleep(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.running} calls in flight")
        self.asleep = True

    async def wake(self) -> None:
        self.asleep = False


class HeldAdmitBuffer(FakeBuffer):
    """Its first admit waits until `open` is set (an admit still waiting at the gate when the sleep begins)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()
        self.waiting = False

    async def admit(self, max_groups, version, timeout=None, holder=None):
        if not self.admits:
            self.waiting = True
            await self.open.wait()
        return await super().admit(max_groups, version, timeout, holder)


async def until(done, timeout: float = 2.0) -> None:
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.002)


def sampled(buffer: FakeBuffer) -> set[int]:
    return {t.group_id for t in buffer.rollouts}


def test_sleep_lets_the_groups_being_sampled_finish_admits_nothing_and_loses_nothing():
    buffer, engine = FakeBuffer(), SleepyEngine()
    gen = make_generator(buffer, engine, concurrency=2)

    async def main() -> None:
        loop = asyncio.create_task(gen.run())
        await until(lambda: engine.running == 2)  # groups 0 and 1 are being sampled
        sleeping = asyncio.ensure_future(gen.sleep())
        await asyncio.sleep(0.05)
        assert not sleeping.done() and not engine.asleep  # it waits for them
        engine.go.set()
        await asyncio.wait_for(sleeping, 1.0)
        assert engine.asleep and gen.asleep and sampled(buffer) == {0, 1}
        admits = len(buffer.admits)
        await asyncio.sleep(0.1)
        assert len(buffer.admits) == admits  # asleep: nothing admitted
        await gen.wake()
        await until(lambda: len(sampled(buffer)) >= 6)
        gen.stop()
        await asyncio.wait_for(loop, 1.0)

    run(main())
    assert engine.generated_asleep == 0 and buffer.released == {"filtered": [], "failed": []}
    assert sampled(buffer) == set(range(buffer._next_id))  # every admitted group was sampled and queued
    spans = gen.recorder.drain()
    (asleep,) = [sp for sp in spans if sp.kind == "asleep"]
    assert {"sleep", "wake"} <= {sp.kind for sp in spans}
    generating = [sp for sp in spans if sp.kind == "generate"]
    assert generating and all(sp.end <= asleep.start or sp.start >= asleep.end for sp in generating)


def test_groups_an_admit_hands_out_while_asleep_are_sampled_after_wake():
    buffer, engine = HeldAdmitBuffer(), SleepyEngine()
    engine.go.set()
    gen = make_generator(buffer, engine, concurrency=2)

    async def main() -> None:
        loop = asyncio.create_task(gen.run())
        await until(lambda: buffer.waiting)
        await asyncio.wait_for(gen.sleep(), 1.0)  # nothing is being sampled: asleep at once
        buffer.open.set()  # the waiting admit returns groups 0 and 1 now
        await until(lambda: buffer._next_id == 2)
        await asyncio.sleep(0.05)
        assert engine.calls == 0 and not buffer.rollouts  # held, not sampled, not released
        await gen.wake()
        await until(lambda: {0, 1} <= sampled(buffer))
        gen.stop()
        await asyncio.wait_for(loop, 1.0)

    run(main())
    assert engine.generated_asleep == 0 and buffer.released["failed"] == []
    assert all(t.versions == [0] for t in buffer.rollouts)


def test_stopping_while_asleep_gives_the_held_groups_slots_back_promptly():
    buffer, engine = HeldAdmitBuffer(), SleepyEngine()
    gen = make_generator(buffer, engine, concurrency=2)

    async def main() -> float:
        loop = asyncio.create_task(gen.run())
        await until(lambda: buffer.waiting)
        await gen.sleep()
        buffer.open.set()
        await until(lambda: buffer._next_id == 2)
        t0 = time.monotonic()
        gen.stop()
        await asyncio.wait_for(loop, 1.0)
        return time.monotonic() - t0

    assert run(main()) < 0.5
    assert sorted(buffer.released["failed"]) == [0, 1] and buffer.details == ["generator stopped before sampling"] * 2
    assert engine.calls == 0


def test_a_generate_call_made_while_asleep_waits_for_wake():
    engine = SleepyEngine()
    engine.go.set()
    gen = make_generator(FakeBuffer(), engine)

    async def main() -> None:
        await gen.sleep()
        call = asyncio.ensure_future(gen.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=1)))
        await asyncio.sleep(0.05)
        assert not call.done()
        await gen.wake()
        (group,) = await asyncio.wait_for(call, 1.0)
        assert group[0].response_ids == [7]

    run(main())
    assert engine.generated_asleep == 0


def test_sleep_with_an_engine_that_cannot_sleep_names_the_fix():
    gen = make_generator(FakeBuffer(), FakeEngine())
    with pytest.raises(RuntimeError, match="cannot sleep; cluster.placement = 'colocated' needs rollout.engine"):
        run(gen.sleep())
    assert not gen.asleep
