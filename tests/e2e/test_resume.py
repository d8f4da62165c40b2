"""Durable checkpoints and `asyncrl launch --resume`: the driver is killed with SIGKILL mid-run and the run
resumed from its newest valid checkpoint.

(a) k = 0, one generator, seeded groups: the resumed run ends with weights bit-identical to an
    uninterrupted run's. (b) k = 1, two generators: every step trains exactly the groups (ids and prompts)
    the uninterrupted run trained, each once; metrics.jsonl has every step once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _launch(*args: str | Path) -> subprocess.Popen:
    """`asyncrl launch ARGS` as its own process (the driver a test can SIGKILL)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "launch", *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def _kill_after_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120) -> None:
    """SIGKILL the driver once checkpoint `step` is in place (it may have gone on a little further)."""
    target = run_dir / "checkpoints" / f"step_{step:08d}"
    deadline = time.monotonic() + timeout
    while not target.is_dir():
        assert proc.poll() is None, f"the run ended before checkpoint {step}: {proc.stdout.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no checkpoint {step} within {timeout}s"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoint" / "model.safetensors"))


def _ledger(run_dir: Path) -> dict[int, list[list]]:
    lines = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)), "a step appears twice in the ledger"
    return {line["step"]: line["groups"] for line in lines}


def _config(tiny_config_file: Path, tmp_path: Path, name: str, *sets: str) -> tuple[Path, list[str]]:
    run_dir = tmp_path / name
    overrides = [f'run.output_dir="{run_dir}"', "trainer.eval_every=0", "rollout.seed_groups=true",
                 "logging.live=false", *sets]
    return run_dir, [arg for s in overrides for arg in ("--set", s)]


def test_a_k0_run_killed_and_resumed_ends_with_the_uninterrupted_runs_weights(tiny_config_file, tmp_path):
    sets = ("trainer.total_steps=24", "staleness.max_staleness=0", "rollout.num_generators=1")
    clean_dir, clean = _config(tiny_config_file, tmp_path, "clean", *sets)
    _finish(_launch(tiny_config_file, "--local", *clean))

    run_dir, args = _config(tiny_config_file, tmp_path, "killed", *sets, "run.save_every=4", "run.keep_last=2")
    proc = _launch(tiny_config_file, "--local", *args)
    _kill_after_checkpoint(proc, run_dir, 8)
    assert not (run_dir / "checkpoint").exists()  # the run did not finish
    out = _finish(_launch("--local", "--resume", str(run_dir), "--set", "logging.live=false"))
    assert "resuming from" in out

    clean_w, resumed_w = _weights(clean_dir), _weights(run_dir)
    assert clean_w.keys() == resumed_w.keys()
    assert all(torch.equal(clean_w[k], resumed_w[k]) for k in clean_w)
    assert _ledger(run_dir) == _ledger(clean_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 25))  # every step once, in order
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == 2  # keep_last


def test_b_k1_two_generators_killed_and_resumed_train_every_group_once(tiny_config_file, tmp_path):
    sets = ("trainer.total_steps=20", "staleness.max_staleness=1", "rollout.num_generators=2")
    clean_dir, clean = _config(tiny_config_file, tmp_path, "clean", *sets)
    _finish(_launch(tiny_config_file, "--local", *clean))

    run_dir, args = _config(tiny_config_file, tmp_path, "killed", *sets, "run.save_every=3")
    proc = _launch(tiny_config_file, "--local", *args)
    _kill_after_checkpoint(proc, run_dir, 9)
    _finish(_launch("--local", "--resume", str(run_dir), "--set", "logging.live=false",
                    "--set", 'run.export_dtype="bfloat16"'))
    assert {t.dtype for t in _weights(run_dir).values()} == {torch.bfloat16}  # the final export's dtype

    clean_ledger, resumed = _ledger(clean_dir), _ledger(run_dir)
    assert sorted(resumed) == list(range(1, 21))
    trained = [tuple(g) for step in sorted(resumed) for g in resumed[step]]
    assert len(trained) == len(set(trained)) == 20 * 4  # every group once (prompts_per_step = 4)
    assert {g for gs in clean_ledger.values() for g in map(tuple, gs)} == set(trained)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_or_ctrl_c_finishes_the_step_writes_a_checkpoint_and_the_run_resumes_from_it(tiny_config_file,
                                                                                          tmp_path, sig, status):
    run_dir, args = _config(tiny_config_file, tmp_path, "preempted", "trainer.total_steps=400",
                            "staleness.max_staleness=1")
    proc = _launch(tiny_config_file, "--local", *args)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == status, out[-2000:]
    assert f"stopped by {sig.name} after step" in out and f"resume with: asyncrl launch --resume {run_dir}" in out
    (ckpt,) = (run_dir / "checkpoints").glob("step_*")  # run.save_every is off: the one the signal wrote
    stopped_at = int(ckpt.name.removeprefix("step_"))
    assert stopped_at < 400

    _finish(_launch("--local", "--resume", str(run_dir), "--set", "trainer.total_steps=" + str(stopped_at + 3),
                    "--set", "logging.live=false"))
    ledger = _ledger(run_dir)
    assert sorted(ledger) == list(range(1, stopped_at + 4))
    trained = [tuple(g) for step in sorted(ledger) for g in ledger[step]]
    assert len(trained) == len(set(trained)) == (stopped_at + 3) * 4
    assert sorted(g[0] for g in trained) == list(range(len(trained)))  # no group skipped (none failed here)


def test_a_run_on_ray_resumes_from_its_checkpoint_with_the_version_numbering_it_had(ray_cluster, make_config,
                                                                                  tmp_path):
    from asyncrl.deploy.launch import run_with_ray

    run_dir = tmp_path / "ray"
    sets = [f'run.output_dir="{run_dir}"', "trainer.eval_every=0", "run.save_every=2", "rollout.num_generators=2"]
    run_with_ray(make_config(*sets, "trainer.total_steps=4"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    rows = run_with_ray(make_config(*sets, "trainer.total_steps=6"), resume=True)
    assert [r["step"] for r in rows if "trainer/samples" in r] == [1, 2, 3, 4, 5, 6]  # earlier rows kept
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    trained = [tuple(g) for step, gs in sorted(_ledger(run_dir).items()) for g in gs]
    assert len(trained) == len(set(trained)) == 6 * 4
