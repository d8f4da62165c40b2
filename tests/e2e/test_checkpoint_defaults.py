"""Durable checkpoints on by default (run.save_every_s) and a failed checkpoint that says how to go on, on whole
in-process runs of the tiny config: the time interval's checkpoints are drained ones (driven by an injected
clock, no waiting); the README's command run twice into one run directory works; a save that fails for a full
disk (an injected ENOSPC) ends the run with the last good checkpoint and the resume command, its partial folder
is never taken for a checkpoint, and the resume trains every remaining step once."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole runs in process


def _ledger_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def _steps(run_dir: Path) -> list[int]:
    from asyncrl.checkpoints.store import list_checkpoints

    return [step for step, _ in list_checkpoints(run_dir / "checkpoints")]


def _launch(*args: str) -> int:
    from asyncrl.cli import main

    return main(["launch", *args, "--local", "--set", "logging.live=false", "--set", "trainer.eval_every=0"])


def test_the_time_interval_writes_drained_checkpoints_at_most_two_steps_after_it_passes(make_config, tmp_path):
    from asyncrl.aio import run_loop
    from asyncrl.checkpoints.store import read_state
    from asyncrl.control.controller import Controller
    from asyncrl.deploy.local import LocalDeployment

    run_dir = tmp_path / "timed"
    cfg = make_config("trainer.total_steps=9", "trainer.eval_every=0", "run.save_every_s=250", "run.keep_last=0",
                      "run.save_checkpoint=false", "logging.live=false", f'run.output_dir="{run_dir}"')
    controller = Controller(cfg, LocalDeployment(cfg))
    # every train step "takes" 100 s: the deadline passes 2.5 steps after the start or the last checkpoint
    controller.saves.clock = lambda: 100.0 * controller.rows_written
    run_loop(controller.run())

    steps = _steps(run_dir)
    assert steps[-1] == 9 and len(steps) >= 2, steps  # the last step, and at least one on time before it
    for before, after in zip([0, *steps[:-1]], steps[:-1]):
        assert 3 <= after - before <= 5, steps  # at 2.5 steps' time, at the first drained step (<= 2 later)
    for step in steps:  # drained: the trainer had taken no group of the next step (nothing prefetched)
        _, state = read_state(run_dir / "checkpoints" / f"step_{step:08d}")
        assert state["buffer"]["gate"]["steps_taken"] == step, (step, state["buffer"]["gate"])
    assert _ledger_steps(run_dir) == list(range(1, 10))


def test_the_same_command_run_twice_replaces_the_finished_runs_checkpoint(tiny_config_file, tmp_path):
    run_dir = tmp_path / "twice"
    out = ["--set", f'run.output_dir="{run_dir}"']
    assert _launch(str(tiny_config_file), *out, "--set", "trainer.total_steps=3") == 0
    assert _steps(run_dir) == [3]  # the defaults: one checkpoint, after the last step (a 3-step run is short)
    assert _launch(str(tiny_config_file), *out, "--set", "trainer.total_steps=2") == 0
    assert _steps(run_dir) == [2]  # the first run had finished: its checkpoint is replaced, not mixed in
    assert _ledger_steps(run_dir) == [1, 2]

def test_a_checkpoint_that_fails_on_a_full_disk_ends_with_the_last_good_one_and_the_resume_trains_each_step_once(
        tiny_config_file, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    from asyncrl.checkpoints import store as checkpoint

    run_dir = tmp_path / "full"
    sets = ["--set", f'run.output_dir="{run_dir}"', "--set", "trainer.total_steps=6", "--set", "run.save_every=2"]
    real_save_file, real_rmtree = safetensors.torch.save_file, shutil.rmtree
    disk_full = {"on": True}

    def save_file(tensors, filename, *args, **kwargs):
        if disk_full["on"] and ".tmp-step_00000004" in str(filename):  # the second checkpoint
            Path(filename).write_bytes(b"\0" * 100)  # what fit before the disk filled up
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real_save_file(tensors, filename, *args, **kwargs)

    def rmtree(path, *args, **kwargs):  # the failed save's partial folder stays, as after a crash
        if disk_full["on"] and ".tmp-step_" in str(path):
            return None
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    capsys.readouterr()
    assert _launch(str(tiny_config_file), *sets) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("run failed: OSError: [Errno 28] No space left on device"), err
    last = err[-1]
    assert last.startswith(f"writing checkpoint step 4 into {run_dir / 'checkpoints'} failed (OSError: [Errno 28]")
    assert f"the last good checkpoint is {run_dir / 'checkpoints' / 'step_00000002'} (step 2)" in last
    assert last.endswith(f"resume with: asyncrl launch --resume {run_dir}")
    assert len(list((run_dir / "checkpoints").glob(".tmp-step_00000004-*/*"))) >= 1  # the partial folder
    assert _steps(run_dir) == [2]  # ... is no step_<N>: --resume skips it
    assert checkpoint.latest_valid(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_00000002"

    # a fresh run there is refused: the checkpoints are those of a run that did not finish, for its --resume
    assert _launch(str(tiny_config_file), *sets, "--set", "trainer.total_steps=9") == 1
    refused = capsys.readouterr().err
    assert f"holds the checkpoints of an earlier run that stopped at step 2 of 6: continue it with asyncrl launch " \
           f"--resume {run_dir}" in refused
    assert "total_steps = 6" in (run_dir / "config.toml").read_text()  # the run's own config, for its --resume

    disk_full["on"] = False  # space freed
    assert _launch("--resume", str(run_dir)) == 0
    assert _ledger_steps(run_dir) == [1, 2, 3, 4, 5, 6]  # steps 3 and 4 trained again once, none twice
    groups = [tuple(g) for line in (run_dir / "ledger.jsonl").read_text().splitlines()
              for g in json.loads(line)["groups"]]
    assert len(groups) == len(set(groups)) == 6 * 4
    assert _steps(run_dir) == [4, 6]  # run.keep_last = 2
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the leftover was removed by the next save
