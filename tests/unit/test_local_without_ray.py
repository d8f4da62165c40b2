"""`asyncrl launch --local` needs no Ray: the GPU machines the project is checked on have none
(.device/check.sh runs the first example there in one process). Each test runs Python in a subprocess
where `import ray` fails, as it does where Ray is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A None entry in sys.modules makes every `import ray` / `import ray.x` raise ImportError.
NO_RAY = "import sys\nsys.modules['ray'] = None\n"


def _python(code: str, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", NO_RAY + code], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout_s)


def test_the_in_process_path_imports_without_ray_and_the_ray_path_does_not():
    proc = _python(
        "import asyncrl.cli, asyncrl.deploy.local\n"
        "from asyncrl.deploy.local import LocalDeployment, run_local\n"
        "try:\n"
        "    import asyncrl.deploy.launch\n"
        "except ImportError as exc:\n"
        "    print('launch:', exc)\n", timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launch: import of ray halted" in proc.stdout  # the blocker works: the Ray path does need Ray


@pytest.mark.slow
def test_a_tiny_local_run_finishes_where_ray_cannot_be_imported(tiny_config_file, tmp_path):
    run_dir = tmp_path / "no-ray"
    args = ["launch", str(tiny_config_file), "--local", "--set", f"run.output_dir={json.dumps(str(run_dir))}",
            "--set", "trainer.total_steps=2", "--set", "trainer.eval_every=0"]
    proc = _python(f"from asyncrl.cli import main\nrc = main({args!r})\n"
                   "print('ray in sys.modules:', sys.modules.get('ray'))\nsys.exit(rc)\n", timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ray in sys.modules: None" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
