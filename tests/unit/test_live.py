"""Live console view and metric sinks: on/off rule, what the view shows, TensorBoard and W&B offline."""

import io
import json

import pytest
from rich.console import Console

from asyncrl.config import config_from_dict
from asyncrl.telemetry.live import LiveView, eta_seconds, format_duration
from asyncrl.telemetry.loggers import JsonlSink, build_sinks, close_sinks, live_enabled


class FakeStream:
    def __init__(self, tty):
        self.tty = tty

    def isatty(self):
        return self.tty


def test_live_auto_follows_the_terminal_and_explicit_settings_win():
    assert live_enabled("auto", FakeStream(True)) and not live_enabled("auto", FakeStream(False))
    assert live_enabled(True, FakeStream(False)) and not live_enabled(False, FakeStream(True))


def test_eta_at_the_mean_pace_so_far():
    assert eta_seconds(0, 10, 5.0) is None
    assert eta_seconds(4, 10, 8.0) == pytest.approx(12.0)
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05" and format_duration(None) == "-"


def test_live_view_shows_progress_reward_staleness_busy_and_eta():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    clock = iter([0.0, 10.0, 10.0, 10.0]).__next__
    view = LiveView(total_steps=20, run_name="demo", console=console, clock=clock)
    view.log({"step": 5, "reward/mean": 0.4567, "staleness/mean": 0.75, "staleness/max": 1,
              "generator/busy_share": 0.9, "trainer/busy_share": 0.5, "overlap_ratio": 0.4})
    view.close()
    out = buf.getvalue()
    for text in ("demo", "5/20", "0.457", "0.75", "generator 90%", "trainer 50%", "overlap", "40%", "0:30"):
        assert text in out, text


def cfg(tmp_path, **logging):
    return config_from_dict({"model": {"path": str(tmp_path / "m"), "build_tiny": {}},
                             "data": {"source": "asyncrl.tasks.digits:first_digit"},
                             "logging": {"live": False, **logging}})


def test_default_sinks_are_jsonl_only(tmp_path):
    sinks = build_sinks(cfg(tmp_path), tmp_path)
    assert [type(s) for s in sinks] == [JsonlSink]
    sinks[0].log({"step": 1, "reward/mean": 0.5})
    close_sinks(sinks)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 0.5}


def test_tensorboard_sink_writes_scalars_by_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(cfg(tmp_path, tensorboard=True), tmp_path)
    for step in (1, 2):
        for s in sinks:
            s.log({"step": step, "reward/mean": 0.25 * step, "note": "text is skipped", "flag": True})
    for s in sinks:
        s.log_samples(2, [{"split": "train", "prompt": "2|2", "completion": "4\n", "reward": 1.0}])
    close_sinks(sinks)
    assert "samples" not in (tmp_path / "metrics.jsonl").read_text()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward/mean"]
    assert acc.Tags()["tensors"] == ["samples/train/text_summary"]  # the step's samples as a markdown table
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]


@pytest.mark.slow  # wandb starts its own service process: a few seconds
def test_wandb_sink_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the sink's own default
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = build_sinks(cfg(tmp_path, wandb=True, wandb_project="p"), tmp_path)
    run = sinks[1].sink.run
    assert run.settings.mode == "offline" and run.project == "p"
    for step in (1, 2):
        for s in sinks:
            s.log({"step": step, "reward/mean": 0.5 * step})
        for s in sinks:
            s.log_samples(step, [{"split": "eval", "prompt": "p", "completion": "c", "reward": 1.0}])
    close_sinks(sinks)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run_dir.glob("files/media/table/samples/eval_*.table.json"))  # a W&B table per step
    (data,) = run_dir.glob("*.wandb")
    assert data.stat().st_size > 0
