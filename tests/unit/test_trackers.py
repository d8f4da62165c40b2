"""Experiment trackers: the [logging.wandb] / [logging.mlflow] / [logging.trackio] settings, each tracker's
run read back from its own offline store, and a failing tracker that never ends the run."""

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, config_from_dict, config_to_toml, load_config
from asyncrl.telemetry.loggers import (
    FAILED,
    STOPPED,
    TRACKER_ERRORS,
    Contained,
    JsonlSink,
    build_sinks,
    close_sinks,
    log_row,
)
from asyncrl.telemetry.trackers import flat_params, mlflow_key

ROOT = Path(__file__).resolve().parents[2]


def cfg(tmp_path, **logging):
    return config_from_dict({"model": {"path": str(tmp_path / "m"), "build_tiny": {}},
                             "data": {"source": "asyncrl.tasks.digits:first_digit"},
                             "trainer": {"total_steps": 7}, "logging": {"live": False, **logging}})


def errors_of(tmp_path, **logging):
    with pytest.raises(ConfigError) as info:
        cfg(tmp_path, **logging)
    return info.value.errors


def feed(sinks, steps=(1, 2, 3)):
    """Rows as the Controller writes them (step, reward, a text value and a flag the trackers skip), then
    eval samples at the last step."""
    for step in steps:
        log_row(sinks, {"step": step, "reward/mean": 0.25 * step, "time/elapsed_s": 2.0 * step,
                        "note": "text", "flag": True})
    for sink in sinks:
        sink.log_samples(steps[-1], [{"split": "eval", "prompt": "1+1", "completion": "2", "reward": 1.0}])


# -- settings ---------------------------------------------------------------------------------------------


def test_the_older_wandb_switch_and_project_still_load_into_the_wandb_table(tmp_path):
    assert cfg(tmp_path, wandb=True, wandb_project="p").logging.wandb.project == "p"
    old = cfg(tmp_path, wandb=False, wandb_project="asyncrl").logging  # every config.toml written before
    assert old.wandb is None and old.wandb_project is None
    assert cfg(tmp_path, wandb=True).logging.wandb.project == "asyncrl"


def test_a_tracker_table_turns_it_on_and_survives_the_resolved_config(tmp_path):
    c = cfg(tmp_path, wandb={"project": "q", "entity": "team", "group": "g", "tags": ["a", "b"], "notes": "n",
                             "mode": "online"},
            mlflow={"tracking_uri": "http://mlflow:5000", "experiment": "e", "tags": {"k": "v"}},
            trackio=True)
    assert (c.logging.wandb.mode, c.logging.wandb.tags, c.logging.mlflow.tags) == ("online", ["a", "b"], {"k": "v"})
    assert c.logging.trackio.project == "asyncrl"
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(c))
    again = load_config(path, cross_checks=False)
    assert again.logging == c.logging
    off = load_config(path, ["logging.wandb=false", "logging.mlflow.experiment=x"], cross_checks=False).logging
    assert off.wandb is None and off.mlflow.experiment == "x"


def test_tracker_settings_are_checked_key_by_key(tmp_path):
    assert errors_of(tmp_path, wandb="yes")[0].startswith(
        "logging.wandb: expected true, false or a table [logging.wandb], got 'yes'")
    assert errors_of(tmp_path, wandb={"mode": "onlin"})[0].startswith(
        "logging.wandb.mode: expected one of 'online', 'offline', 'disabled', got 'onlin'")
    assert errors_of(tmp_path, mlflow={"experimnt": "x"}) == [
        "logging.mlflow.experimnt: unknown key — did you mean 'experiment'?"]
    assert errors_of(tmp_path, wandb={"project": "a"}, wandb_project="b") == [
        "logging.wandb_project: 'b' contradicts [logging.wandb] project = 'a' — keep one: project inside "
        "[logging.wandb]"]


def test_a_tracker_without_its_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    assert errors_of(tmp_path, mlflow=True, trackio=True) == [
        "logging.mlflow: needs the mlflow package, which is not installed — pip install 'asyncrl[mlflow]', "
        "or remove logging.mlflow"]


# -- W&B ------------------------------------------------------------------------------------------------


