"""AdmissionGate: capacity maths, slot return on release, admission-order training, staleness bound."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from buffers.gate import AdmissionGate

SHORT = 0.02  # seconds


def run(coro, timeout: float = 2.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def yield_randomly(rng: random.Random, most: int = 4) -> None:
    """A random amount of 'work' that costs no wall time: a few trips through the event loop."""
    for _ in range(rng.randint(0, most)):
        await asyncio.sleep(0)


async def finish_step(gate: AdmissionGate, step: int) -> list[int]:
    """Accept every running group, take step `step`, publish version step + 1."""
    for gid in list(gate._live):
        if gate.is_running(gid):
            gate.accept(gid)
    ids = await gate.take_step(step, timeout=SHORT)
    gate.publish(step + 1)
    return ids


@pytest.mark.parametrize(
    ("k", "admitted_by_version"),
    [
        (0, [3, 6, 9, 12]),    # P = 3: exactly one step's groups per version
        (1, [6, 9, 12, 15]),   # one step ahead
        (4, [15, 18, 21, 24]),
    ],
)
def test_admits_exactly_up_to_v_plus_k_plus_1_steps_of_groups_at_each_version(k, admitted_by_version):
    async def main():
        gate = AdmissionGate(prompts_per_step=3, max_staleness=k)
        totals = []
        for version in range(len(admitted_by_version)):
            await gate.admit(100, version)
            assert await gate.admit(1, version, timeout=0) == []  # full at this version
            totals.append(int(gate.stats()["admitted"]))
            assert len(await finish_step(gate, version)) == 3
            # consumed groups still count as accepted: taking a step alone frees no slot
            assert await gate.admit(1, version, timeout=0) == []
        return totals

    assert run(main()) == admitted_by_version


def test_admission_ids_are_fresh_and_in_admission_order():
    async def main():
        gate = AdmissionGate(prompts_per_step=2, max_staleness=1)
        return await gate.admit(3, 0), await gate.admit(3, 0)

    assert run(main()) == ([0, 1, 2], [3])


def test_k0_admits_no_group_of_step_s_before_version_s_is_published():
    stats = run(simulate(k=0, prompts_per_step=3, steps=6, generators=3, seed=7))
    for gid, step in stats["consumed"].items():
        engine_version, published_at_admission = stats["admitted_at"][gid]
        assert engine_version == step
        assert published_at_admission >= step


def test_filtered_group_returns_its_slot_so_a_replacement_can_be_admitted():
    async def main():
        gate = AdmissionGate(prompts_per_step=2, max_staleness=0)
        first = await gate.admit(5, 0)
        full = await gate.admit(1, 0, timeout=0)
        gate.release(first[0], "filtered")
        replacement = await gate.admit(5, 0, timeout=0)
        return first, full, replacement, gate.stats()

    first, full, replacement, stats = run(main())
    assert first == [0, 1] and full == [] and replacement == [2]
    assert stats["filtered"] == 1 and stats["running"] == 2 and stats["admitted"] == 3


def test_release_and_accept_reject_unknown_duplicate_and_bad_reason():
    async def main():
        gate = AdmissionGate(prompts_per_step=1, max_staleness=0)
        [gid] = await gate.admit(1, 0)
        with pytest.raises(ValueError, match="reason"):
            gate.release(gid, "boring")
        gate.release(gid, "failed")
        with pytest.raises(ValueError, match="not running"):
            gate.release(gid, "failed")
        with pytest.raises(ValueError, match="not running"):
            gate.accept(gid)
        with pytest.raises(ValueError, match="not running"):
            gate.accept(99)
        return gate.stats()

    stats = run(main())
    assert stats["failed"] == 1 and stats["running"] == 0


def test_no_deadlock_when_every_group_of_a_step_is_filtered_once():
    steps, p = 4, 3

    async def main():
        gate = AdmissionGate(prompts_per_step=p, max_staleness=0)
        retry: list[int] = []           # prompts whose first attempt was filtered
        attempts: dict[int, int] = {}   # prompt -> attempts so far
        prompt_of: dict[int, int] = {}  # group id -> prompt
        next_prompt = 0
        scoring: list[asyncio.Task] = []

        async def score(gid: int) -> None:
            await asyncio.sleep(0)
            prompt = prompt_of[gid]
            attempts[prompt] = attempts.get(prompt, 0) + 1
            if attempts[prompt] == 1:
                gate.release(gid, "filtered")
                retry.append(prompt)
            else:
                gate.accept(gid)

        async def generator() -> None:
            nonlocal next_prompt
            while not gate.closed:
                for gid in await gate.admit(p, gate.published_version):
                    if retry:
                        prompt_of[gid] = retry.pop(0)
                    else:
                        prompt_of[gid], next_prompt = next_prompt, next_prompt + 1
                    scoring.append(asyncio.create_task(score(gid)))

        async def trainer() -> list[list[int]]:
            taken = []
            for step in range(steps):
                taken.append(await gate.take_step(step))
                gate.publish(step + 1)
            gate.close()
            return taken

        gen = asyncio.create_task(generator())
        taken = await trainer()
        await gen
        await asyncio.gather(*scoring)
        return taken, attempts, prompt_of, gate.stats()

    taken, attempts, prompt_of, stats = run(main())
    assert [len(ids) for ids in taken] == [p] * steps
    assert all(attempts[prompt_of[gid]] == 2 for ids in taken for gid in ids)
    assert stats["consumed"] == steps * p
    assert stats["filtered"] >= steps * p


async def _full_at_version_0(*, before_take: Any = None) -> AdmissionGate:
    """k = 0, P = 2: step 0's two groups admitted, accepted and taken; version 0 has no room left."""
    gate = AdmissionGate(prompts_per_step=2, max_staleness=0)
    await gate.admit(2, 0)
    for gid in (0, 1):
        gate.accept(gid)
    if before_take is not None:
        before_take(gate)
    await gate.take_step(0)
    return gate


