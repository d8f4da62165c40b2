"""benchmarks/trainer_scaling.py runs end to end in --quick mode (2 trainer ranks and a receiver as spawned processes,
DDP and FSDP2) and ends with the benchmark JSON line. Speed is not asserted (benchmarks/README.md): this keeps the
script running as the Learner and DataParallel change underneath it. About 10-20 s (three processes import torch and
transformers), so slow."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_quick_trainer_scaling_benchmark_ends_with_the_result_json_line(capsys, monkeypatch):
    # on sys.path (not loaded from a file spec): the spawned ranks import the module by name
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    returned = importlib.import_module("trainer_scaling").main(["--quick"])
    out = capsys.readouterr().out
    for line in ("1 rank, 1 thread", "1 rank, 2 threads", "ddp, 2 ranks", "fsdp2, 2 ranks",
                 "compute alone", "synchronising", "gather"):
        assert line in out
    last = json.loads(out.strip().splitlines()[-1])
    assert {"benchmark", "value", "unit", "baseline", "ratio", "target"} <= set(last)
    assert last["benchmark"] == "trainer_scaling" and last["target"] == 0.8 and last["baseline"] == 1.0
    assert 0 < last["value"] == last["ratio"] and last["fsdp2"] > 0
    # every configuration trained and sent: a missing time would be nan, which json writes as NaN
    assert all(seconds > 0 for seconds in last["send_s"].values()) and len(last["send_s"]) == 4
    assert last == returned
