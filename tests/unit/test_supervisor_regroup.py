"""The supervisor's send on a re-formed weight group (asyncrl/control/supervisor.py `_send_to_every_generator`): a
generator that dies meanwhile makes every member leave the group, so the trainer's send fails at once instead of
waiting out the group's timeout, and the generator's death is what is raised (it is then restarted again)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.control.supervisor import Supervisor


class ActorDiedError(RuntimeError):  # recognised by name, as Ray's (asyncrl.control.supervisor.is_actor_death)
    def __init__(self, actor_id: str) -> None:
        super().__init__("The actor died unexpectedly before finishing this task.")
        self.actor_id = actor_id


class Deployment:
    def __init__(self, *, trainer_fails: BaseException | None = None, receive_dies: bool = False,
                 dead_now: BaseException | None = None) -> None:
        self.left = asyncio.Event()
        deployment = self

        class Trainer:
            async def send_weights(self) -> dict:
                if trainer_fails is not None:
                    raise trainer_fails
                await deployment.left.wait()  # a send on the group waits for every member, until they leave
                raise RuntimeError("weight-sync group is closed")

        class Generator:
            async def receive_weights(self, *, group: str) -> dict:
                if receive_dies:
                    raise ActorDiedError("gen0")
                await deployment.left.wait()
                raise RuntimeError("weight-sync group is closed")

        self.trainer, self.generators, self.dead_now = Trainer(), [Generator()], dead_now

    async def leave_weight_groups(self) -> None:
        self.left.set()

    async def generator_death(self) -> BaseException | None:
        return self.dead_now


def _send(deployment: Deployment):
    supervisor = Supervisor(deployment, max_restarts=3, run_dir=Path("."), save_every=0)
    return asyncio.run(asyncio.wait_for(supervisor._send_to_every_generator("weights-1"), 5))


def test_a_generator_dying_during_the_send_makes_every_member_leave_and_its_death_is_raised():
    deployment = Deployment(receive_dies=True)
    with pytest.raises(ActorDiedError):
        _send(deployment)
    assert deployment.left.is_set()  # the trainer's send did not wait for the group's timeout


def test_a_failed_send_that_names_no_death_is_checked_against_the_generators_liveness():
    died = ActorDiedError("gen0")
    with pytest.raises(ActorDiedError) as info:
        _send(Deployment(trainer_fails=TimeoutError("weight sync: header not completed"), dead_now=died))
    assert info.value is died
    with pytest.raises(TimeoutError, match="header not completed"):  # every generator alive: the error itself
        _send(Deployment(trainer_fails=TimeoutError("weight sync: header not completed")))
