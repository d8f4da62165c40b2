"""asyncrl.checkpoints.store: atomic saves, verification (a flipped byte anywhere is detected), keep_last, no
pickle, and bit-exact round trips of optimizer, scheduler and RNG state."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import random
import shutil

import msgspec
import numpy as np
import pytest
import torch

from asyncrl.checkpoints import store as ck
from asyncrl.checkpoints.store import CheckpointError

CONFIG = '[trainer]\nlr = 0.01\n'


def save(root, step, *, keep_last=0, **kw):
    tensors = kw.pop("tensors", {"model": {"w": torch.full((3, 2), float(step))}})
    return ck.save(root, step=step, version=step, config_text=CONFIG, tensors=tensors,
                   state=kw.pop("state", {"step": step}), keep_last=keep_last)


def steps(root):
    return [s for s, _ in ck.list_checkpoints(root)]


def flip_byte(path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------- save / load


def test_round_trip_keeps_every_tensor_dtype_shape_and_value_and_the_state(tmp_path):
    w = torch.randn(4, 3)
    tensors = {"model": {"w": w, "tied": w, "t": w.t(), "half": w.bfloat16(), "idx": torch.arange(5),
                         "scalar": torch.tensor(7.0), "empty": torch.zeros(0, 3)},
               "rng": {"cpu": torch.get_rng_state()}}
    state = {"gate": {"admitted": 12, "ratio": 0.25, "inf": float("inf")}, "ids": [1, 2], "none": None,
             "raw": b"\x00\xff"}
    path = ck.save(tmp_path, step=42, version=7, config_text=CONFIG, tensors=tensors, state=state)
    assert path == tmp_path / "step_00000042"
    got = ck.load(path)
    assert got.manifest.step == 42 and got.manifest.version == 7
    assert got.manifest.config_sha256 == ck.config_sha256(CONFIG)
    assert set(got.manifest.files) == {"model.safetensors", "rng.safetensors", "state.msgpack"}
    assert got.state == state
    for group, named in tensors.items():
        assert set(got.tensors[group]) == set(named)
        for name, t in named.items():
            assert got.tensors[group][name].dtype == t.dtype and torch.equal(got.tensors[group][name], t)
    assert tensors["model"]["w"] is w  # the caller's tensors are left as they were


def test_the_manifest_is_json_readable_by_anyone(tmp_path):
    path = save(tmp_path, 3)
    manifest = msgspec.json.decode((path / "manifest.json").read_bytes())
    assert manifest["step"] == 3 and manifest["format_version"] == ck.FORMAT_VERSION
    assert set(manifest["files"]["state.msgpack"]) == {"bytes", "sha256"}


def test_load_never_unpickles(tmp_path, monkeypatch):
    path = save(tmp_path, 1)

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling attempted")

    for module, name in [(pickle, "load"), (pickle, "loads"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)
    assert ck.load(path).tensors["model"]["w"][0, 0] == 1.0


def test_saving_a_step_that_already_verifies_is_refused_and_leaves_it_intact(tmp_path):
    path = save(tmp_path, 5)
    before = (path / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        save(tmp_path, 5, state={"other": 1})
    assert (path / "manifest.json").read_bytes() == before and ck.load(path).state == {"step": 5}


def test_an_invalid_folder_at_the_same_step_is_replaced(tmp_path):
    path = save(tmp_path, 5)
    (path / "manifest.json").unlink()
    save(tmp_path, 5, state={"again": True})
    assert ck.load(path).state == {"again": True}


def test_files_a_write_callback_adds_are_sealed_in_the_manifest_and_its_state_recorded(tmp_path):
    def write(tmp):  # what a sharded trainer's ranks do: their own files, in a sub-folder
        (tmp / "shards").mkdir()
        for r in (1, 2):
            (tmp / "shards" / f"shard-{r}.safetensors").write_bytes(bytes([r]) * 100)
        return {"sharded": {"world_size": 2}}

    path = ck.save(tmp_path, step=3, version=3, config_text=CONFIG, tensors={"rng": {"s": torch.ones(2)}},
                   state={"version": 3}, write=write)
    got = ck.load(path)
    assert set(got.manifest.files) == {"shards/shard-1.safetensors", "shards/shard-2.safetensors",
                                       "rng.safetensors", "state.msgpack"}
    assert got.state == {"version": 3, "sharded": {"world_size": 2}}
    assert set(got.tensors) == {"rng"}  # a sub-folder's files are their writer's to read
    (path / "shards" / "shard-2.safetensors").write_bytes(bytes([2]) * 99)
    with pytest.raises(CheckpointError, match="shard-2.safetensors: 99 bytes, the manifest says 100"):
        ck.verify(path)
    assert ck.latest_valid(tmp_path) is None


def test_a_write_callback_that_fails_or_writes_a_reserved_name_leaves_no_checkpoint(tmp_path):
    save(tmp_path, 1)

    def fails(tmp):
        (tmp / "shards").mkdir()
        (tmp / "shards" / "half").write_bytes(b"x")
        raise RuntimeError("trainer rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        ck.save(tmp_path, step=2, version=2, config_text=CONFIG, write=fails)
    with pytest.raises(CheckpointError, match="state.msgpack: `write` left a file the checkpoint writes itself"):
        ck.save(tmp_path, step=2, version=2, config_text=CONFIG, write=lambda tmp: (tmp / "state.msgpack").touch())
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]


# ---------------------------------------------------------------- atomicity


def test_a_save_failing_on_an_unserializable_tensor_leaves_no_trace(tmp_path):
    good = [save(tmp_path, s) for s in (1, 2)]
    bad = {"model": {"w": torch.ones(2)}, "optimizer": {"x": "not a tensor"}}  # fails on the second group
    with pytest.raises(CheckpointError, match="'optimizer'.*not a Tensor"):
        save(tmp_path, 3, tensors=bad, keep_last=1)
    assert steps(tmp_path) == [1, 2] and [ck.load(p).state for p in good] == [{"step": 1}, {"step": 2}]
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]  # no temporary folder either


@pytest.mark.parametrize("where", ["safetensors.torch.save_file", "os.fsync", "os.rename"])
def test_an_oserror_anywhere_in_a_save_keeps_the_previous_checkpoints_and_creates_no_step_folder(
        tmp_path, monkeypatch, where):
    save(tmp_path, 1)
    save(tmp_path, 2)
    module, name = where.rsplit(".", 1)
    import safetensors.torch  # the module store.save imports when it writes tensors

    target = {"safetensors.torch": safetensors.torch, "os": os}[module]
    real, calls = getattr(target, name), []

    def fail_late(*args, **kwargs):  # let the first call through, so the save fails halfway
        calls.append(1)
        if len(calls) > 1 or name == "rename":
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fail_late)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path, 3, tensors={"a": {"x": torch.ones(2)}, "b": {"y": torch.ones(2)}}, keep_last=1)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]
    assert ck.latest_valid(tmp_path) == tmp_path / "step_00000002"


def test_leftover_temporary_folders_of_a_crashed_save_are_removed_by_the_next_save(tmp_path):
    save(tmp_path, 1)
    crashed = tmp_path / ".tmp-step_00000002-deadbeef"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"half")
    assert ck.latest_valid(tmp_path) == tmp_path / "step_00000001"
    save(tmp_path, 3)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]


# ---------------------------------------------------------------- detection


def test_every_kind_of_damage_is_named_by_verify(tmp_path):
    cases = {
        "missing": lambda p: (p / "model.safetensors").unlink(),
        "truncated": lambda p: (p / "state.msgpack").write_bytes(b""),
        "no manifest": lambda p: (p / "manifest.json").unlink(),
        "edited manifest": lambda p: (p / "manifest.json").write_bytes(
            (p / "manifest.json").read_bytes().replace(b'"version":4', b'"version":5')),
        "renamed folder": lambda p: p.rename(p.with_name("step_00000009")),
    }
    expected = {"missing": "model.safetensors: missing", "truncated": "state.msgpack: 0 bytes",
                "no manifest": "cannot read the manifest", "edited manifest": "checksum",
                "renamed folder": "records step 4"}
    for kind, damage in cases.items():
        root = tmp_path / kind.replace(" ", "_")
        path = save(root, 4)
        damage(path)
        damaged = ck.list_checkpoints(root)[0][1]
        with pytest.raises(CheckpointError, match=expected[kind]):
            ck.verify(damaged)
        with pytest.raises(CheckpointError, match=expected[kind]):
            ck.load(damaged)


def test_one_flipped_byte_in_any_file_is_always_detected(tmp_path):
    rng = random.Random(16)
    pristine = save(tmp_path / "pristine", 4,
                    tensors={"model": {"w": torch.randn(8, 4)}, "optimizer": {"m": torch.randn(8)}},
                    state={"lr": 0.01, "seen": list(range(20))})
    files = sorted(os.listdir(pristine))
    for trial in range(60):
        path = tmp_path / f"trial{trial}" / pristine.name
        shutil.copytree(pristine, path)
        ck.verify(path)
        name = rng.choice(files)
        flip_byte(path / name, rng)
        with pytest.raises(CheckpointError):
            ck.verify(path)
        assert ck.latest_valid(path.parent) is None, name


def test_latest_valid_skips_newer_corrupt_and_partial_checkpoints_and_says_why(tmp_path, caplog):
    for s in (1, 2, 3):
        save(tmp_path, s)
    flip_byte(tmp_path / "step_00000003" / "model.safetensors", random.Random(0))
    (tmp_path / "step_00000004").mkdir()  # partial: no manifest
    with caplog.at_level(logging.WARNING, logger="asyncrl.checkpoints.store"):
        assert ck.latest_valid(tmp_path) == tmp_path / "step_00000002"
    assert "step_00000004" in caplog.text and "cannot read the manifest" in caplog.text
    assert "step_00000003" in caplog.text and "model.safetensors" in caplog.text
    assert ck.latest_valid(tmp_path / "nowhere") is None


# ---------------------------------------------------------------- keep_last


def test_keep_last_keeps_only_the_newest_checkpoints(tmp_path):
    for s in range(1, 6):
        save(tmp_path, s, keep_last=2)
    assert steps(tmp_path) == [4, 5]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


@pytest.mark.parametrize("keep_last", [0, -1])
def test_keep_last_zero_or_negative_keeps_all(tmp_path, keep_last):
    for s in range(1, 5):
        save(tmp_path, s, keep_last=keep_last)
    assert steps(tmp_path) == [1, 2, 3, 4]


def test_keep_last_counts_only_valid_checkpoints_so_a_corrupt_one_never_displaces_a_good_one(tmp_path):
    for s in (1, 2, 3):
        save(tmp_path, s)
    (tmp_path / "step_00000003" / "state.msgpack").write_bytes(b"rot")
    save(tmp_path, 4, keep_last=2)
    assert steps(tmp_path) == [2, 3, 4]  # 2 is the newest valid one before 4; corrupt 3 waits its turn
    assert ck.latest_valid(tmp_path) == tmp_path / "step_00000004"
    save(tmp_path, 5, keep_last=2)
    assert steps(tmp_path) == [4, 5]


def test_keep_last_never_deletes_a_newer_step_than_the_one_saved(tmp_path):
    for s in (1, 2, 5):
        save(tmp_path, s)
    save(tmp_path, 3, keep_last=1)  # e.g. resumed from step 2
    assert steps(tmp_path) == [3, 5]


# ---------------------------------------------------------------- optimizer, scheduler, RNG


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(model, optimizer, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-2),
    lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False, fused=False),
    lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True, amsgrad=True, betas=(0.8, 0.95)),
    lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2), foreach=False),
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
], ids=["adamw", "adamw-for-loop", "adamw-foreach-amsgrad", "adamw-tensor-lr", "sgd-nesterov"])
def test_optimizer_state_round_trips_through_a_checkpoint_bit_exactly(tmp_path, make):
    model = _tiny_model()
    optimizer = make(model.parameters())
    _train(model, optimizer, 3, seed=1)
    tensors, meta = ck.optimizer_state(optimizer)
    path = ck.save(tmp_path, step=3, version=3, config_text=CONFIG, tensors={"optimizer": tensors},
                   state={"optimizer": meta, "model": None})
    reloaded_model = copy.deepcopy(model)
    reloaded = make(reloaded_model.parameters())
    got = ck.load(path)
    ck.load_optimizer_state(reloaded, got.tensors["optimizer"], got.state["optimizer"])
    assert reloaded.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    _train(model, optimizer, 2, seed=2)
    _train(reloaded_model, reloaded, 2, seed=2)
    for a, b in zip(model.parameters(), reloaded_model.parameters(), strict=True):
        assert torch.equal(a, b)


def _schedulers(optimizer):
    from transformers import get_scheduler

    return [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)),
            get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=10)]


def test_scheduler_state_round_trips_lambda_lr_and_transformers_cosine(tmp_path):
    model = _tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedulers = _schedulers(optimizer)
    for _ in range(3):
        optimizer.step()
        for s in schedulers:
            s.step()
    path = ck.save(tmp_path, step=3, version=3, config_text=CONFIG,
                   state={"schedulers": [ck.scheduler_state(s) for s in schedulers]})
    fresh_optimizer = torch.optim.AdamW(_tiny_model().parameters(), lr=1e-2)
    fresh = _schedulers(fresh_optimizer)
    for s, state in zip(fresh, ck.load(path).state["schedulers"], strict=True):
        ck.load_scheduler_state(s, state)
    for _ in range(4):
        for opt, group in ((optimizer, schedulers), (fresh_optimizer, fresh)):
            opt.step()
            for s in group:
                s.step()
        assert [s.get_last_lr() for s in fresh] == [s.get_last_lr() for s in schedulers]
    assert fresh[0].last_epoch == schedulers[0].last_epoch == 7


def test_a_scheduler_holding_an_object_is_refused_with_its_name():
    class Odd(torch.optim.lr_scheduler.LambdaLR):
        def state_dict(self):
            return {"fn": object()}

    optimizer = torch.optim.SGD(_tiny_model().parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="Odd state is not msgspec-encodable"):
        ck.scheduler_state(Odd(optimizer, lambda s: 1.0))


def _draw():
    return (torch.rand(5).tolist(), torch.randn(2).tolist(), random.random(), random.gauss(0, 1),
            np.random.rand(3).tolist(), np.random.standard_normal(), np.random.randint(0, 10**6))


def test_rng_state_restores_torch_python_and_numpy_streams(tmp_path):
    random.gauss(0, 1)  # leave a cached second gaussian in both Python and numpy
    np.random.standard_normal()
    tensors, meta = ck.rng_state()
    path = ck.save(tmp_path, step=1, version=1, config_text=CONFIG, tensors={"rng": tensors}, state={"rng": meta})
    first = _draw()
    got = ck.load(path)
    ck.set_rng_state(got.tensors["rng"], got.state["rng"])
    assert _draw() == first
    assert _draw() != first  # the streams move on


def test_a_state_msgspec_cannot_encode_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match="not msgspec-encodable"):
        ck.save(tmp_path, step=1, version=1, config_text=CONFIG, state={"x": object()})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- HF export


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
def test_export_hf_writes_a_loadable_copy_in_the_asked_dtype_without_changing_the_model(
        tmp_path, tiny_model_dir, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.hf import load_model, load_tokenizer

    model = load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = ck.export_hf(model, tmp_path / "export", tokenizer=load_tokenizer(tiny_model_dir), dtype=dtype)
    assert model.dtype == torch.float32 and str(model.config.dtype).endswith("float32")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    want = getattr(torch, dtype or "float32")
    assert loaded.dtype == want
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, before[name].to(want)), name
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).encode("12+3") == \
        load_tokenizer(tiny_model_dir).encode("12+3")
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_export_hf_replaces_an_older_export(tmp_path, tiny_model_dir):
    from engines.hf import load_model

    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    ck.export_hf(load_model(tiny_model_dir), out)
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
