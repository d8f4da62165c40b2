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
    assert set(last) == {"benchmark", "value", "unit", "baseline", "ratio", "target", "step_ms", "floor_ms",
                         "step_over_floor"}
    assert last["benchmark"] == "engine_throughput" and last["unit"] == "tokens/s" and last["target"] == 2.0
    assert last["step_ms"] > 0 and last["floor_ms"] > 0
    # each figure is rounded on its own (ms to 0.1 µs, the ratio to 0.001): equal up to that rounding
    assert abs(last["step_over_floor"] - last["step_ms"] / last["floor_ms"]) <= 0.01 * last["step_over_floor"] + 0.002
    assert last["value"] > 0 and last["baseline"] > 0
    assert abs(last["ratio"] - last["value"] / last["baseline"]) <= 0.01 * last["ratio"]
    assert last == returned


def test_the_decode_floor_grows_with_batch_and_attended_width(monkeypatch):
    """decode_floor times the step's products at the model's shapes: far more rows and cache positions
    cost more (the shapes differ by 64x, so timing noise cannot reorder them)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    bench = load_benchmark(monkeypatch)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    small = bench.decode_floor(model, batch=1, width=8, repeats=3)
    large = bench.decode_floor(model, batch=64, width=512, repeats=3)
    for f in (small, large):
        assert set(f) == {"floor_s", "linears_s", "attention_s"} and min(f.values()) > 0
    assert large["attention_s"] > small["attention_s"] and large["floor_s"] > small["floor_s"]
