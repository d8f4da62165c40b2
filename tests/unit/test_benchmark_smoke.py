"""benchmarks/engine_throughput.py runs end to end in --quick mode and ends with the benchmark JSON line.

Speed is not asserted here (benchmarks/README.md): this only keeps the script from rotting as the engine
changes underneath it. The quick run itself takes well under a second; importing transformers, when no
earlier test did, takes a few more.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_throughput.py"


def load_benchmark(monkeypatch):
    """The script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("engine_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve the script's annotations through sys.modules
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_quick_benchmark_ends_with_the_result_json_line(capsys, monkeypatch):
    threads = torch.get_num_threads()
    try:
        returned = load_benchmark(monkeypatch).main(["--quick", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide count
    out = capsys.readouterr().out
    assert "A. fixed batches" in out and "B. " in out and "C. in-flight weight update" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"benchmark", "value", "unit", "baseline", "ratio", "target"}
    assert last["benchmark"] == "engine_throughput" and last["unit"] == "tokens/s" and last["target"] == 3.0
    assert last["value"] > 0 and last["baseline"] > 0
    assert abs(last["ratio"] - last["value"] / last["baseline"]) <= 0.01 * last["ratio"]
    assert last == returned


def test_train_step_quick_run_prints_the_breakdown_and_the_result_json_line(capsys, monkeypatch):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"
    spec = importlib.util.spec_from_file_location("train_step_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        returned = module.main(["--quick", "--decoupled", "--compare", "prox_from_gradient_pass"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "bare step" in out and "prox_from_gradient_pass off" in out
    for section in ("forward + logprobs", "backward", "clip + optimizer", "collate", "prepare", "metrics"):
        assert section in out, section
    last = json.loads(out.strip().splitlines()[-1])
    assert last == returned and last["benchmark"] == "train_step" and last["unit"] == "steps/s"
    assert last["value"] > 0 and last["baseline"] > 0
    assert abs(last["ratio"] - last["value"] / last["baseline"]) <= 0.01 * last["ratio"] + 1e-3
