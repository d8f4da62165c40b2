"""Stopping the role loops at the end of a run (asyncrl/control/supervisor.py `Supervisor.stop`): the loops of roles
whose stop() went unanswered (a stalled process: its interpreter lock held, its event loop blocked) are cancelled at
once instead of being waited for, while the others are still waited for until they end."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl.control.supervisor import Supervisor


class Role:
    def __init__(self, hangs: bool) -> None:
        self.hangs, self.stopped, self.ended = hangs, asyncio.Event(), False

    async def run(self) -> None:
        await self.stopped.wait()
        if self.hangs:  # a loop that never sees its stop: it ends only when cancelled
            await asyncio.Event().wait()
        self.ended = True


class Deployment:
    def __init__(self) -> None:
        self.generators, self.scorers = [Role(hangs=False)], [Role(hangs=True)]


async def _stop(unresponsive: frozenset[str], timeout_s: float) -> tuple[float, Deployment]:
    d = Deployment()
    supervisor = Supervisor(d, max_restarts=0, run_dir=Path("."), save_every=0)
    supervisor.start_loops()
    await asyncio.sleep(0)
    for role in (*d.generators, *d.scorers):
        role.stopped.set()
    t0 = time.monotonic()
    await supervisor.stop(timeout_s=timeout_s, unresponsive=unresponsive)
    return time.monotonic() - t0, d


def test_an_unresponsive_roles_loop_is_cancelled_without_the_wait_the_others_get():
    elapsed, d = asyncio.run(_stop(frozenset({"scorer/0"}), timeout_s=5.0))
    assert elapsed < 1.0 and d.generators[0].ended  # the healthy loop was waited for, and ended
    elapsed, d = asyncio.run(_stop(frozenset(), timeout_s=0.5))
    assert elapsed >= 0.5 and d.generators[0].ended  # not named: the hung loop is waited for, up to the bound


# -- the Controller's stop, after the watch found a process stalled (RunStalled.process) ---------------------
class StoppableRole(Role):
    async def stop(self) -> None:
        if self.hangs:  # its process is stalled: the call never answers
            await asyncio.Event().wait()
        self.stopped.set()


class Buffer:
    async def close(self) -> None:
        pass


class StalledDeployment:
    def __init__(self) -> None:
        self.generators, self.scorers, self.buffer = [StoppableRole(hangs=False)], [StoppableRole(hangs=True)], Buffer()

    def process_of(self, role: str) -> str:
        return role.replace("/", " ")


def test_the_controller_does_not_wait_for_the_stop_of_roles_in_the_process_found_stalled():
    from asyncrl.control.controller import Controller

    async def main() -> tuple[float, StalledDeployment]:
        d = StalledDeployment()
        controller = Controller.__new__(Controller)  # only what _stop_loops reads
        controller.d, controller._stalled = d, "scorer 0"
        controller.supervisor = Supervisor(d, max_restarts=0, run_dir=Path("."), save_every=0)
        controller.supervisor.start_loops()
        await asyncio.sleep(0)
        t0 = time.monotonic()
        await controller._stop_loops()  # asking scorer/0 to stop would wait 10 s for an answer that never comes
        return time.monotonic() - t0, d

    elapsed, d = asyncio.run(main())
    assert elapsed < 1.0
    assert d.generators[0].ended  # the healthy role was asked, answered and its loop ended
    assert not d.scorers[0].stopped.is_set()  # the stalled one was not asked; its loop was cancelled


def test_a_ray_deployment_names_each_roles_process_as_its_watch_probes_do(make_config):
    from asyncrl.deploy.launch import RayDeployment

    for placement, scorer in (("buffer", "buffer (and the scorers it hosts)"), ("actor", "scorer 1")):
        d = RayDeployment.__new__(RayDeployment)  # no actors: probes() only names them
        d.cfg = make_config("rollout.num_generators=2", "reward.num_scorers=2",
                            f'cluster.scorer_placement="{placement}"')
        d.rank_actors, d.generator_actors = [], [object(), object()]
        d.scorer_actors = [object(), object()] if placement == "actor" else []
        assert d.process_of("generator/1") == "generator 1" and d.process_of("scorer/1") == scorer
        assert {d.process_of(r) for r in ("generator/0", "generator/1", "scorer/0", "scorer/1")} <= set(d.probes())
