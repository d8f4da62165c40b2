"""Run-level figures from metrics rows: window-weighted shares, merged histograms, time to target."""

import pytest

from asyncrl.telemetry.summary import summarize_rows, time_to_target


def rows():
    out = [{"step": 0, "version": 0, "eval/greedy_reward": 0.1, "time/elapsed_s": 0.5}]  # eval-only row
    for step, (window, busy, reward) in enumerate([(1.0, 1.0, 0.1), (3.0, 0.0, 0.3), (1.0, 0.5, 0.5)], 1):
        out.append({"step": step, "time/elapsed_s": 0.5 + step, "time/step_s": window, "reward/mean": reward,
                    "trainer/samples": 8, "trainer/tokens": 16, "trainer/busy_share": busy,
                    "generator/0/busy_share": 0.9, "overlap_ratio": busy / 2,
                    "staleness/hist/0": 4, "staleness/hist/1": 4 if step > 1 else 0,
                    "staleness/token_hist/0": 10, "staleness/token_hist/2": 6})
    return out


def test_shares_are_weighted_by_step_window_length():
    s = summarize_rows(rows())
    assert s["steps"] == 3 and s["train_s"] == 5.0
    assert s["trainer/busy_share"] == pytest.approx((1.0 * 1 + 0.0 * 3 + 0.5 * 1) / 5)
    assert s["overlap_ratio"] == pytest.approx(0.15)
    assert "generator/0/busy_share" not in s  # per-actor shares stay in metrics.jsonl
    assert s["throughput/samples_per_s"] == pytest.approx(24 / 5)


def test_histograms_merge_over_steps():
    s = summarize_rows(rows())
    assert s["staleness_hist"] == {"0": 12, "1": 8}
    assert s["staleness_mean"] == pytest.approx(8 / 20) and s["staleness_max"] == 1
    assert s["staleness_token_hist"] == {"0": 30, "2": 18}
    assert s["reward_first"] == 0.1 and s["reward_final"] == pytest.approx(0.3)
    assert s["eval_greedy_first"] == 0.1


def test_time_to_target_needs_a_full_smoothing_window():
    r = [{"time/elapsed_s": float(t), "reward/mean": v} for t, v in enumerate([0.0, 1.0, 1.0, 0.2, 1.0])]
    assert time_to_target(r, 0.7, smooth=2) == 2.0   # mean of steps 1, 2
    assert time_to_target(r, 0.7, smooth=1) == 1.0
    assert time_to_target(r, 0.99, smooth=3) is None
    assert summarize_rows(rows(), target_reward=0.3)["time_to_target_s"] is None  # 3 steps < 5-step window


def test_no_train_rows_gives_only_the_step_count():
    assert summarize_rows(rows()[:1]) == {"steps": 0}


def test_peak_memory_is_the_runs_largest_and_colocated_times_their_means():
    steps = rows()
    for row, (peak, sleep) in zip(steps[1:], [(1.0, 0.1), (3.5, 0.3), (2.0, 0.2)]):
        row.update({"memory/trainer_peak_gb": peak, "colocate/sleep_s": sleep})
    s = summarize_rows(steps)
    assert s["memory/trainer_peak_gb"] == 3.5
    assert s["colocate/sleep_s/mean"] == pytest.approx(0.2) and "colocate/wake_s/mean" not in s


def test_routing_agreement_logprob_gap_and_occupancy_get_their_run_means_where_written():
    from asyncrl.report import summary_lines

    steps = rows()
    for row, (agree, gap) in zip(steps[1:], [(1.0, 0.0), (0.8, 1e-3), (0.9, 2e-3)]):
        row.update({"routing/agreement": agree, "trainer/logprob_gap": gap})
    steps[2]["generation/occupancy"] = 0.25  # written in the steps whose window decoded
    s = summarize_rows(steps)
    assert s["routing/agreement/mean"] == pytest.approx(0.9) and s["trainer/logprob_gap/mean"] == pytest.approx(1e-3)
    assert s["generation/occupancy/mean"] == 0.25
    lines = summary_lines(s)
    assert "| MoE routing agreement, engine vs trainer (mean) | 0.900 |" in lines
    assert "| decode batch occupancy (mean) | 0.25 |" in lines
    assert "routing/agreement/mean" not in summarize_rows(rows())  # a dense run: no routing line
