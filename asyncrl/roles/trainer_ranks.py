"""The trainer's ranks (`trainer.num_ranks` > 1): rank 0's Trainer hands each step to the other ranks.

Place in the dataflow: train store ──► Trainer (rank 0 takes the step's groups) ──► the Learner of every rank
(the same groups; each trains its 1/W, training/parallel.py) ──► rank 0 sends the weights to the generators.

```
 rank 0: RankedLearner (UpdatePipeline's worker thread)   rank r > 0: TrainerRank (its actor's worker thread)
 ──────────────────────────────────────────────────────── ─────────────────────────────────────────────────
 update(groups): ask every rank's update(groups) ────────► Learner.update(groups)
 Learner.update(groups)                 ◄── collectives ──►  (prepare's gathers, gradient reductions, stats)
 state_dict_for_sync(): keep the result ◄── FSDP2 gather ─► state_dict_for_sync(), result dropped
 wait for every rank's answer ◄──────────────────────────── returns
 the pipeline sends what was kept
 save_shards(folder) (fsdp2, a checkpoint): ask every rank ► sharded.save: each rank writes its shards
 full_copies() (fsdp2, the HF export): ask every rank ─────► sharded.full_copy: the gather, result dropped
```

Invariant: the weights change only in `update` and in a restore (`load_state`), and every such change is
followed on every rank by `state_dict_for_sync`, on the thread that changed them, before the call returns.
Rank 0 keeps the result and its `state_dict_for_sync()` returns it. So no collective of the trainer group
runs outside these calls and the two of a sharded model's checkpoint and export (`save_shards`,
`full_copies`), which rank 0 drives on every rank the same way: rank 0 alone never gathers (under FSDP2 it
would wait forever for the others), and a send never gathers beside the next update's collectives. Under
DDP the kept dict holds detached views of rank 0's full replica (no copy); under FSDP2 it holds the gathered
tensors (one model's memory on rank 0), which the evaluation also reads (Trainer.eval_model).

A rank that fails (its actor died, a collective timed out) fails the step on rank 0 with the rank's own error
(an actor's death names that actor), preferred over rank 0's collective error that follows from it.

Plain classes: the other ranks come in as objects with async methods (RayProxy in a deployment); no Ray here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from torch import Tensor

from asyncrl.checkpoints import store as checkpoint
from asyncrl.messages import Group
from asyncrl.telemetry.spans import SpanRecorder
from asyncrl.training import sharded
from asyncrl.training.learner import Learner

log = logging.getLogger(__name__)

FAILED_RANK_WAIT_S = 30.0  # after rank 0's own update failed: how long a failing rank may take to say why


class Rank(Protocol):
    """Another trainer rank, as rank 0 drives it (TrainerRank behind an actor proxy)."""

    async def update(self, groups: list[Group]) -> int: ...
    async def load_state(self, path: str) -> int: ...
    async def gather_weights(self) -> None: ...
    async def save_shards(self, folder: str) -> None: ...
    async def full_copies(self) -> None: ...
    # update and load_state return the rank's version afterwards (RankedLearner checks it is rank 0's)


class TrainerRank:
    """Rank r > 0: its Learner, trained on the groups rank 0 hands it; it never sends weights."""

    def __init__(self, learner: Learner, rank: int, recorder: SpanRecorder | None = None) -> None:
        self.learner = learner
        self.rank = rank
        self.recorder = recorder or SpanRecorder(f"trainer rank {rank}")

    @property
    def version(self) -> int:
        return self.learner.version

    async def update(self, groups: list[Group]) -> int:
        """One train step over `groups` (the whole step), then the weights' gather; -> the new version."""
        t0 = self.recorder.begin("train")
        await asyncio.to_thread(self._update, groups)
        self.recorder.record("train", t0, time.time(), self.learner.version - 1)
        return self.learner.version

    def _update(self, groups: list[Group]) -> None:
        self.learner.update(groups)
        self.learner.state_dict_for_sync()  # rank 0 gathers now (FSDP2): join it; the result is rank 0's

    async def load_state(self, path: str) -> int:
        """Continue from the checkpoint rank 0 continues from (its state is every rank's under DDP)."""
        ck = await asyncio.to_thread(checkpoint.load, path)
        await asyncio.to_thread(_restore, self.learner, ck)
        return self.learner.version

    async def gather_weights(self) -> None:
        await asyncio.to_thread(self.learner.state_dict_for_sync)

    async def save_shards(self, folder: str) -> None:
        """Write this rank's shards of a checkpoint into `folder` (fsdp2; rank 0 seals the checkpoint)."""
        await asyncio.to_thread(sharded.save, self.learner, folder)

    async def full_copies(self) -> None:
        """Join rank 0's gather of the full weights for the HF export (fsdp2); rank 0 writes them."""
        await asyncio.to_thread(full_copies, self.learner, self.rank)


