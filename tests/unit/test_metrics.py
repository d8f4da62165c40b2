"""Typed reductions across actors, staleness statistics, and the metrics.jsonl round trip."""

import math

import msgspec
import numpy as np
import pytest
import torch

from asyncrl.telemetry.metrics import (
    AnyMetric,
    Last,
    Max,
    Mean,
    MetricsWriter,
    Min,
    Rate,
    RoleStats,
    Share,
    Sum,
    Total,
    Window,
    WindowReducer,
    read_metrics,
    reduce_metrics,
    staleness_stats,
)
from asyncrl.telemetry.spans import Span


def test_reduce_metrics_combines_each_key_by_its_own_reduction():
    reports = [
        {"generation/tokens": Sum(100), "staleness/max": Max(1), "trainer/loss": Mean(0.5),
         "trainer/lr": Last(1e-5), "reward/min": Min(0.2)},
        {"generation/tokens": Sum(300), "staleness/max": Max(3), "trainer/loss": Mean(1.5),
         "trainer/lr": Last(2e-5), "reward/min": Min(-0.1)},
    ]
    assert reduce_metrics(reports) == pytest.approx(
        {"generation/tokens": 400.0, "staleness/max": 3.0, "trainer/loss": 1.0,
         "trainer/lr": 2e-5, "reward/min": -0.1}
    )


def test_mean_is_weighted_by_what_stands_behind_each_value():
    assert reduce_metrics([{"loss": Mean(1.0, weight=3)}, {"loss": Mean(5.0, weight=1)}]) == {"loss": 2.0}


def test_reduce_metrics_keeps_keys_only_some_actors_report():
    assert reduce_metrics([{"a": Sum(1)}, {"b": Max(2)}, {"a": Sum(2)}]) == {"a": 3.0, "b": 2.0}


def test_reduce_metrics_rejects_one_key_with_two_reductions():
    with pytest.raises(ValueError, match="different reductions"):
        reduce_metrics([{"x": Sum(1)}, {"x": Mean(1)}])


def test_reduce_metrics_rejects_untyped_value():
    with pytest.raises(TypeError, match="wrap it"):
        reduce_metrics([{"x": 1.0}])


def test_metric_report_survives_msgspec_encoding():
    report = {"t": Sum(3.0), "l": Mean(0.5, weight=2.0)}
    assert msgspec.json.decode(msgspec.json.encode(report), type=dict[str, AnyMetric]) == report


def test_rate_is_per_second_and_share_per_actor_second_of_the_window():
    reports = [{"tokens_per_s": Rate(100), "stall_share": Share(1.0)},
               {"tokens_per_s": Rate(300), "stall_share": Share(0.0)}]
    assert reduce_metrics(reports, window_s=4.0) == {"tokens_per_s": 100.0, "stall_share": 0.125}
    with pytest.raises(ValueError, match="window"):
        reduce_metrics(reports)


def test_total_is_a_sum_of_increments_and_not_the_same_reduction_as_sum():
    assert reduce_metrics([{"n": Total(2)}, {"n": Total(3)}]) == {"n": 5.0}
    with pytest.raises(ValueError, match="different reductions"):
        reduce_metrics([{"n": Total(2)}, {"n": Sum(3)}])


def test_window_reducer_adds_totals_up_over_windows_and_keeps_them_in_later_rows():
    reducer = WindowReducer()
    first = reducer.reduce([{"failed": Total(2), "stall_s": Sum(1.0)}, {"failed": Total(1)}], window_s=1.0)
    second = reducer.reduce([{"failed": Total(4), "stall_s": Sum(0.5)}], window_s=1.0)
    third = reducer.reduce([{"stall_s": Sum(0.0)}], window_s=1.0)  # nobody reported the total this time
    assert (first, second, third) == ({"failed": 3.0, "stall_s": 1.0}, {"failed": 7.0, "stall_s": 0.5},
                                      {"failed": 7.0, "stall_s": 0.0})


def test_window_turns_counters_since_the_start_into_increments_since_the_previous_read():
    window = Window()
    assert [window.take("n", total) for total in (3, 3, 10)] == [3.0, 0.0, 7.0]
    assert window.take("other", 1) == 1.0  # each key its own mark


def test_role_stats_cross_the_actor_boundary_as_they_are():
    import pickle

    stats = RoleStats(metrics={"t": Rate(3.0), "n": Total(1.0), "l": Mean(0.5, weight=2.0), "d": Last(4.0)},
                      spans=[Span(role="generator/0", kind="generate", start=1.0, end=2.0, version=3)])
    assert pickle.loads(pickle.dumps(stats)) == stats  # Ray
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=RoleStats) == stats
    assert stats.values() == {"t": 3.0, "n": 1.0, "l": 0.5, "d": 4.0}
    assert RoleStats().metrics == {} and RoleStats().spans == []


