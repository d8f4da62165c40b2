"""plot_run turns a run directory's metrics.jsonl into a reward-curve PNG; `asyncrl plot A B` overlays runs."""

import pytest

from asyncrl.telemetry.metrics import MetricsWriter
from asyncrl.telemetry.plot import plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def matplotlib_imported():
    """Pay matplotlib's one-off costs (import, font loading) once, outside the timed test bodies."""
    agg = pytest.importorskip("matplotlib.backends.backend_agg")
    from matplotlib.figure import Figure

    warm = Figure(figsize=(1, 1))
    warm.text(0.5, 0.5, "x")
    agg.FigureCanvasAgg(warm).draw()


def write_run(run_dir, with_eval=True):
    with MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for step in range(1, 11):
            record = {"step": step, "time/elapsed_s": 3.0 * step, "reward/mean": step / 10}
            if with_eval and step % 5 == 0:
                record |= {"eval/greedy_reward": step / 12, "eval/sampled_reward": step / 15}
            writer.write(record)


def test_plot_run_writes_png_next_to_metrics(tmp_path):
    run_dir = tmp_path / "my_run"
    write_run(run_dir)
    out = plot_run(run_dir)
    assert out == run_dir / "reward_curve.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1024


def test_plot_run_skips_series_absent_from_the_file(tmp_path):
    run_dir = tmp_path / "no_eval"
    write_run(run_dir, with_eval=False)
    out = plot_run(run_dir, out=tmp_path / "plots" / "curve.png")
    assert out == tmp_path / "plots" / "curve.png"
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_run_names_the_missing_metrics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def write_rows(run_dir, rewards, staleness=None):
    with MetricsWriter(run_dir / "metrics.jsonl") as writer:
        for step, reward in enumerate(rewards, start=1):
            row = {"step": step, "time/elapsed_s": 2.0 * step, "reward/mean": reward}
            if staleness is not None:
                row["staleness/mean"] = staleness
            writer.write(row)


def lines_of(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_plot_runs_overlays_each_run_labelled_by_its_directory(tmp_path):
    from asyncrl.telemetry.plot import compare_figure

    write_rows(tmp_path / "sync", [0.1, 0.2, 0.3])
    write_rows(tmp_path / "async", [0.15, 0.35])
    fig = compare_figure([tmp_path / "sync", tmp_path / "async"])
    by_step, by_time = fig.axes  # no eval rows: the training reward alone, against step and wall clock
    assert lines_of(by_step) == {"sync": ([1, 2, 3], [0.1, 0.2, 0.3]), "async": ([1, 2], [0.15, 0.35])}
    assert lines_of(by_time)["async"] == ([2.0, 4.0], [0.15, 0.35])
    assert by_step.get_lines()[0].get_color() == by_time.get_lines()[0].get_color()  # one colour per run


def test_plot_runs_draws_the_chosen_keys_where_each_run_has_them(tmp_path):
    from asyncrl.telemetry.plot import compare_figure

    write_rows(tmp_path / "a", [0.1, 0.2], staleness=0.5)
    write_rows(tmp_path / "b", [0.3, 0.4])
    fig = compare_figure([tmp_path / "a", tmp_path / "b"], ["reward/mean", "staleness/mean"])
    assert [ax.get_title() for ax in fig.axes] == ["reward/mean vs train step", "reward/mean vs wall clock",
                                                   "staleness/mean vs train step", "staleness/mean vs wall clock"]
    assert set(lines_of(fig.axes[0])) == {"a", "b"} and lines_of(fig.axes[2]) == {"a": ([1, 2], [0.5, 0.5])}


def test_plot_runs_labels_runs_of_the_same_name_by_their_paths(tmp_path):
    from asyncrl.telemetry.plot import compare_figure

    write_rows(tmp_path / "x" / "run", [0.1])
    write_rows(tmp_path / "y" / "run", [0.2])
    fig = compare_figure([tmp_path / "x" / "run", tmp_path / "y" / "run"])
    assert set(lines_of(fig.axes[0])) == {str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run")}


def test_asyncrl_plot_a_b_writes_the_overlay_and_one_run_keeps_its_reward_curve(tmp_path, monkeypatch, capsys):
    from asyncrl.cli import main

    write_run(tmp_path / "a")
    write_rows(tmp_path / "b", [0.3, 0.4])
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "a", "b"]) == 0
    assert (tmp_path / "compare.png").read_bytes().startswith(PNG_MAGIC)
    assert main(["plot", "a", "b", "--metric", "reward/mean", "--out", "out/r.png"]) == 0
    assert (tmp_path / "out" / "r.png").read_bytes().startswith(PNG_MAGIC)
    assert main(["plot", "a"]) == 0
    assert (tmp_path / "a" / "reward_curve.png").read_bytes().startswith(PNG_MAGIC)
    assert capsys.readouterr().out.split() == ["compare.png", "out/r.png", "a/reward_curve.png"]


def test_asyncrl_plot_names_a_metric_no_run_has_and_a_directory_without_metrics(tmp_path, capsys):
    from asyncrl.cli import main

    write_rows(tmp_path / "a", [0.1])
    assert main(["plot", str(tmp_path / "a"), "--metric", "reward/man", "--out", str(tmp_path / "x.png")]) == 2
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["plot error: --metric reward/man: no run has this key — did you mean 'reward/mean'?",
                   f"plot error: no metrics file at {tmp_path / 'nothing' / 'metrics.jsonl'}: is "
                   f"{tmp_path / 'nothing'} a run directory?"]
    assert not (tmp_path / "x.png").exists()
