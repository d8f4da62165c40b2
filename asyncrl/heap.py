"""The cyclic garbage collector of a process that hosts a run: a role's actor, the driver of `asyncrl launch`.

Place in the dataflow: none — called once per such process, after its setup, before its first step.

A role's process imports torch, transformers and Ray and builds its model, tokenizer and engine: some 400,000
objects the cyclic collector tracks, nearly all kept for the whole run. A full (generation 2) collection walks
every one of them: 150–470 ms each on the 2-core machine of benchmarks/README.md (a gc callback in every actor
of a first_digit run on Ray), during which that role does nothing else. They come every few hundred steps; each
600-step first_digit run had 3 steps of 270–360 ms against a median of 26–35 ms. `settle()` collects what setup
left behind, then moves every object that survived into the permanent generation (`gc.freeze()`), which no
later collection walks; the objects the run makes from then on are collected as before. With it, the same runs
had no step over 50 ms.

Only for processes that host one run and end with it: a process that runs many (the test suite, a notebook)
would keep every object alive at each call forever. So the library's own run functions do not call it; the
Ray actors (`asyncrl.deploy.actors.RoleActor`) and the `asyncrl launch` and `asyncrl serve` commands do.
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect, then freeze every surviving tracked object out of later collections; returns how many were
    frozen. Call after the process built what it keeps for the run."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
