"""plot_run turns a run directory's metrics.jsonl into a reward-curve PNG."""

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
