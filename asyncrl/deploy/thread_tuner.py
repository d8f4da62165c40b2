"""A role's torch threads chosen from its measured speed (`cluster.torch_threads = "auto"`, Ray deployment).

Which thread count is faster depends on the work and on what else runs, not only on the cores. On the 2-core
machine of benchmarks/README.md (overlap, max_staleness 0, a 0.8M-parameter model), the trainer's update took a
median 0.187 s on 1 thread and 0.134 s on 2, and a step's generation 0.095 s and 0.068 s. But with every
process at 2 threads (`torch_threads = 2`: the buffer's and the scorer's too) generation went from 0.114 s to
0.174 s. And small matmuls can lose more to a second thread's hand-offs than it computes. So where asyncrl.deploy.auto
offers a role more than one count (`thread_candidates`: the phases alternate, or the role has cores of its own),
a `ThreadTuner` measures them on the role's own work and keeps the faster:

- after `skip` warm-up units, windows of `window` units run with each candidate in turn (1, n, 1, n, ...: a steady
  drift of the machine's speed favours neither), `windows` per candidate;
- the candidate with the lower median seconds per unit (a trainer update; a decode step's tokens) is kept for
  the rest of the run; with `decisive` set, as soon as every candidate has one window and the slowest one's
  quickest unit took that many times the fastest one's (a long step should not run its slow layout 3 times).

`TunedUpdater` wraps the trainer's learner (the update runs on a worker thread: the count is set in that thread,
OpenMP settings being per thread); the native engine's scheduler thread takes `ThreadTuner` as `tuner`.

Where the automatic affinity pinned the trainer to cores of its own (asyncrl/deploy/auto.py), its candidates are
`Layout`s: its threads on its own cores, and as many threads as the run has cores on all of them (the trainer's
process then runs on the generators' cores too). Which one pays depends on how busy the generators are: on the
first example (generation and training balanced) the pinned trainer keeps its core free of the light roles; on
the SmolLM2 example the generator idles most of a step, and the trainer pinned to one of two cores left the other
idle (10 s a step, against 6.5-7 s spread over both; docs/config.md, `auto_affinity`). Layouts are judged by the
steps' pace (`TunedUpdater(per_step=True)`), two steps a window, and `decisive` ends the measuring early.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, NamedTuple

import torch

from asyncrl.deploy.auto import available_cpus, pin_cpus

log = logging.getLogger(__name__)


class Layout(NamedTuple):
    """A trainer candidate: `threads` torch threads on `cpus` (every thread of its process pinned there)."""

    threads: int
    cpus: tuple[int, ...]


def _threads(candidate: int | Layout) -> int:
    return candidate.threads if isinstance(candidate, Layout) else candidate


def trainer_layouts(candidates: list[int], own: list[int], spread: list[int], fixed: int | None = None) -> list[Any]:
    """The trainer tuner's candidates: each thread count of `candidates` on the CPUs it runs on (`own`), and where
    the automatic affinity pinned it there (`spread`: every CPU of the run, more than `own`) one more, on all of
    `spread` with as many threads (`fixed`: an explicit `cluster.torch_threads`, kept). Plain counts otherwise."""
    if not spread or set(spread) <= set(own):
        return list(candidates)
    home = tuple(own)
    return [*(Layout(n, home) for n in candidates), Layout(fixed or len(spread), tuple(sorted(spread)))]


class ThreadTuner:
    """Measures each candidate thread count (or `Layout`) on the role's own work and keeps the fastest (module
    docstring)."""

    def __init__(self, candidates: list[Any], *, window: int = 1, windows: int = 3, skip: int = 1,
                 decisive: float | None = None) -> None:
        if not candidates or min(_threads(c) for c in candidates) < 1:
            raise ValueError(f"thread candidates must be >= 1, got {candidates}")
        self.candidates = sorted(set(candidates))
        self.window, self.windows, self.skip, self.decisive = window, windows, skip, decisive
        self.samples: dict[Any, list[float]] = {n: [] for n in self.candidates}
        self._seen = 0
        self.chosen: Any = self.candidates[0] if len(self.candidates) == 1 else None

    @property
    def current(self) -> Any:
        """The count (or layout) the next unit of work runs with."""
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
            self.chosen = self._fastest()
        elif self.decisive is not None and all(len(s) >= self.window for s in self.samples.values()):
            best = {c: min(s) for c, s in self.samples.items()}  # each one's quickest: an outlier (an evaluation) aside
            if max(best.values()) >= self.decisive * min(best.values()):
                self.chosen = min(self.candidates, key=lambda c: (best[c], c))

    def _fastest(self) -> Any:
        return min(self.candidates, key=lambda c: (statistics.median(self.samples[c]), c))

    def seconds_per_unit(self) -> dict[Any, float]:
        """The median seconds per unit measured for each candidate so far."""
        return {n: statistics.median(s) for n, s in self.samples.items() if s}


class TunedUpdater:
    """The trainer's learner, its `update` run with the tuner's thread count (set on the worker thread that runs
    it) and timed; every other attribute is the learner's. Adds `trainer/torch_threads`: the count the update's
    thread really had. With `Layout` candidates the process is pinned to the layout's CPUs before the update
    (only when they change) and `trainer/cpus` says on how many it ran.

    `per_step`: the tuner is given each step's whole cycle (from one update's start to the next's, the gate
    wait included: the process stays in one layout for all of it) instead of the update alone. A layout is
    judged by the run's pace: spread over the generators' cores, the update itself may be quicker while the
    generation it slows makes every step longer (the first example: 26-28 ms a step spread, 19-20 pinned)."""

    def __init__(self, learner: Any, tuner: ThreadTuner, *, per_step: bool = False) -> None:
        self.__dict__["learner"] = learner
        self.__dict__["tuner"] = tuner
        self.__dict__["per_step"] = per_step
        self.__dict__["cpus"] = tuple(available_cpus())  # where the process runs now (pinned at the actor's start)
        self.__dict__["_step_start"] = None  # per_step: when the previous update began

    def update(self, groups: list[Any]) -> dict[str, float]:
        start = time.perf_counter()
        if self.per_step and self._step_start is not None:
            self.tuner.record(start - self._step_start)  # the step before, in the layout it ran with
        self.__dict__["_step_start"] = start
        candidate = self.tuner.current
        extra: dict[str, float] = {}
        if isinstance(candidate, Layout):
            if candidate.cpus != self.cpus:
                try:
                    pin_cpus(list(candidate.cpus), "trainer")  # every thread of the process, OpenMP's pool among them
                    self.__dict__["cpus"] = candidate.cpus
                except RuntimeError as exc:  # e.g. a cpuset that no longer offers them: stay where it runs
                    log.warning("trainer: cannot move to CPUs %s (%s); it stays on %s", list(candidate.cpus), exc,
                                list(self.cpus))
                    stay = [c for c in self.tuner.candidates if isinstance(c, Layout) and c.cpus == self.cpus]
                    candidate = self.tuner.chosen = stay[0] if stay else Layout(_threads(candidate), self.cpus)
            extra["trainer/cpus"] = float(len(candidate.cpus))
        torch.set_num_threads(_threads(candidate))
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        metrics = self.learner.update(groups)
        if not self.per_step:
            self.tuner.record(time.perf_counter() - t0)
        return {**metrics, "trainer/torch_threads": float(threads), **extra}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.learner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.learner, name, value)
