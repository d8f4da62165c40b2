"""`asyncrl launch` with the [cluster] defaults on a local cluster it starts (asyncrl/deploy/auto.py): each role's
process really runs on the CPUs and with the torch threads the rules decide (placement.json is what the actors
report), the scorer is hosted by the buffer actor, and with max_staleness = 0 the trainer measures 1 thread against
all cores on its first updates and then keeps one count (`trainer/torch_threads` is what its update thread had)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncrl.deploy.auto import auto_affinity, available_cpus, decide_threads, thread_candidates
from asyncrl.telemetry.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _launch(config, run_dir, *sets):
    args = [sys.executable, "-m", "asyncrl.cli", "launch", str(config), "--set", f'run.output_dir="{run_dir}"',
            "--set", "trainer.eval_every=0", "--set", "run.save_checkpoint=false"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "placement.json").read_text()), [r for r in read_metrics(run_dir / "metrics.jsonl")
                                                                  if "reward/mean" in r]


def test_overlapping_roles_run_with_the_decided_cpus_and_threads(tiny_config_file, make_config, tmp_path):
    cpus = available_cpus()
    placement, rows = _launch(tiny_config_file, tmp_path / "k1", "staleness.max_staleness=1", "trainer.total_steps=3")
    assert len(rows) == 3
    assert not any(role.startswith("scorer") for role in placement)  # hosted by the buffer actor
    pins = auto_affinity(make_config("staleness.max_staleness=1"), cpus)
    if len(cpus) in (2, 3):  # a small machine: the trainer has cores of its own
        assert pins and pins["trainer"] == cpus[len(cpus) - len(pins["trainer"]):]
    for role, kind in (("trainer", "trainer"), ("generator 0", "generator"), ("buffer", "buffer")):
        where = placement[role]
        assert where["cpus"] == pins.get(kind, cpus), role
        cfg = make_config("staleness.max_staleness=1", *[f"cluster.affinity.{r}={c}" for r, c in pins.items()])
        assert where["torch_threads"] == decide_threads(cfg, len(where["cpus"]), kind), role
        assert where["gc_frozen"] > 10_000, role  # its setup's objects left out of every later collection
    if pins:  # pinned automatically, the trainer's tuner also tries every core; its first steps run on its own
        assert [r["trainer/cpus"] for r in rows] == [float(len(pins["trainer"]))] * 3
    # each process's CPU over each step's window (docs/metrics.md, Process CPU): every actor's process reports one
    # from its second report on (the first window would carry its setup), the hosted scorer none (the buffer's has
    # its work), the driver its own in every row; a core busy all the window is 1.0
    for i, row in enumerate(rows):
        assert 0.0 < row["controller/cpu_cores"] < len(cpus) + 0.5
        for role in ("trainer", "generator", "buffer"):
            assert (f"{role}/cpu_cores" in row) == (i > 0), (i, role)
            assert 0.0 < row.get(f"{role}/cpu_cores", 1.0) < len(cpus) + 0.5, (role, row[f"{role}/cpu_cores"])
        assert "scorer/cpu_cores" not in row
        # the driver's actor calls in the window: the next train step asked ahead, the send claimed, the next
        # version's receive armed, the publish (the last step asks for no next step and arms no receive);
        # the watch's heartbeats come every 3 s
        assert row["controller/actor_calls"] >= (4 if i + 1 < len(rows) else 2), (i, row["controller/actor_calls"])


def test_on_policy_trainer_measures_its_thread_counts_and_keeps_one(tiny_config_file, make_config, tmp_path):
    cpus = available_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: one thread count to choose from")
    placement, rows = _launch(tiny_config_file, tmp_path / "k0", "staleness.max_staleness=0", "trainer.total_steps=10")
    cfg = make_config("staleness.max_staleness=0")
    assert placement["trainer"]["cpus"] == cpus and placement["generator 0"]["cpus"] == cpus  # no pinning
    candidates = thread_candidates(cfg, len(cpus), "trainer")
    assert candidates == [1, len(cpus)]
    used = [int(r["trainer/torch_threads"]) for r in rows]
    # warm-up on 1 thread, then 1 and all cores in turn (3 windows each), then the faster one for good
    assert used[:7] == [1, 1, len(cpus), 1, len(cpus), 1, len(cpus)]
    assert len(set(used[7:])) == 1 and used[7] in candidates
    assert all(int(r["generator/torch_threads"]) in candidates for r in rows)