def full_copies(learner: Learner, rank: int) -> list[Any]:
    """The gather of the HF export, in the same order on every rank: the policy, then the critic. -> on rank 0
    their unsharded copies (sharded.full_copy), elsewhere Nones."""
    models = [learner.model] + ([learner.critic.model] if learner.critic is not None else [])
    return [sharded.full_copy(m, rank) for m in models]


def _restore(learner: Learner, ck: checkpoint.Checkpoint) -> None:
    learner.restore_state(ck.tensors, ck.state, shards=ck.path / sharded.SHARDS)
    checkpoint.set_rng_state(ck.tensors["rng"], ck.state["rng"])
    learner.state_dict_for_sync()


class RankedLearner:
    """Rank 0's Learner together with the other ranks: what rank 0's UpdatePipeline updates and sends from.
    `loop`: the event loop the ranks' async methods run on (the actor's; `update` runs on a worker thread)."""

    def __init__(self, learner: Learner, ranks: list[Rank], loop: asyncio.AbstractEventLoop) -> None:
        self.learner = learner
        self.ranks = ranks
        self._loop = loop
        self._weights: dict[str, Tensor] | None = None  # rank 0's state_dict_for_sync after the last change

    @property
    def version(self) -> int:
        return self.learner.version

    def update(self, groups: list[Group]) -> dict[str, float]:
        """One train step on every rank (on a worker thread); -> rank 0's metrics (already the step's)."""
        metrics, versions = self._all(lambda r: r.update(groups), lambda: self.learner.update(groups))
        self._check(versions)
        return metrics

    def state_dict_for_sync(self) -> Mapping[str, Tensor]:
        if self._weights is None:
            raise RuntimeError("trainer ranks: no weights gathered yet (gather_weights runs when the group forms)")
        return self._weights

    async def gather_weights(self) -> None:
        """Gather the current weights on every rank (once the group formed, before the first send)."""
        await asyncio.to_thread(self._all, lambda r: r.gather_weights(), lambda: None)

    async def load_state(self, path: str, restore: Callable[[], None]) -> None:
        """`restore()` here (the checkpoint at `path`, already read) while every other rank loads `path`."""
        _, versions = await asyncio.to_thread(self._all, lambda r: r.load_state(path), restore)
        self._check(versions)

    def save_shards(self, folder: str) -> dict[str, Any]:
        """On a worker thread (checkpoint.save's `write`): every rank writes its shards into `folder` (fsdp2).
        -> the state to record beside them. Returns once every rank's files are written."""
        state, _ = self._all(lambda r: r.save_shards(folder), lambda: sharded.save(self.learner, folder),
                             gather=False)
        return state

    def full_copies(self) -> list[Any]:
        """On a worker thread: every rank joins the gather of the full weights (fsdp2). -> rank 0's unsharded
        copies of the policy [and the critic] for the HF export."""
        copies, _ = self._all(lambda r: r.full_copies(), lambda: full_copies(self.learner, 0), gather=False)
        return copies

    def _check(self, versions: list[int]) -> None:
        """Every rank holds rank 0's version after an update or a restore (checked, not assumed: a rank that
        missed one would train from other weights, and DDP would not notice)."""
        if any(v != self.learner.version for v in versions):
            raise RuntimeError(f"trainer ranks disagree: rank 0 holds version {self.learner.version}, ranks 1.. hold "
                               f"{versions}")

    def _all(self, ask: Callable[[Rank], Awaitable[Any]], own: Callable[[], Any],
             gather: bool = True) -> tuple[Any, list[Any]]:
        """On a worker thread: `own()` here while each other rank runs `ask(rank)` on the loop; then (`gather`:
        the weights changed) gather this rank's weights. -> (own's result, the other ranks' answers). A failed
        rank's error wins over this rank's (whose collective failed because of it)."""
        asked = [asyncio.run_coroutine_threadsafe(_on_loop(ask, r), self._loop) for r in self.ranks]
        try:
            out = own()
            if gather:
                self._weights = dict(self.learner.state_dict_for_sync())
        except BaseException as exc:
            done, _ = concurrent.futures.wait(asked, timeout=FAILED_RANK_WAIT_S)
            failed = [f.exception() for f in asked if f in done and f.exception() is not None]
            if failed:
                raise failed[0] from exc  # type: ignore[misc]
            raise
        return out, [f.result() for f in asked]  # raises a rank's failure


async def _on_loop(ask: Callable[[Rank], Awaitable[Any]], rank: Rank) -> Any:
    """`ask(rank)` made and awaited on the loop (a rank's proxy submits its call when it is made, and returns
    an awaitable that is not a coroutine)."""
    return await ask(rank)
