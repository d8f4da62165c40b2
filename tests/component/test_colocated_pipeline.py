"""The step pipeline with colocated placement (asyncrl/pipeline.py, `_colocated_step`) with fakes, asserting
the recorded order: the step's groups are in, every generator sleeps, the step is asked for (no prefetch,
nothing ahead), trained and synced, an evaluation runs while they sleep, they wake, the version is published."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.pipeline import StepPipeline
from tests.component.test_pipeline import FakeGate, FakeGenerator, FakeTrainer, run


class StepGate(FakeGate):
    """`wait_step(s)` returns once the test sets `ready[s]` (step s's groups all accepted)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(log)
        self.ready = {s: asyncio.Event() for s in range(8)}

    async def wait_step(self, step: int, timeout: float | None = None) -> bool:
        await self.ready[step].wait()
        self.log.append(f"ready {step}")
        return True


class SleepyGenerator(FakeGenerator):
    def __init__(self, *args, dies: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dies = dies

    async def sleep(self) -> None:
        if self.dies:
            raise RuntimeError("the actor died unexpectedly")
        await asyncio.sleep(0)
        self.log.append(f"g{self.index} sleep")

    async def wake(self) -> None:
        await asyncio.sleep(0)
        self.log.append(f"g{self.index} wake")


def make_colocated(log: list[str], total: int = 2, dies: bool = False, **kw):
    trainer, gate = FakeTrainer(log), StepGate(log)
    gens = [SleepyGenerator(i, log, trainer, dies=dies and i == 1) for i in range(2)]
    steps = StepPipeline(trainer=trainer, generators=gens, buffer=gate, total_steps=total, colocated=True, **kw)
    return trainer, gate, steps


def test_colocated_step_sleeps_every_generator_before_training_and_wakes_them_after_the_sync():
    log: list[str] = []
    trainer, gate, steps = make_colocated(log)

    async def evaluate() -> None:
        log.append("eval")

    async def go() -> list[dict[str, float]]:
        await steps.start()
        first = asyncio.ensure_future(steps.step(0, while_asleep=evaluate))
        await asyncio.sleep(0.02)
        assert log == []  # step 0's groups are not in: the generators generate, nothing is asked
        steps.ask_next(1)  # colocated: asks for nothing
        gate.ready[0].set()
        trainer.finish[0].set()
        metrics = [(await first)[0]]
        assert "asked 1" not in log  # nothing asked ahead
        gate.ready[1].set()
        trainer.finish[1].set()
        metrics.append((await steps.step(1))[0])
        steps.close()
        return metrics

    metrics = run(go())
    for s, v in ((0, 1), (1, 2)):
        asleep = max(log.index(f"g{i} sleep", log.index(f"ready {s}")) for i in range(2))
        awake = min(log.index(f"g{i} wake", asleep) for i in range(2))
        assert log.index(f"ready {s}") < asleep < log.index(f"asked {s}") < log.index(f"trained {s}")
        assert log.index(f"trained {s}") < log.index(f"sent {v}") < log.index(f"g1 holds {v}") < awake
        assert awake < log.index(f"publish {v}")
    assert "prefetch" not in " ".join(log)
    assert log.index("g0 holds 1") < log.index("eval") < log.index("g0 wake")  # evaluated while asleep
    for m in metrics:
        assert m["trainer/step"] in (0.0, 1.0)
        assert all(m[k] >= 0 for k in ("colocate/sleep_s", "colocate/asleep_s", "colocate/wake_s"))
    assert metrics[0]["trainer/gate_wait_s"] >= 0.015  # the wait for step 0's groups, before the sleep


def test_colocated_step_lets_a_generator_death_supervision_takes_care_of_pass():
    log: list[str] = []
    trainer, gate, steps = make_colocated(log, total=1, dies=True, tolerated=lambda e: "died" in str(e))
    gate.ready[0].set()
    trainer.finish[0].set()
    run(steps.step(0))
    assert "g0 sleep" in log and "g1 sleep" not in log and log[-1] == "publish 1"


def test_colocated_step_raises_a_generator_failure_nobody_takes_care_of():
    log: list[str] = []
    trainer, gate, steps = make_colocated(log, total=1, dies=True)
    gate.ready[0].set()
    trainer.finish[0].set()
    with pytest.raises(RuntimeError, match="died"):
        run(steps.step(0))
    assert not any(e.startswith(("asked", "publish")) for e in log)
