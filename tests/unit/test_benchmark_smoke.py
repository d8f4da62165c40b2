"""benchmarks/engine_throughput.py and vs_sync_loop.py run end to end in --quick mode and end with the
benchmark JSON line; the sync loop's GRPO maths and its target rule match asyncrl's and the docstring's.

Speed is not asserted here (benchmarks/README.md): this only keeps the script from rotting as the engine
changes underneath it. The quick run itself takes well under a second; importing transformers, when no
earlier test did, takes a few more.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_throughput.py"


def load_engine_benchmark(monkeypatch):
    return load_benchmark(monkeypatch, SCRIPT)


def test_quick_benchmark_ends_with_the_result_json_line(capsys, monkeypatch):
    threads = torch.get_num_threads()
    try:
        returned = load_engine_benchmark(monkeypatch).main(["--quick", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide count
    out = capsys.readouterr().out
    assert "A. fixed batches" in out and "B. " in out and "C. in-flight weight update" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"benchmark", "value", "unit", "baseline", "ratio", "target", "step_ms", "floor_ms",
                         "step_over_floor", "ratio_at_floor"}
    assert last["benchmark"] == "engine_throughput" and last["unit"] == "tokens/s" and last["target"] == 2.0
    assert last["step_ms"] > 0 and last["floor_ms"] > 0
    assert last["ratio_at_floor"] > 0  # HF's time over (native time outside decode + its steps at the floor)
    # each figure is rounded on its own (ms to 0.1 µs, the ratio to 0.001): equal up to that rounding
    assert abs(last["step_over_floor"] - last["step_ms"] / last["floor_ms"]) <= 0.01 * last["step_over_floor"] + 0.002
    assert last["value"] > 0 and last["baseline"] > 0
    assert abs(last["ratio"] - last["value"] / last["baseline"]) <= 0.01 * last["ratio"]
    assert last == returned


VS_SYNC = SCRIPT.parent / "vs_sync_loop.py"


def load_vs_sync(monkeypatch):
    return load_benchmark(monkeypatch, VS_SYNC)


def test_sync_loop_grpo_advantages_equal_asyncrls(monkeypatch):
    from asyncrl.algorithms.advantages import grpo_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 1.0])
    ours = load_vs_sync(monkeypatch).grpo_advantages(rewards, 4)
    theirs = grpo_advantages(rewards, torch.arange(3).repeat_interleave(4))
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert (ours[4:8] == 0).all()  # an all-equal group carries no signal


def test_target_is_the_first_step_whose_moving_mean_reaches_it(monkeypatch):
    to_target = load_vs_sync(monkeypatch).to_target
    rewards, step_s = [0.0, 0.5, 1.0, 1.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0]
    assert to_target(rewards, step_s, 0.75, 2) == (3, 6.0)   # mean(0.5, 1.0) = 0.75 at step 3
    assert to_target(rewards, step_s, 0.0, 1) == (1, 1.0)
    assert to_target(rewards, step_s, 1.01, 2) == (None, None)


def test_cpu_floor_is_every_processs_cpu_a_step_over_the_cores(monkeypatch):
    cpu_floor = load_vs_sync(monkeypatch).cpu_floor
    first = {"time/step_s": 1.0, "controller/cpu_cores": 9.0}  # left out: the processes' first reports
    rows = [first, *({"time/step_s": s, "controller/cpu_cores": 0.2, "trainer/cpu_cores": 0.9,
                      "generator/cpu_cores": 0.5, "buffer/cpu_cores": 0.3, "generator/0/busy_share": 0.5}
                     for s in (0.04, 0.05, 0.06))]
    assert cpu_floor(rows, 2) == pytest.approx(1.9 * 0.05 / 2)  # the median step's 95 ms of CPU over 2 cores
    assert math.isnan(cpu_floor([first], 2))


@pytest.mark.slow
def test_quick_vs_sync_loop_runs_both_sides_and_ends_with_the_result_json_line(capsys, monkeypatch, tmp_path):
    threads = torch.get_num_threads()
    try:
        returned = load_vs_sync(monkeypatch).main(["--quick", "--no-ray", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "floor (seed 0): G_alone" in out and "| sync | 0 |" in out and "| asyncrl-local | 0 |" in out
    assert (tmp_path / "local-0" / "metrics.jsonl").exists()
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"benchmark", "value", "unit", "baseline", "ratio", "target", "step_over_cpu_floor"}
    assert last["step_over_cpu_floor"] > 0  # in process: the one process's CPU a step over the cores
    assert last["benchmark"] == "vs_sync_loop" and last["unit"] == "s" and last["target"] == 1.5
    assert last["value"] > 0 and last["baseline"] > 0
    # this benchmark's ratio is baseline / value: the sync loop's wall time over asyncrl's (both printed to 3
    # decimals, which for the quick run's hundredths of a second moves their quotient by up to a few %)
    v, b = last["value"], last["baseline"]
    assert abs(last["ratio"] - b / v) <= 0.0005 / v + 0.0005 * b / v**2 + 0.001
    assert last == returned


def test_the_decode_floor_grows_with_batch_and_attended_width(monkeypatch):
    """decode_floor times the step's products at the model's shapes: far more rows and cache positions
    cost more (the shapes differ by 64x, so timing noise cannot reorder them)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    bench = load_engine_benchmark(monkeypatch)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    small = bench.decode_floor(model, batch=1, width=8, repeats=3)
    large = bench.decode_floor(model, batch=64, width=512, repeats=3)
    for f in (small, large):
        assert set(f) == {"floor_s", "linears_s", "attention_s"} and min(f.values()) > 0
    assert large["attention_s"] > small["attention_s"] and large["floor_s"] > small["floor_s"]


