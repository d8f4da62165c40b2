"""Config loading: every problem is reported at once, one line each, naming the TOML path."""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import msgspec
import pytest

import asyncrl.deploy.placement as placement_mod
from asyncrl.config import ConfigError, config_to_toml, load_config
from asyncrl.config.schema import Config
from asyncrl.deploy.plan import ActorPlan, derived, plan_resources

DELETE = object()

BASE = {
    "model": {"path": "model", "build_tiny": {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2}},
    "data": {"path": "train.jsonl"},
    "rollout": {"group_size": 4},
    "trainer": {"prompts_per_step": 4, "mini_batches": 2, "micro_batch_size": 4, "lr": 1e-3},
    "buffer": {"rollout_capacity": 64, "train_capacity": 16},
}


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    """A run folder with a dataset, the fixture module on sys.path, and no GPU."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "data"))
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    monkeypatch.setattr(placement_mod, "cuda_available", lambda: False)
    return tmp_path


def write_config(edits: dict | None = None, name: str = "config.toml") -> Path:
    """BASE with dotted-path edits applied (DELETE removes a key), written as TOML."""
    raw = copy.deepcopy(BASE)
    for dotted, value in (edits or {}).items():
        *parents, last = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    path = Path(name)
    path.write_bytes(msgspec.toml.encode(raw))
    return path


def errors_of(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config(path, overrides)
    return exc.value.errors


def test_minimal_valid_config_loads_with_defaults():
    cfg = load_config(write_config())
    assert isinstance(cfg, Config)
    assert cfg.trainer.lr == 1e-3 and cfg.samples_per_step == 16
    assert cfg.model.build_tiny is not None and cfg.model.build_tiny.hidden_size == 32
    assert cfg.algorithm.advantage == "grpo"  # untouched sections take their defaults


CASES = [
    ("unknown_section", {"trainr": {"lr": 1e-3}}, "trainr: unknown section — did you mean 'trainer'?"),
    ("unknown_key", {"trainer.lrr": 1e-3}, "trainer.lrr: unknown key — did you mean 'lr'?"),
    ("unknown_nested_key", {"model.build_tiny.hiden_size": 64},
     "model.build_tiny.hiden_size: unknown key — did you mean 'hidden_size'?"),
    ("wrong_type", {"trainer.total_steps": "ten"},
     "trainer.total_steps: expected an integer >= 1, got 'ten' — train steps"),
    ("negative_lr", {"trainer.lr": -1.0},
     "trainer.lr: expected a number > 0, got -1.0 — AdamW learning rate, e.g. 1e-4"),
    ("wrong_type_with_range", {"rollout.top_p": "high"}, "rollout.top_p: expected a number > 0 and <= 1, got 'high'"),
    ("top_p_above_1", {"rollout.top_p": 1.5}, "rollout.top_p: expected a number <= 1, got 1.5"),
    ("top_k_zero", {"rollout.top_k": 0}, "rollout.top_k: 0 is not a valid top-k"),
    ("wrong_type_bool", {"data.shuffle": "yes"},
     "data.shuffle: expected true or false, got 'yes' — reshuffle the prompt order"),
    ("group_size_0", {"rollout.group_size": 0},
     "rollout.group_size: expected an integer >= 1, got 0 — samples per prompt"),
    ("bad_backend_literal", {"weight_sync.backend": "mpi"},
     "weight_sync.backend: expected one of 'auto', 'gloo', 'nccl', 'ipc', got 'mpi'"),
    ("literal_or_bool", {"logging.live": "yes"}, "logging.live: expected one of 'auto', true, false, got 'yes'"),
    ("list_element_type", {"trainer.betas": [0.9, "x"]}, "trainer.betas[1]: expected a number, got 'x'"),
    ("betas_out_of_range", {"trainer.betas": [0.9, 1.0]},
     "trainer.betas: [0.9, 1.0] — each of AdamW's [b1, b2] must be in [0, 1)"),
    ("section_not_a_table", {"trainer": 5}, "trainer: expected a table [trainer], got 5"),
    ("nested_not_a_table", {"model.build_tiny": 3}, "model.build_tiny: expected a table [model.build_tiny], got 3"),
    ("missing_model_path", {"model.path": DELETE},
     "model.path: missing required key — local Hugging Face model folder"),
    ("missing_model_section", {"model": DELETE}, "model: missing required section — add a [model] table"),
    ("model_folder_absent_without_build_tiny", {"model.build_tiny": DELETE},
     "model.path: folder 'model' does not exist"),
    ("mini_batches_not_dividing", {"trainer.mini_batches": 3},
     "trainer.mini_batches: 3 does not divide samples_per_step = trainer.prompts_per_step x rollout.group_size = "
     "4 x 4 = 16 — use a divisor of 16, e.g. 2"),
    ("rollout_capacity_too_small", {"buffer.rollout_capacity": 8},
     "buffer.rollout_capacity: 8 trajectories is less than one step"),
    ("train_capacity_too_small", {"buffer.train_capacity": 2},
     "buffer.train_capacity: 2 groups is less than one step (trainer.prompts_per_step = 4)"),
    ("both_path_and_source", {"data.source": "asyncrl_unit_fixtures:rows"},
     "data.path, data.source: set exactly one of them (both are set)"),
    ("neither_path_nor_source", {"data.path": DELETE},
     "data.path, data.source: set exactly one of them (neither is set)"),
    ("data_file_missing", {"data.path": "nope.jsonl"}, "data.path: file 'nope.jsonl' does not exist"),
    ("data_bad_suffix", {"data.path": "train.txt"}, "data.path: 'train.txt' must end in"),
    ("data_source_wrong_signature", {"data.path": DELETE, "data.source": "asyncrl_unit_fixtures:rows_without_seed"},
     "data.source: 'asyncrl_unit_fixtures:rows_without_seed' must be callable"),
    ("bad_reward_import_path", {"reward.fn": "no_such_module_xyz:score"},
     "reward.fn: cannot import module 'no_such_module_xyz'"),
    ("reward_wrong_signature", {"reward.fn": "asyncrl_unit_fixtures:reward_one_arg"},
     "reward.fn: 'asyncrl_unit_fixtures:reward_one_arg' has signature (text)"),
    ("unknown_reward_rule", {"reward.fn": "exact"}, "reward.fn: unknown reward rule 'exact'"),
    ("unknown_engine", {"rollout.engine": "vlm"}, "rollout.engine: unknown engine 'vlm' — did you mean 'vllm'?"),
    ("unknown_advantage", {"algorithm.advantage": "grop"},
     "algorithm.advantage: unknown advantage estimator 'grop' — did you mean 'grpo'?"),
    ("unknown_policy_loss", {"algorithm.policy_loss": "ppo"}, "algorithm.policy_loss: unknown policy loss 'ppo'"),
    ("unknown_loss_agg", {"algorithm.loss_agg": "token_mean"},
     "algorithm.loss_agg: unknown loss aggregation 'token_mean' — did you mean 'token-mean'?"),
    ("plan_exceeds_cluster", {"rollout.num_generators": 3},
     "cluster.num_cpus: the plan needs 2.25 CPUs (3 generators x 0.5, 1 trainer x 0.5, "
     "1 buffer x 0.25) but the local cluster has 2 — lower cluster.generator_cpus"),  # the scorer: in the buffer
    ("heads_not_dividing_hidden", {"model.build_tiny.hidden_size": 30},
     "model.build_tiny.num_heads: 4 does not divide model.build_tiny.hidden_size = 30"),
    ("odd_head_size", {"model.build_tiny.hidden_size": 36},
     "model.build_tiny.num_heads: head size hidden_size / num_heads = 9 must be even"),
    ("kv_heads_not_dividing_heads", {"model.build_tiny.num_kv_heads": 3},
     "model.build_tiny.num_kv_heads: 3 does not divide model.build_tiny.num_heads = 4"),
    ("more_experts_per_token_than_experts", {"model.build_tiny.experts_per_token": 5},
     "model.build_tiny.experts_per_token: 5 is more than model.build_tiny.num_experts = 4"),
    ("routing_replay_on_a_dense_model", {"algorithm.routing_replay": "rollout"},
     "algorithm.routing_replay: 'rollout' needs a mixture-of-experts model (qwen3_moe, qwen2_moe, mixtral, olmoe); "
     "model.path is 'qwen2', which routes nothing"),
    ("router_aux_loss_on_a_dense_model", {"trainer.router_aux_loss_coef": 0.001},
     "trainer.router_aux_loss_coef: 0.001 needs a mixture-of-experts model (qwen3_moe, qwen2_moe, mixtral, olmoe); "
     "model.path is 'qwen2', which routes nothing — set it to 0"),
    ("negative_router_aux_loss", {"trainer.router_aux_loss_coef": -0.1}, "trainer.router_aux_loss_coef"),
    ("routing_replay_on_sglang", {"algorithm.routing_replay": "measure", "model.build_tiny.arch": "olmoe",
                                  "rollout.engine": "sglang"},
     "algorithm.routing_replay: 'measure' needs an engine that records routing (rollout.engine = 'torch', or 'vllm'"),
    ("nccl_without_cuda", {"weight_sync.backend": "nccl"}, "weight_sync.backend: 'nccl' needs CUDA"),
    ("ipc_with_vllm", {"weight_sync.backend": "ipc", "rollout.engine": "vllm"},
     "weight_sync.backend: 'ipc' is unsupported with rollout.engine = 'vllm'"),
]


@pytest.mark.parametrize("edits, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_config_reports_one_line_naming_the_toml_path(edits, expected):
    errors = errors_of(write_config(edits))
    assert len(errors) == 1, errors
    assert expected in errors[0]
    assert "\n" not in errors[0] and "Traceback" not in errors[0]


def test_toml_syntax_error_names_file_and_line():
    path = Path("broken.toml")
    path.write_text('[model]\npath = "m"\n[trainer]\nlr = \n')
    (error,) = errors_of(path)
    assert error.startswith("broken.toml:4: TOML syntax error: Invalid value")


def test_missing_config_file_is_one_line():
    assert errors_of(Path("absent.toml")) == ["absent.toml: config file not found"]


def test_malformed_set_names_the_override():
    errors = errors_of(write_config(), ("trainer.lr",))
    assert errors == ["--set trainer.lr: expected section.key=value, e.g. trainer.lr=1e-4"]


def test_set_into_a_value_is_an_error():
    (error,) = errors_of(write_config(), ("trainer.lr.x=1",))
    assert error.startswith("--set trainer.lr.x=1: trainer.lr is a value, not a table")


def test_three_problems_give_three_lines():
    path = write_config({"trainer.lr": -1.0, "rollout.engine": "nope", "buffer.train_capacity": 1})
    errors = errors_of(path)
    assert len(errors) == 3, errors
    assert [e.split(":")[0] for e in errors] == ["trainer.lr", "rollout.engine", "buffer.train_capacity"]
    assert str(ConfigError(errors)) == "\n".join(errors)


def test_set_overrides_apply_as_toml_values_or_plain_strings():
    cfg = load_config(write_config(), ("trainer.lr=1e-4", "rollout.stop_token_ids=[2,3]", "run.output_dir=runs/x",
                                       "model.build_tiny.num_layers=3", "data.shuffle=false"))
    assert cfg.trainer.lr == 1e-4 and cfg.rollout.stop_token_ids == [2, 3]
    assert cfg.run.output_dir == "runs/x" and cfg.model.build_tiny.num_layers == 3 and cfg.data.shuffle is False


def test_set_overrides_are_validated_like_the_file():
    errors = errors_of(write_config(), ("trainer.lr=-1", "trainer.nope=1"))
    assert errors[0].startswith("trainer.nope: unknown key")
    assert errors[1].startswith("trainer.lr: expected a number > 0, got -1")


def test_field_error_skips_cross_checks_that_read_it():
    # group_size = 0 would also fail divisibility and capacity maths; only the field itself is reported
    errors = errors_of(write_config({"rollout.group_size": 0, "trainer.mini_batches": 3}))
    assert len(errors) == 1 and errors[0].startswith("rollout.group_size:")


def test_truncated_sampling_is_a_warning_not_an_error(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        cfg = load_config(write_config({"rollout.top_p": 0.9, "rollout.top_k": 20}))
    assert cfg.rollout.top_p == 0.9
    assert "rollout.top_p = 0.9" in caplog.text and "behaviour logprobs" in caplog.text


def test_eval_every_beyond_total_steps_is_allowed():
    assert load_config(write_config({"trainer.eval_every": 500, "trainer.total_steps": 5})).trainer.eval_every == 500


def test_nccl_is_accepted_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(placement_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(placement_mod, "gpu_count", lambda: 2)
    cfg = load_config(write_config({"weight_sync.backend": "nccl", "cluster.trainer_gpus": 1,
                                    "cluster.generator_gpus": 1}))
    assert cfg.weight_sync.backend == "nccl"


def test_ipc_is_accepted_with_the_torch_engine_and_without_cuda():
    assert load_config(write_config({"weight_sync.backend": "ipc"})).weight_sync.backend == "ipc"


def test_existing_model_folder_needs_config_json_without_build_tiny(workdir):
    (workdir / "model").mkdir()
    (error,) = errors_of(write_config({"model.build_tiny": DELETE}))
    assert error.startswith("model.path: 'model' has no config.json")
    (workdir / "model" / "config.json").write_text("{}")
    assert load_config(write_config({"model.build_tiny": DELETE})).model.build_tiny is None


def test_a_subsystem_check_that_cannot_import_is_one_line_and_the_other_checks_still_run(monkeypatch):
    """asyncrl/config/checks.py names each subsystem's check by import path: a module that fails to import is
    reported as one line naming the keys it checks, not a traceback, and every other check still runs."""
    monkeypatch.delitem(sys.modules, "asyncrl.algorithms.checks", raising=False)
    monkeypatch.setitem(sys.modules, "asyncrl.algorithms.checks", None)  # import raises ImportError
    errors = errors_of(write_config({"rollout.engine": "vlm"}))
    assert errors[0] == "rollout.engine: unknown engine 'vlm' — did you mean 'vllm'? available: sglang, torch, vllm"
    assert [e.partition(":")[0] for e in errors[1:]] == ["algorithm", "algorithm"]
    assert all("check failed: ValueError: cannot import module 'asyncrl.algorithms.checks'" in e for e in errors[1:])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_colocated_placement_with_an_engine_that_cannot_sleep_is_one_line_naming_the_fix(engine):
    (error,) = errors_of(write_config({"cluster.placement": "colocated", "rollout.engine": engine}))
    assert error.startswith("cluster.placement: 'colocated' needs an engine that releases its K/V cache")
    assert f"rollout.engine = {engine!r}" in error and "use rollout.engine = 'torch'" in error
    assert load_config(write_config({"cluster.placement": "colocated"})).cluster.placement == "colocated"


def test_placement_is_not_checked_against_an_existing_cluster():
    cfg = load_config(write_config({"rollout.num_generators": 8, "cluster.address": "10.0.0.1:6379"}))
    assert derived(cfg)["cpus_requested"] == 4.75 and derived(cfg)["cpus_available"] is None


def test_plan_resources_lists_every_role_with_its_cpus():
    cfg = load_config(write_config({"rollout.num_generators": 2, "reward.num_scorers": 1,
                                    "cluster.scorer_placement": "actor"}))
    assert plan_resources(cfg) == [
        ActorPlan(role="generator", count=2, cpus=0.5), ActorPlan(role="scorer", count=1, cpus=0.25),
        ActorPlan(role="trainer", count=1, cpus=0.5), ActorPlan(role="buffer", count=1, cpus=0.25),
    ]
    assert sum(p.total_cpus for p in plan_resources(cfg)) == 2.0


def test_scorers_placed_in_the_buffer_ask_for_no_actors_or_cpus():
    cfg = load_config(write_config({"reward.num_scorers": 2, "cluster.scorer_placement": "buffer"}))
    scorer = next(p for p in plan_resources(cfg) if p.role == "scorer")
    assert scorer.count == 0 and derived(cfg)["cpus_requested"] == 1.25
    with pytest.raises(ConfigError, match="scorer_placement"):
        load_config(write_config({"cluster.scorer_placement": "driver"}))


def test_derived_numbers_for_a_known_config():
    cfg = load_config(write_config({"trainer.prompts_per_step": 8, "rollout.group_size": 4, "trainer.mini_batches": 4,
                                    "trainer.epochs": 2, "trainer.micro_batch_size": 3, "staleness.max_staleness": 2}))
    d = derived(cfg)
    assert d["samples_per_step"] == 32
    assert d["optimizer_steps_per_train_step"] == 8
    assert d["samples_per_mini_batch"] == 8 and d["micro_batches_per_mini_batch"] == 3
    assert d["max_groups_in_flight"] == 24 and d["max_samples_in_flight"] == 96
    assert d["rollout_queue_capacity_samples"] == 64 and d["train_store_capacity_groups"] == 16
    assert d["cpus_requested"] == 1.25 and d["cpus_available"] == 2.0  # the scorer: in the buffer actor (auto)
    assert d["weight_sync_backend"] == "gloo"  # auto without CUDA
    assert [a["role"] for a in d["actors"]] == ["generator", "scorer", "trainer", "buffer"]


def test_config_to_toml_round_trips(workdir):
    cfg = load_config(write_config(), ("rollout.stop_token_ids=[2,3]", "trainer.lr=3e-5", "run.output_dir=runs/x"))
    path = workdir / "resolved.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg


def test_config_to_toml_omits_unset_optional_tables(workdir):
    (workdir / "model").mkdir()
    (workdir / "model" / "config.json").write_text("{}")
    cfg = load_config(write_config({"model.build_tiny": DELETE}))
    text = config_to_toml(cfg)
    assert "build_tiny" not in text
    path = workdir / "resolved.toml"
    path.write_text(text)
    assert load_config(path) == cfg


RANK_CASES = [
    ("ranks_not_dividing_a_mini_batch", {"trainer.num_ranks": 3, "cluster.num_cpus": 4},
     "trainer.num_ranks: 3 does not divide a mini-batch of samples_per_step / trainer.mini_batches = 16 / 2 = 8 "
     "samples (each rank trains an equal share) — use a divisor of 8, e.g. 2"),
    ("ranks_beyond_the_cluster", {"trainer.num_ranks": 4},
     "cluster.num_cpus: the plan needs 2.75 CPUs (1 generator x 0.5, 4 trainers x 0.5, 1 buffer x "
     "0.25) but the local cluster has 2"),
    ("ranks_colocated", {"trainer.num_ranks": 2, "cluster.placement": "colocated"},
     "trainer.num_ranks: 2 trainer ranks cannot share the one colocated device"),
    ("unknown_parallel_mode", {"trainer.parallel": "fsdp"}, "trainer.parallel"),
    ("no_ranks", {"trainer.num_ranks": 0}, "trainer.num_ranks"),
]


@pytest.mark.parametrize("edits, expected", [c[1:] for c in RANK_CASES], ids=[c[0] for c in RANK_CASES])
def test_a_trainer_rank_mistake_is_one_line_naming_the_fix(edits, expected):
    errors = errors_of(write_config(edits))
    assert len(errors) == 1, errors
    assert expected in errors[0], errors[0]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_trainer_ranks_are_planned_as_two_trainer_actors(mode):
    # with evaluation, checkpoints and the HF export in either mode (fsdp2: sharded checkpoints, gathered export)
    edits = {"trainer.eval_every": 5, "run.save_every": 2, "run.save_checkpoint": True}
    cfg = load_config(write_config({"trainer.num_ranks": 2, "trainer.parallel": mode, **edits}))
    assert (cfg.trainer.num_ranks, cfg.trainer.parallel) == (2, mode)
    trainer = next(p for p in plan_resources(cfg) if p.role == "trainer")
    assert (trainer.count, trainer.total_cpus) == (2, 1.0)
    assert (load_config(write_config()).trainer.num_ranks, load_config(write_config()).trainer.parallel) == (1, "ddp")

