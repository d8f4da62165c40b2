""".device/check.sh, the GPU check that runs only when a GPU machine is lent (docs/gpu.md), rehearsed on the CPU with
REHEARSE=1 so that it cannot rot between those chances: every section runs (the gpu tests collect and skip, the
first example learns without the GPU overrides, the benchmark runs --quick), the summary lists them all, and the
files the device call brings back are written. A budget too small for the sections skips them and still prints the
summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["environment", "(a) gpu tests", "(b) first_digit", "(c) nccl hostid", "(d) gpu_throughput",
            "(e) trainer.compile"]

pytestmark = pytest.mark.slow


def _rehearse(tmp_path: Path, **env: str) -> tuple[int, str, list[str]]:
    environ = {**os.environ, "REHEARSE": "1", "PYTHON": sys.executable, "WORK": str(tmp_path / "work"),
               "OUT": str(tmp_path / "out"), **env}
    done = subprocess.run(["bash", ".device/check.sh"], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert "=== summary ===" in out, out[-3000:]
    summary = out.split("=== summary ===", 1)[1].strip().splitlines()
    return done.returncode, out, summary


def test_the_gpu_check_rehearses_every_section_on_the_cpu(tmp_path: Path) -> None:
    rc, out, summary = _rehearse(tmp_path)
    assert rc == 0, out[-3000:]
    for name in SECTIONS:
        (row,) = [r for r in summary if r.startswith(name)]
        assert " ok " in row, row
    assert "ok: learned" in out  # .device/first_digit.py's verdict
    files = tmp_path / "out"
    assert "=== summary ===" in (files / "check.log").read_text()
    assert (files / "first_digit_metrics.jsonl").read_text().count("\n") > 50
    line = json.loads((files / "gpu_throughput.json").read_text())
    assert set(line) == {"benchmark", "value", "unit", "baseline", "ratio", "target"}
    for report in ("gpu_tests.xml", "transport_tests.xml", "compile_tests.xml"):
        suite = ET.parse(files / report).getroot().find("testsuite")
        assert suite is not None and int(suite.get("tests")) > 0, report  # the gpu tests were collected
        assert int(suite.get("failures")) == int(suite.get("errors")) == 0, report


def test_a_spent_budget_skips_the_remaining_sections_and_still_prints_the_summary(tmp_path: Path) -> None:
    rc, _, summary = _rehearse(tmp_path, BUDGET_S="21")  # the environment takes over a second: nothing else fits
    assert rc == 1
    (last,) = [r for r in summary if r.startswith(SECTIONS[-1])]
    assert "SKIPPED (budget spent)" in last
