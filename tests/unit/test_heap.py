"""asyncrl/heap.py: `settle()` collects setup's garbage, then leaves every surviving object out of later
collections. Run in a fresh interpreter: a frozen test process would keep every object it holds forever."""

import subprocess
import sys

SCRIPT = """
import gc, weakref
class Node:
    pass
kept = [Node() for _ in range(50_000)]            # what setup keeps for the run
cycle = Node(); cycle.me = cycle                  # what setup left behind
dead = weakref.ref(cycle); del cycle
tracked_before = len(gc.get_objects())
from asyncrl import heap
frozen = heap.settle()
assert dead() is None, "setup's garbage was frozen instead of collected"
assert frozen >= 50_000 and gc.get_freeze_count() == frozen
tracked_after = len(gc.get_objects())             # what a full collection walks now
assert tracked_after < tracked_before - 50_000, (tracked_before, tracked_after)
later = Node(); later.me = later                  # made during the run: collected as before
gone = weakref.ref(later); del later
gc.collect()
assert gone() is None
print("ok", tracked_before, tracked_after)
"""


def test_settle_collects_setup_garbage_and_freezes_what_survives():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")
