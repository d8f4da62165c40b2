"""Observability end to end on the tiny model, in-process: a run leaves a Perfetto trace with every role's
spans and the per-step overlap metrics; report and plan read that run directory; a sweep runs its grid
and records a failing point without stopping."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from asyncrl.telemetry.metrics import read_metrics
from asyncrl.telemetry.trace import read_trace
from tests.conftest import documented_metric_keys

pytestmark = pytest.mark.slow  # whole runs, a sweep and the overlap benchmark


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    from asyncrl.config import load_config
    from asyncrl.deploy.local import run_local
    from tests.conftest import TINY_TOML

    root = tmp_path_factory.mktemp("obs")
    path = root / "config.toml"
    path.write_text(TINY_TOML.format(model_dir=tiny_model_dir, run_dir=root / "run"))
    # an MLflow run beside metrics.jsonl (its default store, <run_dir>/mlruns) where mlflow is installed
    tracker = ['logging.mlflow.experiment="obs"'] if importlib.util.find_spec("mlflow") else []
    cfg = load_config(path, ["trainer.total_steps=4", "run.save_checkpoint=false", "logging.live=false",
                             "logging.rollouts_every=2", *tracker])
    run_local(cfg)
    return root / "run"


def test_run_writes_a_trace_with_every_role_and_span_kind(run_dir):
    events = read_trace(run_dir / "trace.json")
    json.loads((run_dir / "trace.json").read_text())  # closed: plain JSON
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"generator/0", "scorer/0", "trainer"} <= threads
    kinds = {e["name"] for e in events if e["ph"] == "X"}
    assert {"generate", "score", "train", "weights_send", "weights_recv", "weights_swap", "wait_gate",
            "wait_queue", "eval"} <= kinds
    versions = {e["args"]["version"] for e in events if e["ph"] == "X" and e["name"] == "train"}
    assert versions == {0, 1, 2, 3}
    # every evaluation's span (versions 0, 2, 4 with eval_every = 2), the last one included: an evaluation ends
    # after the trainer's window report that came with the send, so the Controller asks the trainer again
    evaluated = {e["args"]["version"] for e in events if e["ph"] == "X" and e["name"] == "eval"}
    assert evaluated == {0, 2, 4}
    assert any(e["ph"] == "C" and e["name"] == "buffer/rollout_depth" for e in events)


def test_run_writes_rollouts_of_every_second_step_and_each_evaluation(run_dir):
    lines = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["split"] == "train"]
    assert sorted({r["step"] for r in train}) == [2, 4]
    assert all(r["completion_tokens"] >= 1 and isinstance(r["completion"], str) and r["prompt"] for r in train)
    evals = [r for r in lines if r["split"] == "eval"]
    assert {r["mode"] for r in evals} == {"greedy", "sampled"} and 0 in {r["step"] for r in evals}
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/greedy_reward" in r}
    for step, row in rows.items():  # the eval samples' rewards are the ones the eval metrics average
        greedy = [r["reward"] for r in evals if r["step"] == step and r["mode"] == "greedy"]
        assert sum(greedy) / len(greedy) == pytest.approx(row["eval/greedy_reward"])
    assert not any(key in row for row in read_metrics(run_dir / "metrics.jsonl")
                   for key in ("rollouts/samples", "eval/samples"))  # taken out of the rows


def test_run_reaches_its_tracker_row_by_row_and_closes_it_finished(run_dir):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("obs").experiment_id])
    assert (run.info.run_name, run.info.status) == ("run", "FINISHED")
    assert run.data.params["trainer.total_steps"] == "4"
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r}
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert {m.step: m.value for m in history} == pytest.approx({s: r["reward/mean"] for s, r in rows.items()})
    assert all(r["logging/tracker_errors"] == 0 for r in rows.values())
    samples = [a.path for a in client.list_artifacts(run.info.run_id, "samples/train")]
    assert samples == ["samples/train/step_000002.jsonl", "samples/train/step_000004.jsonl"]  # rollouts_every


def test_run_metrics_answer_the_overlap_question(run_dir):
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    last = rows[-1]
    for key in ("time/step_s", "throughput/samples_per_s", "overlap_ratio", "trainer/busy_share",
                "generator/busy_share", "scorer/busy_share", "scorer/samples_per_s", "generation/tokens_per_s",
                "trainer/tokens_per_s", "generation/stall_share", "staleness/token_mean", "staleness/token_hist/0",
                "sync/seconds", "sync/gbps", "buffer/rollout_depth"):
        assert key in last, key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["setting"]["max_staleness"] == 1
    assert 0.0 <= summary["overlap_ratio"] <= 1.0 and summary["throughput/samples_per_s"] > 0
    assert 0.0 < summary["startup_s"] < 60.0  # from run_local's call to the generators' first requests
    assert sum(summary["staleness_hist"].values()) == 4 * 4 * 4  # steps x prompts x group size


def test_run_writes_every_key_docs_metrics_md_documents_for_every_run(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if "reward/mean" in r]
    evals = {"eval/greedy_reward", "eval/sampled_reward"}  # on evaluation steps only
    for key in sorted(documented_metric_keys("Metrics") - evals):
        assert all(key in r for r in train), key
    assert evals <= set(train[-1])  # total_steps = 4, eval_every = 2: the last step evaluates
    # the Environments table's Runtime.submit counts are written in every row (0 here)
    assert all(r["buffer/submitted_groups"] == r["buffer/submitted_dropped_stale"] == 0 for r in train)
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in sorted(documented_metric_keys("`summary.json`") - {"time_to_target_s"}):  # report/sweep only
        assert key in summary, key


def test_run_row_totals_are_the_sums_of_the_step_windows(run_dir):
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert sum(r["generation/stall_s"] for r in train) == pytest.approx(train[-1]["generation/stall_s_total"])
    consumed = [r["buffer/consumed"] for r in train]
    assert consumed == sorted(consumed) and consumed[-1] == 4 * 4  # steps x prompts per step
    for r in train:  # every row, as its own snapshot: no admitted group unaccounted for
        stored = r["buffer/accepted"] - r["buffer/consumed"]
        assert r["buffer/admitted"] == (r["buffer/consumed"] + r["buffer/failed"] + r["buffer/filtered"]
                                        + r["buffer/running"] + stored) and stored == r["buffer/train_depth"]


def test_report_and_plan_read_the_run(run_dir, capsys):
    pytest.importorskip("matplotlib")
    from asyncrl.cli import main

    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.md").is_file() and (run_dir / "utilisation.png").is_file()
    assert main(["plan", str(run_dir), "--generators", "1,2", "--max-staleness", "0,1"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| ") == 5  # header + 4 settings
    assert "recommended: rollout.num_generators=" in out


def test_sweep_runs_the_grid_and_records_a_failed_point(tmp_path, tiny_config_file):
    pytest.importorskip("matplotlib")
    from asyncrl.sweep import parse_axes, run_sweep

    # max_new_tokens=0 is rejected by the config check: that point fails fast, the other one runs
    axes = parse_axes(["rollout.max_new_tokens=2,0"])
    points = run_sweep(tiny_config_file, axes, tmp_path / "sweep", timeout_s=240,
                       extra=["trainer.total_steps=2", "trainer.eval_every=0", "run.save_checkpoint=false"])
    assert [p.status for p in points] == ["ok", "failed"]
    assert "max_new_tokens" in points[1].error
    rows = list(csv.DictReader((tmp_path / "sweep" / "results.csv").open()))
    assert float(rows[0]["throughput/samples_per_s"]) > 0 and rows[1]["status"] == "failed"
    for name in ("results.md", "throughput_vs_staleness.png", "reward_vs_time.png", "sweep.json"):
        assert (tmp_path / "sweep" / name).is_file(), name


@pytest.mark.slow
def test_overlap_benchmark_quick_mode_ends_with_its_json_line(capsys, tmp_path):
    import importlib.util
    from pathlib import Path

    from asyncrl.config import load_config

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "overlap.py"
    spec = importlib.util.spec_from_file_location("overlap_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick", "--rounds", "2", "--set", "rollout.kv_on_update=keep", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| 1 | sync | 0 | 1 |" in out and "| 2 | async | 2 | 1 |" in out and "| sync-2t | 0 | 2 |" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last == result and last["benchmark"] == "overlap" and last["target"] == 0.95
    assert last["ratio"] == pytest.approx(last["value"] / last["baseline"], rel=1e-3)
    # ABBA: sync first in round 1, async first in round 2 (each run writes its config just before it starts)
    started = {name: (tmp_path / f"{name}.toml").stat().st_mtime_ns
               for name in ("sync-1", "async-1", "sync-2", "async-2", "sync-2t")}
    assert started["sync-1"] < started["async-1"] < started["async-2"] < started["sync-2"] < started["sync-2t"]
    # every run gets the --set override and the benchmark's weight_update; each run its own staleness
    for name, k in (("sync-1", 0), ("async-2", 2), ("sync-2t", 0)):
        run_cfg = load_config(tmp_path / name / "config.toml")
        assert run_cfg.rollout.kv_on_update == "keep" and run_cfg.rollout.weight_update == "between_requests"
        assert run_cfg.staleness.max_staleness == k


@pytest.mark.slow
def test_soak_benchmark_prints_every_roles_slope_and_ends_with_its_json_line(capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--local", "--steps", "12"])
    out = capsys.readouterr().out
    assert all(f"  {key}" in out for key in module.KEYS)  # each role's series, with its slope
    last = json.loads(out.strip().splitlines()[-1])
    assert last == result and last["benchmark"] == "soak" and last["target"] == 1.0
