"""Weighted reward components in a whole `--local` run: two reward functions (one reading the sample's
finish reason and token count) and a learned reward model score every sample; the metrics rows carry each
component as `reward/<name>` (docs/metrics.md, "Rewards") and `reward/mean` is their weighted sum."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import documented_metric_keys
from tests.reward_models import build_reward_model

pytestmark = pytest.mark.slow  # a whole run (about 3 s with the reward model built)

DATA = Path(__file__).resolve().parents[1] / "unit" / "data"
FUNCTIONS = ('[{fn="prefix_match", name="prefix", weight=1.0}, '
             '{fn="asyncrl_unit_fixtures:reward_sees_extras", name="tokens", weight=0.25}]')


def test_a_local_run_logs_each_weighted_component_and_their_sum(make_config, tiny_model_dir, tmp_path, monkeypatch):
    from asyncrl.deploy.local import run_local

    monkeypatch.syspath_prepend(str(DATA))
    rm = build_reward_model(tiny_model_dir, tmp_path / "rm")
    cfg = make_config('reward.fn=""', f"reward.functions={FUNCTIONS}", f'reward.model="{rm}"',
                      "reward.model_weight=0.5", f'run.output_dir="{tmp_path / "run"}"')
    rows = run_local(cfg)
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["buffer/failed"] == 0 for r in train)
    names = ("prefix", "tokens", "reward_model")
    documented = {key.replace("<name>", name) for key in documented_metric_keys("Rewards") for name in names}
    for r in train:
        assert documented <= set(r), documented - set(r)
        assert 0.0 <= r["reward/prefix"] <= 1.0
        assert -1.0 <= r["reward/tokens"] <= 2.0  # -1 when cut at max_new_tokens = 2, else the token count
        weighted = r["reward/prefix"] + 0.25 * r["reward/tokens"] + 0.5 * r["reward/reward_model"]
        assert r["reward/mean"] == pytest.approx(weighted, abs=1e-4)
    evals = [r for r in rows if "eval/greedy_reward" in r]
    assert evals and all(r["eval/greedy_errors"] == 0 for r in evals)  # the evaluator scores the same way
