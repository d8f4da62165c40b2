"""When the Controller writes a durable checkpoint, and what a failed run says about going on from one.

`SaveSchedule` decides after which train step a checkpoint is written (docs/checkpoints.md):

```
 interval              known                            the pipeline before it              written after step v when
 ───────────────────── ──────────────────────────────── ─────────────────────────────────── ──────────────────────────
 run.save_every = N    in advance: v % N == 0            drains (drain_after(v)): step v-1   v % N == 0
                                                          does not prefetch step v's groups
 the last step         in advance: v == total_steps     (nothing to prefetch)               either interval is on
 run.save_every_s = T  once T s of wall time passed      drains from the first step asked    the first step after that
                       since the last checkpoint (or     for after the deadline              the pipeline is drained:
                       since the run began): latched                                         at most two steps late
```

A checkpoint is written only when nothing is half-trained or prefetched between the buffer and the trainer.
The step interval is known ahead, so the step before it never prefetches. The time interval is not: the
step asked for before the deadline may have prefetched, so the Controller trains it too and writes the
checkpoint after the next one — as it does for SIGTERM. Once seen, a passed deadline stays passed
(`timed()` latches) until the checkpoint is written (`saved()`), so every question the pipeline asks about
it gets the same answer.

`failure_line` is the last line a failed run prints when its run directory holds a valid checkpoint: what
failed (the Controller notes what it was doing on the exception: `note_failure`), the last good checkpoint
and the command that resumes from it — the same as the SIGTERM message gives.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from asyncrl.checkpoints.store import CHECKPOINTS, latest_valid, step_of
from asyncrl.telemetry.runlog import cause_chain

__all__ = ["SaveSchedule", "failed_while", "failure_line", "note_failure"]

_NOTE = "asyncrl: the run failed while "  # the note's prefix (PEP 678 notes also show in run.log's traceback)


class SaveSchedule:
    """run.save_every (steps) and run.save_every_s (seconds of wall time) of a run of `total_steps` steps.
    `clock` (seconds, monotonic) is injectable so the time interval is tested without waiting."""

    def __init__(self, *, every: int, every_s: float, total_steps: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.every_s = every_s
        self.total_steps = total_steps
        self.clock = clock
        self._since = clock()  # the last checkpoint, or the run's start
        self._timed = False  # the time interval's deadline passed (latched until saved())

    @property
    def on(self) -> bool:
        """Whether the run writes checkpoints by itself at all (either interval)."""
        return self.every > 0 or self.every_s > 0

    def start(self) -> None:
        """The run (or a resumed run) begins: the time interval counts from now."""
        self.saved()

    def due(self, version: int) -> bool:
        """A checkpoint after the step that publishes `version` that is known in advance: the step interval,
        or the last step while either interval is on. The pipeline drains before it."""
        if version == self.total_steps:
            return self.on
        return self.every > 0 and version % self.every == 0

    def timed(self) -> bool:
        """Whether run.save_every_s passed since the last checkpoint; True from the first call that sees it
        until `saved()`."""
        if not self._timed and self.every_s > 0 and self.clock() - self._since >= self.every_s:
            self._timed = True
        return self._timed

    def saved(self) -> None:
        """A checkpoint was written: the time interval counts from now."""
        self._since = self.clock()
        self._timed = False


def note_failure(exc: BaseException, doing: str) -> None:
    """Record on `exc` what the run was doing when it failed (e.g. "writing checkpoint step 10 into
    runs/x/checkpoints"); the first note stays (where the failure began)."""
    if failed_while(exc) is None:
        exc.add_note(_NOTE + doing)


def failed_while(exc: BaseException) -> str | None:
    """What the run was doing when `exc` ended it (`note_failure`), or None."""
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, str) and note.startswith(_NOTE):
            return note[len(_NOTE):]
    return None


def failure_line(run_dir: str | Path, exc: BaseException, *, resumed: bool) -> str | None:
    """The one line that ends a failed run whose RUN_DIR holds a valid checkpoint of this run: what failed,
    its root cause, the last good checkpoint and the resume command; None when there is none. A fresh run
    that failed before it began (`note_failure` never called: a config or setup error) owns no checkpoint
    there, even if an earlier run left some: None unless `resumed`."""
    doing = failed_while(exc)
    if doing is None and not resumed:
        return None
    found = latest_valid(Path(run_dir) / CHECKPOINTS)
    if found is None:
        return None
    root = next(iter(cause_chain(exc)), type(exc).__name__)
    return (f"{doing or 'the run'} failed ({root}); the last good checkpoint is {found} (step {step_of(found)}): "
            f"once the cause is fixed, resume with: asyncrl launch --resume {run_dir}")