async def _waiting_admit(gate: AdmissionGate, wake: Any) -> tuple[bool, list[int]]:
    """An admit at version 0 (full): did it wait, and what did it return once `wake(gate)` ran?"""
    waiter = asyncio.create_task(gate.admit(1, 0))
    await asyncio.sleep(SHORT)
    waited = not waiter.done()
    wake(gate)
    return waited, await asyncio.wait_for(waiter, SHORT * 5)


def test_admit_returns_empty_when_a_newer_version_is_published_while_waiting():
    async def main():
        gate = await _full_at_version_0()
        waited, result = await _waiting_admit(gate, lambda g: g.publish(1))
        return waited, result, gate.stats()["admitted"], await gate.admit(1, 1, timeout=0)

    waited, result, admitted, fresh = run(main())
    assert waited and result == [] and admitted == 2
    assert fresh == [2]


def test_admit_returns_empty_when_a_generator_reports_holding_a_newer_version_before_publish():
    def too_early(gate: AdmissionGate) -> None:
        with pytest.raises(ValueError, match="steps taken"):
            gate.note_held(1)  # weights of version 1 cannot exist before step 0 was taken

    async def main():
        gate = await _full_at_version_0(before_take=too_early)
        # one generator's swap landed; the controller has not published yet
        waited, result = await _waiting_admit(gate, lambda g: g.note_held(1))
        return waited, result, gate.published_version, await gate.admit(1, 1, timeout=0)

    waited, result, published, fresh = run(main())
    assert waited and result == [] and published == 0
    assert fresh == [2]  # asked again at the held version: admitted under the same capacity rule


def test_a_generator_still_on_the_older_version_waits_after_another_noted_a_newer_one():
    async def main():
        gate = await _full_at_version_0()
        gate.note_held(1)  # generator A swapped; generator B has not
        # B asks at version 0 after the note: no [] at once (B would spin on it), it waits as before
        return await _waiting_admit(gate, lambda g: g.publish(1))

    waiting, result = run(main())
    assert waiting and result == []


def test_take_step_waits_for_an_earlier_running_group_even_if_later_ones_are_accepted():
    async def main():
        gate = AdmissionGate(prompts_per_step=2, max_staleness=1)
        ids = await gate.admit(4, 0)
        for gid in ids[1:]:
            gate.accept(gid)
        trainer = asyncio.create_task(gate.take_step(0))
        await asyncio.sleep(SHORT)
        waited = not trainer.done()
        gate.accept(ids[0])
        first = await asyncio.wait_for(trainer, SHORT * 5)
        second = await gate.take_step(1, timeout=0)
        return waited, first, second, gate.stats()["trainer_wait_s"]

    waited, first, second, wait_s = run(main())
    assert waited and first == [0, 1] and second == [2, 3]
    assert wait_s >= SHORT * 0.5


def test_wait_step_returns_once_the_step_could_be_taken_and_takes_nothing():
    async def main():
        gate = AdmissionGate(prompts_per_step=2, max_staleness=1)
        ids = await gate.admit(4, 0)
        gate.accept(ids[1])
        waiter = asyncio.create_task(gate.wait_step(0))
        await asyncio.sleep(SHORT)
        waited = not waiter.done()
        gate.accept(ids[0])
        ready = await asyncio.wait_for(waiter, SHORT * 5)
        gate.release(ids[2], "failed")  # a later group released: step 0 stays ready
        counts = gate.stats()
        taken = await gate.take_step(0, timeout=0)
        closed = AdmissionGate(prompts_per_step=1, max_staleness=0)
        closed.close()
        return waited, ready, counts, taken, await closed.wait_step(0), gate.trainer_wait_s

    waited, ready, counts, taken, closed, wait_s = run(main())
    assert waited and ready and taken == [0, 1] and not closed
    assert counts["consumed"] == 0 and counts["steps_taken"] == 0  # waiting took nothing
    assert wait_s >= SHORT * 0.5  # the trainer's wait, counted where take_step counts it


