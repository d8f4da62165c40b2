"""asyncrl report: report.md and its three plots from a run directory."""

import pytest

from asyncrl.config import ConfigError
from asyncrl.report import summary_lines, write_report
from asyncrl.telemetry.metrics import MetricsWriter


def write_run(run_dir):
    with MetricsWriter(run_dir / "metrics.jsonl") as w:
        w.write({"step": 0, "version": 0, "eval/greedy_reward": 0.1, "time/elapsed_s": 0.2})
        for step in range(1, 7):
            w.write({"step": step, "time/elapsed_s": 0.2 + step, "time/step_s": 1.0, "reward/mean": 0.1 * step,
                     "trainer/samples": 8, "trainer/busy_share": 0.6, "generator/busy_share": 0.8,
                     "overlap_ratio": 0.4, "staleness/hist/0": 2, "staleness/hist/1": 6,
                     "staleness/token_hist/1": 12})
    # a run's config as written, less the fields it leaves at their defaults
    (run_dir / "config.toml").write_text('[model]\npath = "runs/models/tiny"\n[staleness]\nmax_staleness = 1\n'
                                         "[rollout]\nnum_generators = 2\n")


def test_report_writes_summary_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)
    out = write_report(tmp_path, target_reward=0.3)
    text = out.read_text()
    assert "`staleness.max_staleness = 1`" in text and "`rollout.num_generators = 2`" in text
    assert "| throughput (trained samples/s) | 8.00 |" in text
    assert "| staleness mean / max (versions, per sample) | 0.75 / 1 |" in text
    assert "| time to target reward (s) | 5.2 |" in text  # 5-step mean of 0.1..0.5 reaches 0.3 at step 5
    for name in ("reward_curve.png", "utilisation.png", "staleness.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG") and f"({name})" in text


def test_report_names_the_file_and_the_key_of_a_typo_in_the_runs_config(tmp_path):
    write_run(tmp_path)
    (tmp_path / "config.toml").write_text('[model]\npath = "m"\n[trainer]\nprompts_per_stp = 4\n')
    with pytest.raises(ConfigError) as err:
        write_report(tmp_path)
    assert err.value.errors == [f"{tmp_path / 'config.toml'}: trainer.prompts_per_stp: unknown key — "
                                "did you mean 'prompts_per_step'?"]


def test_report_without_train_steps_is_an_error(tmp_path):
    with MetricsWriter(tmp_path / "metrics.jsonl") as w:
        w.write({"step": 0, "eval/greedy_reward": 0.1})
    with pytest.raises(ValueError, match="no finished train step"):
        write_report(tmp_path)


def test_summary_lines_join_paired_figures():
    lines = summary_lines({"reward_first": 0.1, "reward_final": 0.4, "staleness_mean": 1.0, "staleness_max": 2})
    assert "| reward first → final (mean of last 5 steps) | 0.100 → 0.400 |" in lines
    assert "| staleness mean / max (versions, per sample) | 1.00 / 2 |" in lines
