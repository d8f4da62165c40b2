"""benchmarks/vs_trl.py gives TRL's GRPOTrainer the job asyncrl's config describes, and refuses a job TRL would run
differently. (The benchmark itself installs TRL into an environment of its own: not run here.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def folders(tiny_model_dir, tmp_path) -> list[str]:
    """The examples' model and data folders are made by their prepare.py: stand-ins, so that the configs load."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1", "answer": "2"}\n')
    return [f'model.path="{tiny_model_dir}"', f'data.path="{rows}"', f'data.eval_path="{rows}"']


def test_the_readme_and_long_reply_jobs_map_onto_grpoconfig_field_by_field(monkeypatch, folders):
    from asyncrl.config import load_config

    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "vs_trl.py")
    jobs = (("readme", 10, 12, False, 32), ("reasoning", 20, 256, True, 4))
    for job, steps, new_tokens, checkpointing, micro in jobs:
        cfg = load_config(bench.JOBS[job], folders)
        s = bench.trl_settings(cfg)
        assert (s["learning_rate"], s["lr_scheduler_type"], s["max_steps"]) == (cfg.trainer.lr, "constant", steps)
        # one optimizer step per step over prompts_per_step x group_size completions, generated for that step; the
        # long-reply job's 2048-token budget holds 4 samples of the longest length (96 + 256): 8 accumulated forwards
        assert cfg.trainer.prompts_per_step * cfg.rollout.group_size == 32
        assert (s["per_device_train_batch_size"], s["gradient_accumulation_steps"]) == (micro, 32 // micro)
        assert (s["num_iterations"], s["num_generations"]) == (1, 8)
        assert (s["max_completion_length"], s["gradient_checkpointing"]) == (new_tokens, checkpointing)
        assert (s["temperature"], s["top_p"], s["top_k"], s["beta"], s["epsilon"]) == (1.0, 1.0, 0, 0.0, 0.2)
        assert (s["loss_type"], s["scale_rewards"], s["bf16"], s["max_grad_norm"]) == ("dapo", "group", True, 1.0)
        assert (s["adam_beta1"], s["adam_beta2"], s["weight_decay"]) == (0.9, 0.999, 0.0)


def test_trl_micro_batches_follow_the_micro_batch_size_or_the_worst_case_under_the_token_budget(monkeypatch):
    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "vs_trl.py")
    assert bench.micro_batch(32, 32, 0, 352) == 32 and bench.micro_batch(32, 12, 0, 352) == 8  # a divisor of 32
    assert bench.micro_batch(32, 32, 2048, 352) == 4 and bench.micro_batch(32, 32, 4096, 128) == 32
    assert bench.micro_batch(24, 32, 100, 352) == 1  # a budget below one sample: one at a time


def test_a_job_trl_would_run_differently_is_refused_with_every_reason(monkeypatch, folders):
    from asyncrl.config import load_config

    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "vs_trl.py")
    cfg = load_config(bench.JOBS["readme"], [*folders, 'algorithm.advantage="rloo"', 'trainer.lr_scheduler="cosine"'])
    with pytest.raises(ValueError, match="advantage must be 'grpo'.*lr_scheduler must be 'constant'"):
        bench.trl_settings(cfg)
    sets = [*folders, 'algorithm.loss_agg="seq-mean-token-sum-norm"']
    assert bench.trl_settings(load_config(bench.JOBS["readme"], sets))["loss_type"] == "dr_grpo"


def test_a_judged_run_is_kept_in_its_folder_and_reused_only_for_the_same_job_seed_and_evaluation(monkeypatch,
                                                                                                  tmp_path):
    """A long job's seeds are measured over several sittings: each judged run's figures stay in its folder with
    the commit and time of the measurement; the same key reuses them, another key or --rerun runs again."""
    bench = load_benchmark(monkeypatch, ROOT / "benchmarks" / "vs_trl.py")
    calls = []

    def run():
        calls.append(1)
        return {"wall_s": 100.0 + len(calls), "greedy": 0.5}

    key = {"job": "reasoning", "sets": ["trainer.eval_prompts=50"], "seed": 1, "eval": {"rows": 50}, "version": None}
    first = bench.kept_run(tmp_path / "asyncrl-1", key, run)
    assert first["wall_s"] == 101.0 and first["key"] == key and first["measured_at"] and "kept" not in first
    again = bench.kept_run(tmp_path / "asyncrl-1", key, run)
    assert len(calls) == 1 and again["kept"] and again["wall_s"] == 101.0
    other = bench.kept_run(tmp_path / "asyncrl-1", {**key, "sets": []}, run)  # another job: run, and kept instead
    assert len(calls) == 2 and other["wall_s"] == 102.0
    assert bench.kept_run(tmp_path / "asyncrl-1", {**key, "sets": []}, run, rerun=True)["wall_s"] == 103.0
    # the framework that does not run this time: its kept figures, or nothing
    assert bench.kept_run(tmp_path / "asyncrl-1", {**key, "sets": []})["wall_s"] == 103.0
    assert bench.kept_run(tmp_path / "trl-1", key) is None and len(calls) == 3
