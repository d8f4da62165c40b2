"""The code base stays lint-clean: `ruff check` with the [tool.ruff] settings of pyproject.toml
(line length 120; pycodestyle errors and warnings, pyflakes, import order) reports nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_reports_no_findings() -> None:
    pytest.importorskip("ruff")  # the `test` extra installs it
    # --no-cache: a test run writes nothing into the checkout
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}{result.stderr}"
