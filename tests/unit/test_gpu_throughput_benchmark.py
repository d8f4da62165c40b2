"""benchmarks/gpu_throughput.py runs end to end in --quick mode (a tiny model on the CPU: generation at the batch
and at batch 1, a colocated and a lone train step) and ends with the benchmark JSON line. Speed is not asserted
(benchmarks/README.md); the GPU figures come from .device/check.sh."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_throughput.py"


def test_quick_gpu_throughput_benchmark_ends_with_the_result_json_line(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    returned = module.main(["--quick"])
    out = capsys.readouterr().out
    assert "A. generation" in out and "B. train step, colocated" in out and "C. train step, trainer alone" in out
    assert "load_weights" in out  # the colocated hand-over was timed
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"benchmark", "value", "unit", "baseline", "ratio", "target"}
    assert last["benchmark"] == "gpu_throughput_cpu" and last["unit"] == "tokens/s" and last["target"] == 32.0
    assert last["value"] > 0 and last["baseline"] > 0
    assert abs(last["ratio"] - last["value"] / last["baseline"]) <= 0.01 * last["ratio"]
    assert last == returned