class FakeWandb(types.ModuleType):
    """Records wandb.init's arguments: the settings mapping, without wandb's service process."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.exit_codes = [], [], []
        self.Table = lambda columns, data: ("table", columns, data)

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((step, values)),
                                     finish=lambda exit_code: self.exit_codes.append(exit_code))


def test_wandb_settings_reach_wandb_init_and_online_needs_no_environment_variable(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "my-run"
    c = cfg(tmp_path, wandb={"project": "q", "entity": "team", "group": "g", "tags": ["a"], "notes": "n",
                             "mode": "online"})
    sinks = build_sinks(c, run_dir)
    feed(sinks, steps=(1, 2))
    close_sinks(sinks, FAILED)
    (init,) = fake.inits
    assert init["mode"] == "online"  # the config's mode, not WANDB_MODE
    assert {k: init[k] for k in ("project", "entity", "name", "group", "tags", "notes", "dir")} == {
        "project": "q", "entity": "team", "name": "my-run", "group": "g", "tags": ["a"], "notes": "n",
        "dir": str(run_dir)}
    assert init["config"]["trainer"]["lr"] == c.trainer.lr and init["config"]["logging"]["wandb"]["project"] == "q"
    assert fake.logged == [(1, {"reward/mean": 0.25, "time/elapsed_s": 2.0, TRACKER_ERRORS: 0}),
                           (2, {"reward/mean": 0.5, "time/elapsed_s": 4.0, TRACKER_ERRORS: 0}),
                           (2, {"samples/eval": ("table", ["step", "prompt", "completion", "reward", "finish_reason"],
                                                 [[2, "1+1", "2", 1.0, ""]])})]
    assert sinks[1].errors == 0
    assert fake.exit_codes == [1]  # a failed run shows as failed


def test_wandb_mode_unset_follows_wandb_mode_else_offline(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    close_sinks(build_sinks(cfg(tmp_path, wandb=True), tmp_path))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    close_sinks(build_sinks(cfg(tmp_path, wandb=True), tmp_path))
    assert [i["mode"] for i in fake.inits] == ["offline", "disabled"]
    assert fake.exit_codes == [0, 0]


def wandb_records(path):
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header (":W&B", magic, version), then
    LevelDB-log chunks in 32 KiB blocks (checksum 4, length 2, type 1: full/first/middle/last), each record
    a serialized wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def finished_records(path, polls=300):
    """The run file's records once its exit record is on disk: wandb's service process writes the file
    behind finish(), so a busy machine may show a partial file for a moment."""
    for _ in range(polls):
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        time.sleep(0.1)
    raise AssertionError(f"no exit record in {path} ({path.stat().st_size} bytes)")


@pytest.mark.slow  # wandb starts its own service process: a few seconds
def test_wandb_offline_run_holds_the_settings_config_and_every_row(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "online")  # the config's mode wins: nothing here may reach the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = build_sinks(cfg(tmp_path, wandb={"project": "p", "group": "g", "tags": ["a", "b"], "notes": "hello",
                                             "mode": "offline"}), tmp_path / "run1")
    feed(sinks)
    close_sinks(sinks)
    (run_dir,) = (tmp_path / "run1" / "wandb").glob("offline-run-*")
    (data,) = run_dir.glob("*.wandb")
    records = finished_records(data)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, run.run_group, list(run.tags), run.notes) == (
        "p", "run1", "g", ["a", "b"], "hello")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["trainer"]["total_steps"] == 7 and config["logging"]["wandb"]["notes"] == "hello"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["reward/mean"], h["time/elapsed_s"]) for h in history] == [
        (1, 0.25, 2.0), (2, 0.5, 4.0), (3, 0.75, 6.0)]
    assert "note" not in history[0] and history[-1]["samples/eval/nrows"] == 1  # the samples as a table
    assert list(run_dir.glob("files/media/table/samples/eval_3_*.table.json"))


# -- MLflow ---------------------------------------------------------------------------------------------


def test_mlflow_names_and_params_are_ones_mlflow_accepts():
    assert mlflow_key("reward/my fn:v2") == "reward/my fn:v2" and mlflow_key("reward/a<b>[0]") == "reward/a_b__0_"
    params = flat_params({"trainer": {"lr": 1e-5, "betas": [0.9, 0.99]}, "env": {"kwargs": {}}, "x": "s" * 7000})
    assert params == {"trainer.lr": "1e-05", "trainer.betas": "[0.9, 0.99]", "env.kwargs": "{}", "x": "s" * 6000}


@pytest.mark.slow  # importing mlflow and writing its store: a few seconds
def test_mlflow_run_in_a_local_store_holds_params_metric_history_samples_and_status(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "run-m"
    sinks = build_sinks(cfg(tmp_path, mlflow={"experiment": "exp", "tags": {"team": "rl"}}), run_dir)
    feed(sinks)
    sink = sinks[1].sink
    assert sink.tracking_uri == (run_dir / "mlruns").resolve().as_uri()  # the default: inside the run dir
    close_sinks(sinks, STOPPED)
    client = MlflowClient(tracking_uri=sink.tracking_uri)
    run = client.get_run(sink.run_id)
    assert (run.info.run_name, run.info.status, run.data.tags["team"]) == ("run-m", "KILLED", "rl")
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params["trainer.total_steps"] == "7" and run.data.params["logging.mlflow.experiment"] == "exp"
    history = client.get_metric_history(sink.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "note" not in run.data.metrics and "flag" not in run.data.metrics
    (artifact,) = [a.path for a in client.list_artifacts(sink.run_id, "samples/eval")]
    assert artifact == "samples/eval/step_000003.jsonl"
    text = Path(client.download_artifacts(sink.run_id, artifact, str(tmp_path))).read_text()
    assert json.loads(text) == {"step": 3, "split": "eval", "prompt": "1+1", "completion": "2", "reward": 1.0}


# -- trackio --------------------------------------------------------------------------------------------

TRACKIO_SCRIPT = """
import json, sys
from asyncrl.config import config_from_dict
from asyncrl.telemetry.loggers import build_sinks, close_sinks, log_row
from trackio.sqlite_storage import SQLiteStorage
tmp = sys.argv[1]
cfg = config_from_dict({"model": {"path": tmp + "/m", "build_tiny": {}},
                        "data": {"source": "asyncrl.tasks.digits:first_digit"},
                        "trainer": {"total_steps": 7},
                        "logging": {"live": False, "trackio": {"project": "tp", "group": "g"}}})
