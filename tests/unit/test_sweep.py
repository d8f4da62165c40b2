"""Sweep grid parsing, the results table (failed points included) and the sweep plots, without runs."""

import csv

import pytest

from asyncrl.sweep import SweepPoint, grid, parse_axes, plot_sweep, write_tables
from asyncrl.telemetry.metrics import MetricsWriter


def test_axes_split_on_commas_outside_brackets_and_quotes():
    axes = parse_axes(["staleness.max_staleness=0,1, 2", 'rollout.stop=["a,b"],[]', "run.seed=7"])
    assert axes == [("staleness.max_staleness", ["0", "1", "2"]), ("rollout.stop", ['["a,b"]', "[]"]),
                    ("run.seed", ["7"])]


@pytest.mark.parametrize("bad", ["max_staleness=0,1", "staleness.max_staleness=", "staleness.max_staleness=0,,1"])
def test_malformed_axis_is_one_clear_error(bad):
    with pytest.raises(ValueError):
        parse_axes([bad])


def test_repeated_axis_is_rejected():
    with pytest.raises(ValueError, match="twice"):
        parse_axes(["run.seed=1", "run.seed=2"])


def test_grid_is_the_cartesian_product_first_axis_slowest():
    points = grid(parse_axes(["staleness.max_staleness=0,1", "rollout.num_generators=1,2"]))
    assert [p.name for p in points] == ["max_staleness=0,num_generators=1", "max_staleness=0,num_generators=2",
                                        "max_staleness=1,num_generators=1", "max_staleness=1,num_generators=2"]
    assert points[1].overrides == ["staleness.max_staleness=0", "rollout.num_generators=2"]


def fake_points(tmp_path):
    points = grid(parse_axes(["staleness.max_staleness=0,1,2", "rollout.num_generators=1"]))
    for k, p in enumerate(points):
        if k == 2:
            p.status, p.error = "failed", "run failed: RuntimeError: boom"
            continue
        p.status = "ok"
        p.summary = {"throughput/samples_per_s": 10.0 + k, "staleness_mean": 0.5 * k, "reward_final": 0.4,
                     "trainer/busy_share": 0.7}
        with MetricsWriter(tmp_path / p.name / "metrics.jsonl") as w:
            for step in range(1, 4):
                w.write({"step": step, "time/elapsed_s": float(step), "reward/mean": 0.1 * step})
    return points


def test_table_lists_every_point_and_the_failure(tmp_path):
    points = fake_points(tmp_path)
    write_tables(points, ["staleness.max_staleness", "rollout.num_generators"], tmp_path)
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert rows[1]["throughput/samples_per_s"] == "11.0" and rows[2]["error"].endswith("boom")
    md = (tmp_path / "results.md").read_text().splitlines()
    assert md[0].startswith("| max_staleness | num_generators | status | samples/s")
    assert "| 1 | 1 | ok | 11.00 |" in md[3] and "failed: run failed" in md[4]


def test_sweep_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    points = fake_points(tmp_path)
    paths = plot_sweep(points, ["staleness.max_staleness", "rollout.num_generators"], tmp_path)
    assert [p.name for p in paths] == ["throughput_vs_staleness.png", "reward_vs_time.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_point_round_trips_as_json():
    import msgspec

    p = SweepPoint(name="a", overrides=["run.seed=1"], values={"run.seed": "1"}, status="ok", summary={"x": 1.0})
    assert msgspec.json.decode(msgspec.json.encode([p]), type=list[SweepPoint]) == [p]


def test_cli_sweep_rejects_a_malformed_axis_before_running_anything(tmp_path, capsys):
    from asyncrl.cli import main

    assert main(["sweep", "examples/first_digit/config.toml", "--set", "max_staleness=0,1",
                 "--out", str(tmp_path / "s")]) == 2
    assert "sweep error: --set max_staleness=0,1: expected section.key=v1,v2" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_cli_sweep_rejects_an_unknown_key_through_the_config_loader(tmp_path, capsys):
    from asyncrl.cli import main

    assert main(["sweep", "examples/first_digit/config.toml", "--set", "staleness.max_stale=0,1",
                 "--out", str(tmp_path / "s")]) == 2
    assert "config error: staleness.max_stale" in capsys.readouterr().err
