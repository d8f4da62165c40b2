"""Supervision of generators and scorers: a dead actor is restarted, its groups released, the weight group
re-formed; a dead trainer or buffer ends the run with one line that says how to resume (`run_with_ray`
then resumes it from its newest checkpoint, up to `run.max_resumes` times).

Place in the dataflow: inside the Controller's process, beside the step pipeline. It owns the role loops
(each generator's and scorer's `run()`), sees one end, and decides:

```
 a loop ended                         the role is                     then
 ──────────────────────────────────── ─────────────────────────────── ──────────────────────────────────────────
 its own actor died (kill -9, OOM)    scorer, restarts left            release its groups, new actor, its loop
                                      generator, restarts left         every member leaves the weight group,
                                                                        release its groups, new actor; the step
                                                                        pipeline's failed sync calls `recover`
 its own actor died                   trainer, buffer, a vLLM/SGLang   RoleFailed with the resume command and
                                      generator, or restarts off       the newest checkpoint: `run_with_ray`
                                                                       resumes from it (run.max_resumes)
 dies while it restarts (the new      generator or scorer, restarts     one more death: restarted again
 incarnation, or a group member)      left
 anything else, or no restarts left   —                                RoleFailed (the run stops)
```

Re-forming (at the end of a generator's restart, under the step pipeline's `sync_lock`, so never in the
middle of a step's weight sync): every member joins a group with a fresh name (`weights-<n>`: its own
announcement queues, its broadcast count from 0), the trainer sends its current weights to every generator (the
restarted one receives before it admits anything: its loop starts only then). It does not wait for a sync
to fail: with max_staleness = 0 and one generator, the train step waits for groups that only the restarted
generator can make. `recover` is the step pipeline's hook when a step's sync fails: it waits for the
re-forming (or raises when no generator died), and the step syncs again on the new group.

Groups: the buffer knows which role holds each running group (`ReplayBuffer.release_holder`); a dead role's
groups are released as failed, so the gate admits fresh prompts in their place and `take_step` never waits
for them. Accepted groups are never released: none is lost. In-process runs (`--local`) are not supervised
(a role cannot die without the process); the deployment's `restartable` is empty there.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Awaitable

from asyncrl.aio import discard
from asyncrl.checkpoints.store import CHECKPOINTS, latest_valid

log = logging.getLogger(__name__)

RECOVER_WAIT_S = 15.0  # a failed weight sync waits this long for a generator's death to show


class RoleFailed(RuntimeError):
    """The run cannot go on. `checkpoint`: set when the trainer or the buffer died and RUN_DIR holds a valid
    checkpoint, which a resume can continue from (`run_with_ray` does, up to `run.max_resumes` times)."""

    def __init__(self, message: str, *, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def is_actor_death(exc: BaseException) -> bool:
    # Ray's ActorDiedError / RayActorError, recognised by name: the Controller never imports Ray.
    return any(c.__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
               for c in type(exc).__mro__)


def first_line(exc: BaseException | None) -> str:
    if exc is None:
        return "cancelled"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def why_no_checkpoint(save_every: int, save_every_s: float) -> str:
    """Why a run has no checkpoint yet, from its two intervals, and what to set (for a one-line error)."""
    if save_every <= 0 and save_every_s <= 0:
        return "run.save_every = 0 and run.save_every_s = 0: checkpoints are off; set either to write them"
    due = []
    if save_every > 0:
        due.append(f"at step {save_every}")
    if save_every_s > 0:
        due.append(f"{save_every_s:g} s into the run")
    return (f"run.save_every = {save_every}, run.save_every_s = {save_every_s:g}: the first is written "
            f"{' or '.join(due)}, or after the last step; lower them to write one sooner")


def death_message(role: str | None, exc: BaseException, run_dir: Path, save_every: int,
                  save_every_s: float = 0.0) -> str:
    """One line: which role died and how to go on (the resume command, or that no checkpoint exists and why)."""
    found = latest_valid(run_dir / CHECKPOINTS)
    if found is not None:
        then = f"resume from {found.name} with: asyncrl launch --resume {run_dir}"
    else:
        then = (f"no checkpoint exists in {run_dir / CHECKPOINTS} to resume from "
                f"({why_no_checkpoint(save_every, save_every_s)})")
    who = f"the {role} actor" if role else "an actor"
    return f"{who} died ({first_line(exc)}); {then}"


class Supervisor:
    """The role loops and their restarts (see the module docstring). `restarts` counts them for the metrics
    (`supervisor/restarts`)."""

    def __init__(self, deployment: Any, *, max_restarts: int, run_dir: Path, save_every: int,
                 save_every_s: float = 0.0) -> None:
        self.d = deployment
        self.max_restarts = max_restarts
        self.run_dir = run_dir
        self.save_every = save_every  # run.save_every and run.save_every_s: the death message says why no checkpoint
        self.save_every_s = save_every_s
        self.restarts = 0
        self._loops: dict[asyncio.Future, str] = {}  # a role's run() -> its name ("generator/0")
        self._restarting: dict[asyncio.Future, str] = {}  # a restart in progress -> the role it restarts
        self._generators_back: list[int] = []  # restarted generators waiting for the re-formed group
        self._generators_down: set[int] = set()  # generators dead, not restarted yet: the last one back re-forms
        self._groups = 0  # weight groups re-formed so far
        self.steps: Any = None  # the StepPipeline (its sync_lock and group name), set by `attach`

    def attach(self, steps: Any) -> None:
        self.steps = steps

    # -- loops ---------------------------------------------------------------------------------------
    def roles(self) -> list[tuple[str, Any]]:
        """The roles with loops, by the names the supervisor knows them by: ("generator/0", endpoint), ..."""
        return [*((f"generator/{i}", g) for i, g in enumerate(self.d.generators)),
                *((f"scorer/{i}", s) for i, s in enumerate(self.d.scorers))]

    def start_loops(self) -> None:
        for role, endpoint in self.roles():
            self._start(role, endpoint)

    def _start(self, role: str, endpoint: Any) -> None:
        self._loops[asyncio.ensure_future(endpoint.run())] = role

    @property
    def watched(self) -> list[asyncio.Future]:
        """What the Controller's guard waits on beside each call: the loops and the restarts in progress."""
        return [*self._loops, *self._restarting]

    @property
    def loops(self) -> list[asyncio.Future]:
        return list(self._loops)

    def ended(self, fut: asyncio.Future) -> None:
        """A watched future ended while the Controller waited: restart its role, or raise RoleFailed."""
        if fut not in self._restarting and fut not in self._loops:
            return  # reported already
        if fut in self._restarting:
            role = self._restarting.pop(fut)
            exc = None if fut.cancelled() else fut.exception()
            if exc is None and not fut.cancelled():
                return
            if exc is not None:
                self.fatal(exc)  # the trainer or the buffer died while the group was re-formed
            # A generator or scorer that died during a restart (the new incarnation, or a member of the group
            # being re-formed) is one more death: restarted again while restarts are left.
            dead = self.d.dead_role(exc) if exc is not None and is_actor_death(exc) else None
            if dead is None or dead.split("/")[0] not in self.d.restartable:
                raise RoleFailed(f"restarting {role} failed: {first_line(exc)}") from exc
            if role.startswith("generator/"):  # its restart ended: down again only if it is `dead`
                self._generators_down.discard(int(role.split("/")[1]))
            self._died(dead, exc)
            return
        role = self._loops.pop(fut)
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:  # a loop whose buffer died reports the buffer's death (Ray wraps it in its error)
            self.fatal(exc)
        kind = role.split("/")[0]
        own_death = exc is not None and is_actor_death(exc) and self.d.dead_role(exc) == role
        if own_death and kind not in self.d.restartable:  # (a vLLM/SGLang generator, or restarts off)
            raise self.death(role, exc) from exc
        if not own_death:
            raise RoleFailed(f"{role} stopped unexpectedly: {first_line(exc)}") from exc
        assert exc is not None
        if kind == "generator" and int(role.split("/")[1]) in self._generators_back:
            return  # the loop of an incarnation restarted meanwhile (a failed re-forming reported its death)
        self._died(role, exc)

    def _died(self, role: str, exc: BaseException) -> None:
        """`role`'s actor died: restart it, unless a restart of it is already on its way (its loop and a failed
        re-forming both report one death), or raise RoleFailed when no restarts are left."""
        kind, index = role.split("/")[0], int(role.split("/")[1])
        if role in self._restarting.values() or (kind == "generator" and index in self._generators_down):
            return
        if self.restarts >= self.max_restarts:
            raise RoleFailed(f"{role} died and cluster.max_restarts = {self.max_restarts} restarts were used: "
                             f"{first_line(exc)}") from exc
        self.restarts += 1
        if kind == "generator":
            self._generators_down.add(index)
            if index in self._generators_back:  # restarted, then died before the group was re-formed
                self._generators_back.remove(index)
        log.warning("%s died (%s): restarting it (restart %d of at most %d)", role, first_line(exc),
                    self.restarts, self.max_restarts)
        self._restarting[asyncio.ensure_future(self._restart(kind, index))] = role

    async def _restart(self, kind: str, index: int) -> None:
        role = f"{kind}/{index}"
        if kind == "generator":  # every live member leaves the group: its sync in flight fails at once
            await self.d.leave_weight_groups()
        await self.d.buffer.release_holder(self.d.holder_of(role))  # before restart: the dead incarnation's name
        await self.d.restart(kind, index)
        log.info("%s restarted", role)
        if kind == "scorer":
            self._start(role, self.d.scorers[index])
            return
        self._generators_back.append(index)  # its loop starts once it holds the current weights
        self._generators_down.discard(index)
        if not self._generators_down:  # the last one back: every member can join
            try:
                await self._regroup()
            except Exception as exc:  # noqa: BLE001 - a death is restarted again (`ended`); else one more try
                if is_actor_death(exc):
                    raise
                log.warning("re-forming the weight-sync group failed with every generator alive (%s): forming a "
                            "fresh one", first_line(exc))
                await self.d.leave_weight_groups()
                await self._regroup()

    async def _regroup(self) -> None:
        """Re-form the weight group under a fresh name, send the current weights to every generator, start
        the restarted generators' loops. Under the step pipeline's sync lock: no step syncs meanwhile."""
        async with self.steps.sync_lock:
            self._groups += 1
            name = f"weights-{self._groups}"
            log.info("re-forming the weight-sync group as %r", name)
            await self.d.setup_weight_sync(group_name=name)
            self.steps.group = name
            await self._send_to_every_generator(name)
        back, self._generators_back = self._generators_back, []
        for index in back:
            self._start(f"generator/{index}", self.d.generators[index])

    async def _send_to_every_generator(self, group: str) -> None:
        """The trainer's current weights to every generator on the re-formed group. When one call fails (a
        generator killed meanwhile), every member leaves the group so the others fail at once instead of
        waiting out the group's timeout, and a generator's death is what is raised (it is restarted again,
        `ended`); a failure that names no death is checked against the generators' liveness first."""
        calls = [asyncio.ensure_future(self.d.trainer.send_weights()),
                 *[asyncio.ensure_future(g.receive_weights(group=group)) for g in self.d.generators]]
        done, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
        if not pending:
            for fut in calls:
                fut.result()
            return
        await self.d.leave_weight_groups()
        await asyncio.wait(pending, timeout=RECOVER_WAIT_S)
        errors = [f.exception() for f in calls if f.done() and not f.cancelled() and f.exception() is not None]
        for fut in calls:
            discard(fut)  # cancels a call still waiting; retrieves every outcome
        death = next((e for e in errors if is_actor_death(e)), None) or await self.d.generator_death()
        raise death if death is not None else errors[0]

    # -- the step pipeline's hook ----------------------------------------------------------------------
    async def recover(self, exc: BaseException) -> None:
        """A step's weight sync failed: return once the group is re-formed around a restarted generator (the
        step syncs again there); raise if the trainer died, or no generator did."""
        self.fatal(exc)
        if not self._generator_restarts():
            await self._wait_for_a_death()
        pending = self._generator_restarts()
        if not pending:
            raise exc
        await asyncio.wait(pending)
        for fut in pending:
            self.ended(fut)  # raises if a restart failed

    def _generator_restarts(self) -> list[asyncio.Future]:
        return [f for f, role in self._restarting.items() if role.startswith("generator/")]

    async def _wait_for_a_death(self) -> None:
        """The sync may fail (a closed socket) before the dead generator's loop reports its death."""
        gens = [f for f, role in self._loops.items() if role.startswith("generator/")]
        if not gens:
            return
        done, _ = await asyncio.wait(gens, timeout=RECOVER_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            self.ended(fut)

    def fatal(self, exc: BaseException) -> None:
        """Raise RoleFailed with the resume line if `exc` reports the trainer's or the buffer's death."""
        if is_actor_death(exc):
            role = self.d.dead_role(exc)
            if role is not None and role.split("/")[0] in ("trainer", "buffer"):  # "trainer/1": another trainer rank
                raise self.death(role, exc) from exc

    def death(self, role: str | None, exc: BaseException) -> RoleFailed:
        """The run's end when `role`'s actor died and is not restarted: one line with the resume command, and
        the checkpoint a resume would continue from (None when none exists)."""
        return RoleFailed(death_message(role, exc, self.run_dir, self.save_every, self.save_every_s),
                          checkpoint=latest_valid(self.run_dir / CHECKPOINTS))

    def tolerated(self, exc: BaseException) -> bool:
        """Whether `exc` is the death of a generator or scorer that supervision takes care of."""
        if not (is_actor_death(exc) and self.max_restarts > 0):
            return False
        role = self.d.dead_role(exc)
        return role is not None and role.split("/")[0] in self.d.restartable

    async def stop(self, timeout_s: float = 15.0, unresponsive: frozenset[str] = frozenset()) -> None:
        """Wait for the loops to end (after their roles' stop()), cancel what is left. The loops of the roles in
        `unresponsive` (their stop() went unanswered: a stalled or hung process) are cancelled without a wait."""
        for fut in self._restarting:
            discard(fut)
        self._restarting.clear()
        waited = [f for f, role in self._loops.items() if role not in unresponsive]
        for f in self._loops:
            if f not in waited:
                discard(f)
        if waited:
            done, pending = await asyncio.wait(waited, timeout=timeout_s)
            for f in pending:
                f.cancel()
            for f in done:  # retrieve: a loop that died has already been reported
                if not f.cancelled() and f.exception() is not None:
                    log.debug("role loop ended with %r", f.exception())


async def gather_alive(supervisor: Supervisor, calls: list[Awaitable[Any]]) -> list[Any]:
    """Results of `calls`, leaving out those of generators or scorers that died (supervision restarts them)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    out = []
    for r in results:
        if isinstance(r, BaseException):
            if isinstance(r, Exception) and supervisor.tolerated(r):
                continue
            raise r
        out.append(r)
    return out