def test_take_step_skips_a_released_head_group_and_times_out_empty():
    async def main():
        gate = AdmissionGate(prompts_per_step=2, max_staleness=1)
        await gate.admit(3, 0)
        gate.accept(1)
        gate.accept(2)
        gate.release(0, "failed")
        taken = await gate.take_step(0, timeout=0)
        empty = await gate.take_step(1, timeout=SHORT)
        return taken, empty

    assert run(main()) == ([1, 2], [])


def test_publish_and_take_step_enforce_the_step_contract():
    async def main():
        gate = AdmissionGate(prompts_per_step=1, max_staleness=0)
        with pytest.raises(ValueError, match="steps taken"):
            gate.publish(1)  # no step taken yet: a group admitted at 1 could be trained at step 0
        with pytest.raises(ValueError, match="expected step 0"):
            await gate.take_step(3)
        with pytest.raises(ValueError, match="needs 2 steps taken"):
            await gate.admit(1, 2)
        await gate.admit(1, 0)
        assert await finish_step(gate, 0) == [0]  # publishes 1
        gate.publish(1)  # re-publishing is a no-op
        with pytest.raises(ValueError, match="older"):
            gate.publish(0)
        return gate.published_version

    assert run(main()) == 1


def test_close_wakes_admit_and_take_step_waiters():
    async def main():
        gate = AdmissionGate(prompts_per_step=1, max_staleness=0)
        await gate.admit(1, 0)
        waiters = [asyncio.create_task(gate.admit(1, 0)), asyncio.create_task(gate.take_step(0))]
        await asyncio.sleep(SHORT)
        gate.close()
        return await asyncio.wait_for(asyncio.gather(*waiters), SHORT * 5)

    assert run(main()) == [[], []]


async def simulate(*, k: int, prompts_per_step: int, steps: int, generators: int, seed: int,
                   filter_p: float = 0.2, fail_p: float = 0.1) -> dict:
    """Generators with lagging engines, random scoring times and outcomes, one trainer."""
    rng = random.Random(seed)
    gate = AdmissionGate(prompts_per_step=prompts_per_step, max_staleness=k)
    admitted_at: dict[int, tuple[int, int]] = {}  # gid -> (engine version, published version)
    released: dict[int, str] = {}
    accepted: set[int] = set()
    consumed: dict[int, int] = {}                 # gid -> step
    order: list[int] = []
    scoring: list[asyncio.Task] = []

    async def score(gid: int) -> None:
        await yield_randomly(rng, 8)
        r = rng.random()
        if r < filter_p + fail_p:
            reason = "filtered" if r < filter_p else "failed"
            gate.release(gid, reason)
            assert gid not in released
            released[gid] = reason
        else:
            gate.accept(gid)
            accepted.add(gid)

    async def generator() -> None:
        engine = 0
        while not gate.closed:
            if rng.random() < 0.5:  # the engine loads the newest weights only now and then
                engine = gate.published_version
            ids = await gate.admit(rng.randint(1, prompts_per_step + 1), engine)
            if not ids:
                engine = gate.published_version
            for gid in ids:
                admitted_at[gid] = (engine, gate.published_version)
                scoring.append(asyncio.create_task(score(gid)))
            await yield_randomly(rng)

    async def trainer() -> None:
        for step in range(steps):
            ids = await gate.take_step(step)
            for gid in ids:
                assert gid not in consumed
                consumed[gid] = step
            order.extend(ids)
            await yield_randomly(rng)
            gate.publish(step + 1)
        gate.close()

    gens = [asyncio.create_task(generator()) for _ in range(generators)]
    await trainer()
    await asyncio.gather(*gens)
    await asyncio.gather(*scoring)
    return {"admitted_at": admitted_at, "released": released, "accepted": accepted,
            "consumed": consumed, "order": order, "stats": gate.stats()}


