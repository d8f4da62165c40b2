"""Why a run died: the cause chain printed by `asyncrl launch` (root cause first, Ray's wrappers folded) and
RUN_DIR/run.log with the tracebacks (asyncrl/telemetry/runlog.py)."""

from __future__ import annotations

import logging

import pytest

from asyncrl.telemetry.runlog import RunLog, cause_chain


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as e:  # noqa: BLE001 - building a chain
        return e


def test_the_root_cause_comes_first_then_each_wrapper():
    root = _raised(ValueError("row 7 has no field 'answer'"))
    mid = _raised(RuntimeError("scorer/0 failed"), root)
    top = _raised(RuntimeError("the run stopped"), mid)
    assert cause_chain(top) == ["ValueError: row 7 has no field 'answer'", "RuntimeError: scorer/0 failed",
                                "RuntimeError: the run stopped"]


def test_a_ray_task_error_is_folded_into_the_user_exception_it_carries():
    exceptions = pytest.importorskip("ray.exceptions")
    user = _raised(KeyError("answer"))
    remote = exceptions.RayTaskError("RoleActor.run", "Traceback (most recent call last):\n  File ...\nKeyError",
                                     user).as_instanceof_cause()
    top = _raised(RuntimeError("scorer/0 stopped unexpectedly"), remote)
    lines = cause_chain(top)
    assert lines == ["KeyError: 'answer'", "RuntimeError: scorer/0 stopped unexpectedly"]
    assert not any("ray::" in line or "Traceback" in line for line in lines)


def test_implicit_context_counts_but_a_suppressed_one_does_not():
    try:
        try:
            raise OSError("disk full")
        except OSError:
            raise RuntimeError("checkpoint failed")  # noqa: B904 - the implicit context under test
    except RuntimeError as e:
        implicit = e
    assert cause_chain(implicit) == ["OSError: disk full", "RuntimeError: checkpoint failed"]
    assert cause_chain(_raised(RuntimeError("plain"), None)) == ["RuntimeError: plain"]


def test_run_log_keeps_the_driver_lines_and_the_failure_traceback(tmp_path, caplog):
    caplog.set_level(logging.INFO)  # the root logger's level, as `asyncrl launch --log-level INFO` sets it
    run_log = RunLog(tmp_path / "run", level=logging.INFO)
    try:
        logging.getLogger("asyncrl.test").info("step 1/3 | reward 0.5")
        logging.getLogger("asyncrl.test").debug("below the level")
        run_log.exception(_raised(RuntimeError("boom"), _raised(ValueError("root"))))
    finally:
        run_log.close()
    text = (tmp_path / "run" / "run.log").read_text()
    assert "step 1/3 | reward 0.5" in text and "below the level" not in text
    assert "ValueError: root" in text and "RuntimeError: boom" in text and "Traceback" in text
    assert run_log.handler not in logging.getLogger().handlers


def test_launch_prints_the_root_cause_first_and_writes_run_log(tiny_config_file, tmp_path, monkeypatch, capsys):
    import asyncrl.deploy.local
    from asyncrl.cli import main

    def fail(cfg, **_):
        try:
            raise ValueError("data.source: my_rows() raised: bad file")
        except ValueError as exc:
            raise RuntimeError("the generator could not start") from exc

    monkeypatch.setattr(asyncrl.deploy.local, "run_local", fail)
    run_dir = tmp_path / "failed"
    code = main(["launch", str(tiny_config_file), "--local", "--set", f'run.output_dir="{run_dir}"'])
    err = capsys.readouterr().err.splitlines()
    assert code == 1
    assert err[0] == "run failed: ValueError: data.source: my_rows() raised: bad file"
    assert err[1] == "  raised as: RuntimeError: the generator could not start"
    assert str(run_dir / "run.log") in err[2]
    assert "Traceback" in (run_dir / "run.log").read_text()
