"""Progress of a run as the buffer sees it: groups released in a row without one accepted, and why.

Place in the dataflow: the ReplayBuffer notes every group a scorer accepts, every group a generator or
scorer releases (with a short reason: the reward's error, "rewards all 0"), and every step the trainer
takes. The Controller's watch (`asyncrl/control/watchdog.py`) reads `report()` and ends a run that makes no
progress — every group failing or filtered, e.g. a reward that always raises — with one error naming the
last distinct reasons, instead of refilling and failing groups forever.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import msgspec

REASON_CHARS = 160  # a reason is one line of at most this many characters


class Progress(msgspec.Struct, kw_only=True):
    """What `ProgressTracker.report()` says; crosses the actor boundary."""

    released_in_a_row: int  # groups failed or filtered since the last accepted one (or the start)
    idle_s: float           # seconds since a group was last accepted or a step taken (or the start)
    reasons: list[str]      # the last few distinct release reasons of that streak, newest last, with counts


class ProgressTracker:
    """Counts the streak of released groups and keeps its last `keep` distinct reasons."""

    def __init__(self, *, keep: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep = keep
        self._clock = clock
        self._last_progress = clock()
        self._in_a_row = 0
        self._reasons: OrderedDict[str, int] = OrderedDict()  # reason -> groups of the streak, newest last

    def accepted(self, groups: int) -> None:
        """Groups went to training: the streak ends."""
        if groups:
            self._last_progress = self._clock()
            self._in_a_row = 0
            self._reasons.clear()

    def stepped(self) -> None:
        """The trainer took a step."""
        self._last_progress = self._clock()

    def released(self, groups: int, kind: str, detail: str = "") -> None:
        """`groups` groups were released as `kind` ("failed" / "filtered") because of `detail`."""
        if not groups:
            return
        lines = detail.strip().splitlines()
        reason = f"{kind}: {lines[0][:REASON_CHARS]}" if lines else f"{kind} (no reason given)"
        self._in_a_row += groups
        self._reasons[reason] = self._reasons.pop(reason, 0) + groups
        while len(self._reasons) > self.keep:
            self._reasons.popitem(last=False)

    def report(self) -> Progress:
        reasons = [f"{reason} (x{n})" for reason, n in self._reasons.items()]
        return Progress(released_in_a_row=self._in_a_row, idle_s=self._clock() - self._last_progress,
                        reasons=reasons)
