"""benchmarks/weight_sync.py runs end to end in --quick mode (gloo and ipc ranks as processes, Ray skipped) and ends
with the benchmark JSON line. Speed is not asserted (benchmarks/README.md); the bytes are: the script exits
when a receiver's crc differs from the sender's."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_weight_sync_benchmark_ends_with_the_result_json_line(capsys, monkeypatch):
    # on sys.path (not loaded from a file spec): the spawned ranks import the module by name
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    returned = importlib.import_module("weight_sync").main(["--quick", "--no-ray"])
    out = capsys.readouterr().out
    assert "raw dist.broadcast" in out and "asyncrl collective" in out and "BYTES DIFFER" not in out
    assert "raw shared-memory copy" in out and "asyncrl ipc" in out  # the ipc transport, CPU shared memory
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"benchmark", "value", "unit", "baseline", "ratio", "target"}
    assert last["benchmark"] == "weight_sync" and last["unit"] == "s" and last["target"] == 0.8
    assert last["value"] > 0 and last["baseline"] > 0
    assert abs(last["ratio"] - last["baseline"] / last["value"]) <= 0.01 * last["ratio"] + 1e-3
    assert last == returned