sinks = build_sinks(cfg, tmp + "/run-t")
for step in (1, 2, 3):
    log_row(sinks, {"step": step, "reward/mean": 0.25 * step, "note": "text"})
for s in sinks:
    s.log_samples(3, [{"split": "eval", "prompt": "1+1", "completion": "2", "reward": 1.0}])
close_sinks(sinks)
print(json.dumps({"runs": SQLiteStorage.get_runs("tp"), "logs": SQLiteStorage.get_logs("tp", "run-t"),
                  "config": SQLiteStorage.get_run_config("tp", "run-t")}, default=str))
"""


@pytest.mark.slow  # a Python process of its own importing asyncrl and trackio: a few seconds
def test_trackio_run_in_its_local_database_holds_the_config_and_every_row(tmp_path):
    pytest.importorskip("trackio")
    # trackio fixes its folder (TRACKIO_DIR) when imported: a process of its own keeps it inside tmp_path
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["runs"] == ["run-t"]
    rows = got["logs"]
    assert [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert not any("note" in r for r in rows)
    assert any("samples/eval" in r for r in rows if r["step"] == 3)
    assert got["config"]["trainer"]["total_steps"] == 7 and got["config"]["logging"]["trackio"]["group"] == "g"
    assert (tmp_path / "trackio" / "tp.db").is_file()


# -- failures -------------------------------------------------------------------------------------------


class Flaky:
    """A tracker whose log fails at steps 2 and 3, whose samples and close always fail."""

    def __init__(self):
        self.logged = []

    def log(self, row):
        if row["step"] in (2, 3):
            raise ConnectionError("tracker server gone")
        self.logged.append(row["step"])

    def log_samples(self, step, samples):
        raise ConnectionError("tracker server gone")

    def close(self, outcome="finished"):
        raise ConnectionError("tracker server gone")


def test_a_failing_tracker_is_counted_once_warned_and_never_ends_the_run(tmp_path, caplog):
    flaky = Flaky()
    sinks = [JsonlSink(tmp_path / "metrics.jsonl"), Contained("flaky", flaky)]
    with caplog.at_level("WARNING", logger="asyncrl.telemetry.loggers"):
        feed(sinks, steps=(1, 2, 3, 4))
        close_sinks(sinks)  # its close fails too: not raised
    assert flaky.logged == [1, 4] and sinks[1].errors == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r[TRACKER_ERRORS] for r in rows] == [0, 0, 1, 2]  # the failures before each row
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 2, failed  # the first failure (with its traceback) and the count at the end
    assert "logging.flaky: log failed" in failed[0] and "logging.flaky: 4 call(s) failed" in failed[1]
    assert caplog.records[0].exc_info is not None


class Outcome:
    """A sink that records how the Controller closed it."""

    def __init__(self):
        self.outcomes = []

    def log(self, row):
        pass

    def log_samples(self, step, samples):
        pass

    def close(self, outcome="finished"):
        self.outcomes.append(outcome)


class Buffer:
    async def close(self):
        pass


@pytest.mark.parametrize("error, outcome", [("failed", "failed"), ("stopped", "stopped")])
def test_the_controller_tells_the_trackers_a_run_failed_or_was_stopped(tmp_path, monkeypatch, error, outcome):
    import asyncio

    from asyncrl.control.controller import Controller, RunStopped
    from asyncrl.telemetry import loggers

    sink = Outcome()
    monkeypatch.setitem(loggers.OPTIONAL_SINKS, "outcome", (lambda c: True, lambda c, d: sink))

    async def setup_weight_sync():  # the first thing a run does after opening its sinks
        raise (RuntimeError("weight group failed") if error == "failed" else RunStopped("stopped by SIGTERM"))

    async def shutdown():
        pass

    d = types.SimpleNamespace(generators=[], scorers=[], trainer=None, buffer=Buffer(), restartable=(),
                              setup_weight_sync=setup_weight_sync, shutdown=shutdown)
    controller = Controller(cfg(tmp_path), d, run_dir=tmp_path / "run")
    with pytest.raises((RuntimeError, RunStopped)):
        asyncio.run(controller.run())
    assert sink.outcomes == [outcome]