def test_staleness_stats_mean_max_and_histogram():
    assert staleness_stats([0, 2, 2, 0, 1, 2]) == {
        "staleness/mean": pytest.approx(7 / 6), "staleness/max": 2,
        "staleness/hist/0": 2, "staleness/hist/1": 1, "staleness/hist/2": 3,
    }


def test_staleness_stats_histogram_includes_empty_bins_below_max():
    stats = staleness_stats([3])
    assert [stats[f"staleness/hist/{k}"] for k in range(4)] == [0, 0, 0, 1]
    assert staleness_stats([]) == {}


def test_staleness_stats_rejects_negative_staleness():
    with pytest.raises(ValueError, match=">= 0"):
        staleness_stats([1, -1])


def test_metrics_file_round_trips_numpy_torch_and_non_finite(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write({"step": np.int64(1), "reward/mean": np.float32(0.25), "trainer/loss": torch.tensor(1.5),
                      "note": "warmup", "trainer/grad_norm": float("nan"), "x/inf": np.float64("inf")})
        writer.write({"step": 2, "reward/mean": 0.5})
    records = read_metrics(path)
    assert records == [
        {"step": 1, "reward/mean": 0.25, "trainer/loss": 1.5, "note": "warmup",
         "trainer/grad_norm": None, "x/inf": None},
        {"step": 2, "reward/mean": 0.5},
    ]
    assert type(records[0]["step"]) is int and type(records[0]["reward/mean"]) is float


def test_metrics_writer_flushes_each_line_before_close(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 0})
    assert read_metrics(path) == [{"step": 0}]
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write({"step": 1})


def test_metrics_writer_appends_to_existing_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in range(2):
        with MetricsWriter(path) as writer:
            writer.write({"step": step})
    assert [r["step"] for r in read_metrics(path)] == [0, 1]


def test_metrics_writer_rejects_non_scalar_values(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as writer:
        with pytest.raises(TypeError, match="'v'"):
            writer.write({"v": np.array([1.0, 2.0])})
        with pytest.raises(TypeError, match="'d'"):
            writer.write({"d": {"nested": 1}})


def test_read_metrics_skips_truncated_last_line_but_not_a_broken_middle(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


def test_nan_mean_when_all_weights_are_zero():
    assert math.isnan(reduce_metrics([{"x": Mean(1.0, weight=0)}])["x"])


def test_token_staleness_counts_each_token_at_its_own_version():
    from asyncrl.telemetry.metrics import token_staleness_stats

    # step 3: one trajectory of versions [1, 1, 2] (spans a weight swap), one of [3, 3]
    lags = [3 - v for v in [1, 1, 2, 3, 3]]
    assert token_staleness_stats(lags) == {"staleness/token_mean": 1.0, "staleness/token_hist/0": 2,
                                           "staleness/token_hist/1": 1, "staleness/token_hist/2": 2}
    assert token_staleness_stats([]) == {}
    with pytest.raises(ValueError, match=">= 0"):
        token_staleness_stats([-1])


def test_rss_and_peak_read_this_process_and_a_forked_childs_own(tmp_path):
    """rss_mb keeps /proc/<pid>/statm open (one pread a call), host_peak_gb status and clear_refs (`proc_fd`): rss
    follows the resident memory as it grows, and a forked child reads its own process, not the parent's
    descriptors."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    # in a fresh interpreter: a large test process's allocator and page reclaim make its RSS deltas unreliable
    script = f"""
import os
from asyncrl.telemetry import memory, metrics
memory.host_peak_gb()  # its descriptors are kept beside statm's
before = metrics.rss_mb()
block = b"\\x01" * (64 * 2**20)  # written: every page resident
assert metrics.rss_mb() > before + 48, (before, metrics.rss_mb())
kept = metrics._kept[("statm", os.O_RDONLY)]
assert kept[0] == os.getpid()
os.close(kept[1])  # someone else closed it, and the number names another file now
with open(os.devnull) as held:
    assert metrics.rss_mb() > before + 48  # from /proc/<pid>/statm opened again
    assert metrics._kept[("statm", os.O_RDONLY)][1] != held.fileno()
out = {str(tmp_path / "child")!r}
pid = os.fork()
if pid == 0:  # the child: drop the block (its pages), read again
    try:
        del block
        rss = metrics.rss_mb()
        memory.host_peak_gb()  # its own status and clear_refs too, not the parent's
        assert set(k[0] for k in metrics._kept.values()) == set([os.getpid()]), metrics._kept
        open(out, "w").write(f"{{os.getpid()}} {{rss}} {{metrics._kept[('statm', os.O_RDONLY)][0]}}")
    finally:
        os._exit(0)
os.waitpid(pid, 0)
child_pid, child_rss, read_pid = open(out).read().split()
assert int(read_pid) == int(child_pid) != os.getpid()
assert float(child_rss) < metrics.rss_mb() - 48, (child_rss, metrics.rss_mb())  # its own, smaller memory
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
