"""The edge between the Controller and a role (asyncrl/deploy/wire.py): a call asked with `report=True` gets the
role's window report on its reply — from the in-process facade as from a Ray actor — and the role itself is
called without it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncrl.deploy import wire
from asyncrl.deploy.local import AsyncFacade
from asyncrl.telemetry.metrics import REPORT_KEY


class Role:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.reports = 0

    async def send_weights(self, **kwargs) -> dict:
        self.calls.append(("send_weights", kwargs))
        return {"sync/seconds": 0.5}

    async def publish(self, version: int, **kwargs) -> None:
        self.calls.append(("publish", kwargs))

    async def admit(self, n: int, **kwargs) -> list[int]:
        self.calls.append(("admit", kwargs))
        return list(range(n))

    def stats(self) -> str:
        self.reports += 1
        return f"report {self.reports}"


def test_the_in_process_facade_attaches_the_roles_report_when_asked_and_the_role_never_sees_report():
    role = Role()
    facade = AsyncFacade(role)

    async def main():
        return (await facade.send_weights(report=True), await facade.send_weights(),
                await facade.publish(3, report=True), await facade.publish(4), await facade.admit(2))

    sent, plain, published, quiet, admitted = asyncio.run(main())
    assert sent == {"sync/seconds": 0.5, REPORT_KEY: "report 1"} and plain == {"sync/seconds": 0.5}
    assert published == "report 2" and quiet is None and admitted == [0, 1]
    assert all(kwargs == {} for _, kwargs in role.calls) and role.reports == 2


def test_a_buffer_hosting_scorers_answers_publish_with_every_report_by_role():
    buffer = Role()
    hosted = [SimpleNamespace(scorer_id=0, stats=lambda: "s0"), SimpleNamespace(scorer_id=1, stats=lambda: "s1")]
    reply = asyncio.run(wire.with_report(buffer, "publish", None, hosted))
    assert reply == {"buffer": "report 1", "scorer/0": "s0", "scorer/1": "s1"}
    kwargs = {"report": True, "armed": True}
    assert wire.wants_report("receive_weights", kwargs) and kwargs == {"armed": True}
    kwargs = {"report": True}
    assert not wire.wants_report("admit", kwargs) and kwargs == {"report": True}  # not a reporting call: untouched
