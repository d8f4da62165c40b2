"""examples/first_digit_lora runs through `asyncrl launch --local`: only the adapters train, the export holds the
merged model and the adapter, and a run killed after a checkpoint and resumed ends where the uninterrupted run ends
— the same adapter, the same merged weights and, step by step, the same learning rate (the cosine schedule
resumes where it stopped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_resume import _finish, _kill_after_checkpoint, _launch

pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # three asyncrl launches

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "first_digit_lora" / "config.toml"


def _args(tiny_model_dir: Path, run_dir: Path, *sets: str) -> list[str]:
    overrides = [f'model.path="{tiny_model_dir}"', f'run.output_dir="{run_dir}"', "trainer.total_steps=6",
                 "trainer.warmup_steps=2", "trainer.prompts_per_step=4", "rollout.group_size=4",
                 "rollout.concurrency=4", "trainer.micro_batch_size=16", "trainer.eval_every=0",
                 "staleness.max_staleness=0", "rollout.seed_groups=true", "logging.live=false", *sets]
    return [str(CONFIG), "--local", *(arg for s in overrides for arg in ("--set", s))]


def _lrs(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["trainer/lr"] for r in rows if "trainer/lr" in r]


def test_the_lora_example_resumed_after_a_kill_ends_with_the_uninterrupted_runs_adapter_and_schedule(
        tiny_model_dir, tmp_path):
    clean = tmp_path / "clean"
    _finish(_launch(*_args(tiny_model_dir, clean)))
    lrs = _lrs(clean)
    assert len(lrs) == 6 and lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-2) and lrs[-1] < lrs[2]  # warmup, decay
    adapter = load_file(str(clean / "checkpoint" / "adapter" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    merged = load_file(str(clean / "checkpoint" / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)  # only the adapted layers moved

    killed = tmp_path / "killed"
    proc = _launch(*_args(tiny_model_dir, killed, "run.save_every=3"))
    _kill_after_checkpoint(proc, killed, 3)
    assert not (killed / "checkpoint").exists()
    ck = load_file(str(killed / "checkpoints" / "step_00000003" / "policy.safetensors"))
    assert set(ck) == set(adapter)  # the resumable checkpoint holds the adapter, not the base
    out = _finish(_launch("--local", "--resume", str(killed), "--set", "logging.live=false"))
    assert "resuming from" in out
    assert _lrs(killed) == lrs
    resumed = load_file(str(killed / "checkpoint" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(resumed[k], adapter[k]) for k in adapter)
    resumed_merged = load_file(str(killed / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(resumed_merged[k], merged[k]) for k in merged)
