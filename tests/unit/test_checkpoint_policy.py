"""asyncrl.checkpoints.policy: when a checkpoint is due (run.save_every, run.save_every_s, the last step) with an
injected clock (no real waiting), and the one line a failed run ends with when it has a checkpoint to resume."""

from __future__ import annotations

import errno
from pathlib import Path

import torch

from asyncrl.checkpoints import store as checkpoint
from asyncrl.checkpoints.policy import SaveSchedule, failed_while, failure_line, note_failure
from asyncrl.config.schema import RunConfig
from asyncrl.control.supervisor import death_message


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_checkpoints_are_on_by_default_every_30_minutes_and_after_the_last_step():
    run = RunConfig()
    assert (run.save_every, run.save_every_s, run.keep_last) == (0, 1800.0, 2)
    saves = SaveSchedule(every=run.save_every, every_s=run.save_every_s, total_steps=60)
    assert [v for v in range(1, 61) if saves.due(v)] == [60]


def test_the_step_interval_and_the_last_step_are_due_in_advance():
    saves = SaveSchedule(every=4, every_s=0, total_steps=10)
    assert [v for v in range(1, 11) if saves.due(v)] == [4, 8, 10]
    assert not saves.timed()


def test_with_both_intervals_off_no_checkpoint_is_due_not_even_the_last():
    saves = SaveSchedule(every=0, every_s=0, total_steps=10, clock=Clock())
    assert not saves.on and not any(saves.due(v) for v in range(1, 11)) and not saves.timed()


def test_the_time_interval_counts_from_the_start_latches_once_passed_and_restarts_at_each_checkpoint():
    clock = Clock()
    saves = SaveSchedule(every=0, every_s=1800, total_steps=1000, clock=clock)
    clock.now += 5000  # time before the run starts (model loading) does not count
    saves.start()
    clock.now += 1799.9
    assert not saves.timed()
    clock.now += 0.1
    assert saves.timed()
    clock.now -= 10_000  # the answer no longer depends on the clock: every later question gets the same one
    assert saves.timed() and saves.timed()
    saves.saved()
    assert not saves.timed()
    clock.now += 1799
    assert not saves.timed()
    clock.now += 1
    assert saves.timed()
    assert not any(saves.due(v) for v in range(1, 1000)) and saves.due(1000)  # the time interval only adds


def test_a_run_that_died_without_a_checkpoint_says_which_interval_writes_the_first(tmp_path):
    exc = RuntimeError("killed")
    default = death_message("trainer", exc, tmp_path, 0, 1800.0)
    assert "no checkpoint exists" in default and "run.save_every_s = 1800" in default
    assert "1800 s into the run" in default
    both = death_message("trainer", exc, tmp_path, 5, 600.0)
    assert "at step 5 or 600 s into the run" in both
    off = death_message("buffer", exc, tmp_path, 0, 0.0)
    assert "checkpoints are off" in off and "\n" not in off


def _save(root: Path, step: int) -> Path:
    return checkpoint.save(root, step=step, version=step, config_text="x", tensors={"model": {"w": torch.ones(2)}},
                           state={"step": step})


def test_a_failed_run_with_a_checkpoint_ends_with_what_failed_the_last_good_checkpoint_and_the_resume_command(
        tmp_path):
    run_dir = tmp_path / "run"
    good = _save(run_dir / "checkpoints", 5)
    (run_dir / "checkpoints" / ".tmp-step_00000010-abc").mkdir()  # the failed save's partial folder: not valid
    exc = RuntimeError("the trainer's save failed")
    exc.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    note_failure(exc, f"writing checkpoint step 10 into {run_dir / 'checkpoints'}")
    note_failure(exc, "training step 11")  # the first note stays: where the failure began
    line = failure_line(run_dir, exc, resumed=False)
    assert failed_while(exc).startswith("writing checkpoint step 10")
    assert line is not None and "\n" not in line
    assert line.startswith(f"writing checkpoint step 10 into {run_dir / 'checkpoints'} failed (")
    assert "No space left on device" in line
    assert f"the last good checkpoint is {good} (step 5)" in line
    assert line.endswith(f"resume with: asyncrl launch --resume {run_dir}")


def test_no_line_without_a_checkpoint_nor_for_a_fresh_run_that_failed_before_it_began(tmp_path):
    run_dir = tmp_path / "run"
    exc = ValueError("bad reward module")
    assert failure_line(run_dir, exc, resumed=False) is None  # nothing there
    _save(run_dir / "checkpoints", 3)  # an earlier run's
    assert failure_line(run_dir, exc, resumed=False) is None  # this run never began: not its checkpoint
    assert "asyncrl launch --resume" in failure_line(run_dir, exc, resumed=True)  # a resume's own checkpoint
    note_failure(exc, "training step 4")
    assert failure_line(run_dir, exc, resumed=False).startswith("training step 4 failed (ValueError: bad reward")
