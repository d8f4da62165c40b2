"""A role's torch threads chosen from its measured speed (`cluster.torch_threads = "auto"`, Ray deployment).

Which thread count is faster depends on the work and on what else runs, not only on the cores. On the 2-core
machine of benchmarks/README.md (overlap, max_staleness 0, a 0.8M-parameter model), the trainer's update took a
median 0.187 s on 1 thread and 0.134 s on 2, and a step's generation 0.095 s and 0.068 s. But with every
process at 2 threads (`torch_threads = 2`: the buffer's and the scorer's too) generation went from 0.114 s to
0.174 s. And small matmuls can lose more to a second thread's hand-offs than it computes. So where asyncrl.auto
offers a role more than one count (`thread_candidates`: the phases alternate, or the role has cores of its own),
a `ThreadTuner` measures them on the role's own work and keeps the faster:

- after `skip` warm-up units, windows of `window` units run with each candidate in turn (1, n, 1, n, ...: a steady
  drift of the machine's speed favours neither), `windows` per candidate;
- the candidate with the lower median seconds per unit (a trainer update; a decode step's tokens) is kept for
  the rest of the run.

`TunedUpdater` wraps the trainer's learner (the update runs on a worker thread: the count is set in that thread,
OpenMP settings being per thread); the native engine's scheduler thread takes `ThreadTuner` as `tuner`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


class ThreadTuner:
    """Measures each candidate thread count on the role's own work and keeps the fastest (module docstring)."""

    def __init__(self, candidates: list[int], *, window: int = 1, windows: int = 3, skip: int = 1) -> None:
        if not candidates or min(candidates) < 1:
            raise ValueError(f"thread candidates must be >= 1, got {candidates}")
        self.candidates = sorted(set(candidates))
        self.window, self.windows, self.skip = window, windows, skip
        self.samples: dict[int, list[float]] = {n: [] for n in self.candidates}
        self._seen = 0
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None

    @property
    def current(self) -> int:
        """The count the next unit of work runs with."""
        if self.chosen is not None:
            return self.chosen
        measured = max(0, self._seen - self.skip)
        return self.candidates[(measured // self.window) % len(self.candidates)]

    def record(self, seconds: float, units: float = 1.0) -> None:
        """One unit of work ran with `current` threads and took `seconds` for `units` (tokens, samples)."""
        if self.chosen is not None:
            return
        n = self.current
        if self._seen >= self.skip and units > 0:
            self.samples[n].append(seconds / units)
        self._seen += 1
        if all(len(s) >= self.window * self.windows for s in self.samples.values()):
            self.chosen = min(self.candidates, key=lambda c: (statistics.median(self.samples[c]), c))

    def seconds_per_unit(self) -> dict[int, float]:
        """The median seconds per unit measured for each candidate so far."""
        return {n: statistics.median(s) for n, s in self.samples.items() if s}


class TunedUpdater:
    """The trainer's learner, its `update` run with the tuner's thread count (set on the worker thread that runs
    it) and timed; every other attribute is the learner's. Adds `trainer/torch_threads`: the count the update's
    thread really had."""

    def __init__(self, learner: Any, tuner: ThreadTuner) -> None:
        self.__dict__["learner"] = learner
        self.__dict__["tuner"] = tuner

    def update(self, groups: list[Any]) -> dict[str, float]:
        torch.set_num_threads(self.tuner.current)
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        metrics = self.learner.update(groups)
        self.tuner.record(time.perf_counter() - t0)
        return {**metrics, "trainer/torch_threads": float(threads)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.learner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.learner, name, value)