@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_run_keeps_staleness_within_bound_and_accounts_every_group_once(k, seed):
    p, steps = 3, 8
    out = run(simulate(k=k, prompts_per_step=p, steps=steps, generators=3, seed=seed))
    admitted_at, consumed, released = out["admitted_at"], out["consumed"], out["released"]
    staleness = [step - admitted_at[gid][0] for gid, step in consumed.items()]
    assert len(consumed) == steps * p
    assert min(staleness) >= 0 and max(staleness) <= k
    assert out["order"] == sorted(out["order"])  # admission order
    leftover = out["accepted"] - consumed.keys()
    assert not (consumed.keys() & released.keys())
    assert not (leftover & released.keys())
    assert consumed.keys() | released.keys() | leftover == admitted_at.keys()
    stats = out["stats"]
    assert stats["admitted"] == len(admitted_at)
    assert stats["admitted"] == stats["consumed"] + stats["filtered"] + stats["failed"] + len(leftover)
    assert stats["running"] == 0


def test_admit_accepts_weights_loaded_before_their_publish_arrives():
    """Under Ray a generator can load version s+1 (broadcast done) before publish(s+1) reaches the
    gate; once step s was taken that admission is legitimate and must not raise."""

    async def main():
        gate = AdmissionGate(prompts_per_step=1, max_staleness=0)
        [g0] = await gate.admit(1, 0)
        gate.accept(g0)
        assert await gate.take_step(0) == [g0]
        ids = await gate.admit(1, 1, timeout=SHORT)  # publish(1) not called yet
        gate.publish(1)
        return ids, gate.admitted_version(ids[0])

    ids, version = run(main())
    assert len(ids) == 1 and version == 1


# -- checkpoint and restore ------------------------------------------------------------------------
def test_a_restored_gate_trains_the_accepted_groups_and_hands_out_the_running_ones_again_first():
    import msgspec

    from buffers.gate import GateState

    async def before() -> GateState:
        gate = AdmissionGate(prompts_per_step=2, max_staleness=1)
        assert await gate.admit(4, 0) == [0, 1, 2, 3]
        for gid in (0, 1, 3):
            gate.accept(gid)
        assert await gate.take_step(0) == [0, 1]
        gate.publish(1)
        assert await gate.admit(4, 1) == [4, 5]  # capacity (1 + 1 + 1) * 2 = 6
        gate.release(4, "failed")
        return gate.state()

    state = msgspec.json.decode(msgspec.json.encode(run(before())), type=GateState)  # as a checkpoint keeps it
    assert state.live == [(2, 0, False), (3, 0, True), (5, 1, False)] and state.next_id == 6

    async def after() -> tuple[list[int], list[int], list[int]]:
        gate = AdmissionGate(prompts_per_step=2, max_staleness=1)
        gate.restore(state)
        assert gate.published_version == 1 and gate.steps_taken == 1
        again = await gate.admit(1, 1) + await gate.admit(4, 1)  # the running ones first, in order
        assert gate.stats()["running"] == 2 and gate.stats()["failed"] == 1
        for gid in again:
            gate.accept(gid)
        step1 = await gate.take_step(1)
        gate.publish(2)
        fresh = await gate.admit(8, 2)  # then fresh ids, from where the run was
        return again, step1, fresh

    again, step1, fresh = run(after())
    assert again == [2, 5] and step1 == [2, 3] and fresh[0] == 6


def test_restore_refuses_a_gate_that_was_already_used():
    gate = AdmissionGate(prompts_per_step=1, max_staleness=0)
    state = gate.state()
    run(gate.admit(1, 0))
    with pytest.raises(RuntimeError, match="already been used"):
        gate.restore(state)


# -- group events (RUN_DIR/admissions.jsonl) ---------------------------------------------------------
def test_the_gate_records_every_id_it_hands_out_and_how_each_ended_once_each_until_taken():
    async def main():
        gate = AdmissionGate(prompts_per_step=2, max_staleness=0)
        assert await gate.admit(2, 0) == [0, 1]
        gate.accept(0)
        gate.release(1, "failed", "generation: RuntimeError: " + "x" * 1000)
        first = gate.take_events()
        assert await gate.admit(1, 0) == [2]
        gate.release(2, "filtered", "zero reward variance")
        return first, gate.take_events(), gate.take_events()

    first, second, third = run(main())
    assert (first.admitted, first.accepted) == ([0, 1], [0])
    [(gid, reason, why)] = first.released
    assert (gid, reason) == (1, "failed") and why.startswith("generation: RuntimeError") and len(why) == 300
    assert (second.admitted, second.accepted, second.released) == ([2], [], [(2, "filtered", "zero reward variance")])
    assert not third  # taken: nothing is reported twice


def test_a_restored_gate_records_its_regenerated_groups_as_admitted_again():
    async def main():
        gate = AdmissionGate(prompts_per_step=1, max_staleness=1)
        await gate.admit(2, 0)
        gate.accept(0)
        state = gate.state()
        restored = AdmissionGate(prompts_per_step=1, max_staleness=1)
        restored.restore(state)
        assert await restored.admit(2, 0) == [1]  # the running one, again
        return restored.take_events()

    assert run(main()).admitted == [1]