def test_train_step_quick_run_prints_the_breakdown_and_the_result_json_line(capsys, monkeypatch):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"
    spec = importlib.util.spec_from_file_location("train_step_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        returned = module.main(["--quick", "--decoupled", "--compare", "prox_from_gradient_pass"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "bare step" in out and "prox_from_gradient_pass off" in out
    for section in ("forward + logprobs", "backward", "clip + optimizer", "collate", "prepare", "metrics"):
        assert section in out, section
    last = json.loads(out.strip().splitlines()[-1])
    assert last == returned and last["benchmark"] == "train_step" and last["unit"] == "steps/s"
    assert last["value"] > 0 and last["baseline"] > 0
    assert abs(last["ratio"] - last["value"] / last["baseline"]) <= 0.01 * last["ratio"] + 1e-3


def load_train_step(monkeypatch):
    return load_benchmark(monkeypatch, SCRIPT.parent / "train_step.py")


def test_train_step_break_even_is_compile_time_over_the_saving_and_none_when_compiling_is_not_faster(monkeypatch):
    module = load_train_step(monkeypatch)
    assert module.break_even(30.0, 0.050, 0.040) == pytest.approx(3000)
    assert module.break_even(30.0, 0.050, 0.050) is None and module.break_even(30.0, 0.050, 0.060) is None


@pytest.mark.slow  # torch.compile: 15-45 s on 2 cores
def test_train_step_compiled_bare_step_does_the_same_update_as_the_eager_one(monkeypatch):
    """The --compile side measures the same work: from the same weights, one compiled step on the same batch
    moves them as the eager step does (to float rounding), after steps on batches of other padded widths."""
    module = load_train_step(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = module.MODELS["quick"]
        model = module.build_model(spec, seed=0)
        algorithm = module.AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip", loss_agg="token-mean",
                                           clip_eps=0.2)
        trainer = module.TrainerConfig(lr=1e-3, grad_clip=1.0, mini_batches=1, micro_batch_size=8)
        batches = module.width_variants(model, spec, 8, 4, widths=2)
        step, firsts, padded = module.compiled_bare(model, batches, algorithm, trainer)
        assert len(firsts) == len(padded) == 2 and min(firsts) > 0
        assert len(set(padded)) == 2, padded  # the two batches have different widths: a real recompile test
        eager = module.BareStep(module.copy.deepcopy(model), module.build_groups(model, spec, 8, 4, seed=1),
                                algorithm, trainer)
        compiled_model = step.model._orig_mod
        compiled_model.load_state_dict(model.state_dict())
        step.optimizer = torch.optim.AdamW(step.params, lr=trainer.lr, betas=tuple(trainer.betas),
                                           weight_decay=trainer.weight_decay)
        eager()
        step()
    finally:
        torch.set_num_threads(threads)
    moved = 0
    for (name, a), b in zip(eager.model.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        moved += int(not torch.equal(a, model.get_parameter(name)))
    assert moved > 0  # the step trained


HUB = SCRIPT.parent / "hub.py"


def load_hub(monkeypatch):
    spec = importlib.util.spec_from_file_location("hub_benchmark", HUB)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_hub_benchmark_moves_every_steps_trajectories_through_the_in_process_buffer(monkeypatch):
    hub = load_hub(monkeypatch)
    cfg = hub.hub_config(producers=2, scorers=1, quick=True)
    count, seconds = hub.run_in_process(cfg, (8, 16), producers=2, scorers=1, steps=3, warmup=1)
    assert count == 3 * cfg.trainer.prompts_per_step * hub.GROUP_SIZE and seconds > 0


def test_hub_benchmark_share_is_the_controllers_seconds_over_the_step_windows_after_the_first(monkeypatch):
    share = load_hub(monkeypatch).controller_share
    rows = [{"step": 1, "time/step_s": 5.0, "time/controller_s": 1.0},  # the first: setup, left out
            {"step": 2, "time/step_s": 1.0, "time/controller_s": 0.01},
            {"step": 3, "time/step_s": 3.0, "time/controller_s": 0.03}]
    percent, median_s, counted = share(rows)
    assert percent == pytest.approx(1.0) and median_s == pytest.approx(0.02) and counted == 2


@pytest.mark.slow
def test_quick_hub_benchmark_runs_all_three_paths_and_a_launch_and_ends_with_the_json_line():
    # in a process of its own: the benchmark starts (and stops) Ray clusters of its own, which cannot share this
    # process with the test session's (tests/conftest.py)
    import os
    import subprocess

    root = HUB.parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(HUB), "--quick"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "in-process" in out and "plain Ray" in out and "B. the Controller" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["benchmark"] == "hub" and last["target"] == 1.0
    assert last["value"] > 0 and last["ratio"] == pytest.approx(2.0 / last["value"], rel=0.01)
    assert last["hub_traj_per_s"] > 0 and last["plain_traj_per_s"] > 0
    # the driver's actor calls a step (the train step, the send, the receive, the publish at least) and what
    # they take by themselves: calls x the round trip's CPU over the step
    assert last["calls_per_step"] >= 4 and last["ray_call_us"] > 0
    assert last["ray_floor_share"] == pytest.approx(
        last["calls_per_step"] * last["ray_call_us"] / 10 / (step_ms := float(
            re.search(r"step \(median\)\s+([\d.]+) ms", out).group(1))), rel=0.02), step_ms


TRAINER_MEMORY = SCRIPT.parent / "trainer_memory.py"


def test_trainer_memory_benchmark_runs_both_sides_and_ends_with_the_json_line(capsys, monkeypatch):
    """Each side in a fresh interpreter, one step line each; the JSON line's figures are the table's."""
    returned = load_benchmark(monkeypatch, TRAINER_MEMORY).main(["--quick"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == returned
    assert returned["benchmark"] == "trainer_memory" and returned["unit"] == "GiB" and returned["steps"] == 2
    rows = [line for line in out if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 2
    bounded_peak = float(rows[1].split("|")[5])  # step 2's bounded peak: the largest from step 2 on
    assert returned["value"] == pytest.approx(bounded_peak, abs=0.006)
    assert returned["ratio"] == pytest.approx(returned["baseline"] / returned["value"], rel=0.01)
    assert returned["target"] > 0 and returned["value"] > 0
