"""benchmarks/long_tail.py's figures from a run's metrics rows: the phase times, the ideal, the speed-up and its
bound. (The benchmark itself launches the long-reply example five times: not run here.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _row(step_s: float, gen: float, train: float, wait: float, occupancy: float | None = None) -> dict:
    row = {"time/step_s": step_s, "reward/mean": 0.5, "generator/busy_share": gen / step_s,
           "trainer/busy_share": train / step_s, "trainer/gate_wait_s": wait, "trainer/response_len": 60.0}
    return row if occupancy is None else {**row, "generation/occupancy": occupancy}


def test_phase_figures_leave_out_the_warmup_and_take_the_ideal_by_whether_the_phases_overlap(monkeypatch):
    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "long_tail.py")
    # sync: a step is the generation (its tail included) and then the update: they cannot overlap
    sync_rows = [_row(40.0, 30.0, 9.0, 31.0, 0.5), {"eval/greedy": 0.4}, _row(30.0, 12.0, 17.0, 13.0, 0.25),
                 _row(32.0, 14.0, 17.0, 15.0)]
    sync = bench.phase_figures(sync_rows, warmup=1, overlapped=False)
    assert sync["steps"] == 3 and sync["train_s"] == 102.0  # every step's time, the warm-up's too
    assert sync["step_s"] == 31.0 and sync["G"] == pytest.approx(13.0) and sync["T"] == pytest.approx(17.0)
    assert sync["ideal_s"] == pytest.approx(30.0) and sync["of_ideal"] == pytest.approx(30.0 / 31.0)
    assert sync["wait_s"] == 14.0 and sync["occupancy_by_step"] == [0.5, 0.25, None]
    assert sync["occupancy"] == pytest.approx(0.375)  # over the steps that decoded
    # async: generation of the next step beside the update: the ideal is the busier of the two
    async_rows = [_row(30.0, 20.0, 20.0, 10.0), _row(22.0, 16.0, 20.0, 1.0), _row(22.0, 16.0, 21.0, 0.5)]
    ours = bench.phase_figures(async_rows, warmup=1, overlapped=True)
    assert ours["ideal_s"] == pytest.approx(20.5) and ours["of_ideal"] == pytest.approx(20.5 / 22.0)
    ups = bench.speedups({"sync": sync, "async": ours})
    assert ups["sync"] == {"speedup": 1.0, "bound": pytest.approx(31.0 / 30.0)}
    assert ups["async"]["speedup"] == pytest.approx(102.0 / 74.0) and ups["async"]["bound"] == pytest.approx(31 / 20.5)
    with pytest.raises(ValueError, match="no training step"):
        bench.phase_figures([{"eval/greedy": 0.4}], warmup=1, overlapped=True)


def test_every_setting_is_the_example_with_a_few_overrides_that_load(monkeypatch, tiny_model_dir, tmp_path):
    from asyncrl.config import load_config

    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "long_tail.py")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1", "answer": "2"}\n')
    folders = [f'model.path="{tiny_model_dir}"', f'data.path="{rows}"', f'data.eval_path="{rows}"']
    seen = set()
    for name, sets in bench.SETTINGS.items():
        cfg = load_config(bench.CONFIG, [*folders, *sets])
        seen.add((cfg.staleness.max_staleness, cfg.rollout.weight_update))
        assert cfg.rollout.max_new_tokens == 256 and cfg.trainer.max_tokens_per_micro_batch == 2048
    assert seen == {(0, "in_flight"), (1, "in_flight"), (1, "between_requests"), (2, "in_flight"),
                    (2, "between_requests")}
