"""The run's watch: ends a run that cannot make progress with one clear error, instead of letting it hang.

Place in the dataflow: the Controller runs `RunWatch.run()` beside the generator and scorer loops for the
whole training loop; its `_guard` fails fast (one line) when the watch raises `RunStalled`. Every
`period_s` the watch reads the buffer's `progress()` (buffers/progress.py) and ends the run when

| bound                            | crossed when                                                       |
|----------------------------------|--------------------------------------------------------------------|
| `run.max_failed_groups_in_a_row` | that many groups in a row failed or were filtered, none trained on |
| `run.no_progress_timeout_s`      | no group was accepted and no step taken for that many seconds      |

Why: a failed or filtered group gives its slot back and the gate admits a fresh prompt in its place, so
a run in which every group fails (a reward that always raises, rows without the answer field, a row the
generator cannot encode) would refill and fail forever without writing a metrics row. The error quotes
the last distinct reasons the generators and scorers gave when they released the groups.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from buffers.progress import Progress

log = logging.getLogger(__name__)


class RunStalled(RuntimeError):
    """The run cannot make progress; the message is one line naming the cause."""


class ProgressSource(Protocol):
    """The ReplayBuffer, as far as the watch reads it."""

    async def progress(self) -> Progress: ...


class RunWatch:
    """Reads the run's progress every `period_s` and raises RunStalled when a bound is crossed.

    `max_failed_in_a_row` and `no_progress_timeout_s`: 0 turns that bound off. Every call the watch makes
    is itself bounded by `call_timeout_s`.
    """

    def __init__(self, *, buffer: ProgressSource | Any, max_failed_in_a_row: int, no_progress_timeout_s: float,
                 call_timeout_s: float = 60.0, period_s: float = 1.0) -> None:
        self.buffer = buffer
        self.max_failed_in_a_row = max_failed_in_a_row
        self.no_progress_timeout_s = no_progress_timeout_s
        self.call_timeout_s = call_timeout_s
        self.period_s = period_s

    async def run(self) -> None:
        """Check until a bound is crossed (raises RunStalled); cancelled when the run ends."""
        while True:
            await asyncio.sleep(self.period_s)
            try:
                progress = await asyncio.wait_for(self.buffer.progress(), self.call_timeout_s)
            except asyncio.TimeoutError:
                raise RunStalled(f"the replay buffer has not answered for {self.call_timeout_s:g} s") from None
            self.check_progress(progress)

    def check_progress(self, p: Progress) -> None:
        """Raise RunStalled when `p` crosses a bound."""
        reasons = "; ".join(reversed(p.reasons))  # newest first: a cut-off line keeps the latest
        limit, timeout = self.max_failed_in_a_row, self.no_progress_timeout_s
        if limit and p.released_in_a_row >= limit:
            raise RunStalled(f"no progress: the last {p.released_in_a_row} groups all failed or were filtered and "
                             f"none was trained on (run.max_failed_groups_in_a_row = {limit}); last reasons: "
                             f"{reasons}")
        if timeout and p.idle_s >= timeout:
            released = (f"; {p.released_in_a_row} groups failed or were filtered meanwhile, last reasons: {reasons}"
                        if p.released_in_a_row else "")
            raise RunStalled(f"no progress: no group was accepted for training and no step taken for "
                             f"{p.idle_s:.0f} s (run.no_progress_timeout_s = {timeout:g}){released}")
