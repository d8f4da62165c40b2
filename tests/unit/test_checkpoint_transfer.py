"""asyncrl/checkpoints/transfer.py without Ray: folders moved in chunks between two folders standing for two nodes,
through NodeFiles' methods called as an actor's would be (`Node`). A fetched checkpoint verifies and equals the
trainer's; a chunk changed on the way, or a file that changes while copied, leaves nothing under the final name;
the relay fetches each save into RUN_DIR/checkpoints and prunes it to keep_last, ships a checkpoint only to a node
without a valid copy of it, and fetches the final export over an older one; it stands in only when a trainer rank
does not see the driver's marker file; `--local` refuses run.trainer_dir."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.checkpoints import store as checkpoint
from asyncrl.checkpoints import transfer
from asyncrl.checkpoints.transfer import CheckpointRelay, NodeFiles


class Node:
    """An actor handle as the driver sees it: `node.method.remote(*args)` is awaitable. `corrupt`: flip a byte of
    every chunk read from this node (a transfer gone wrong)."""

    def __init__(self, corrupt: bool = False) -> None:
        self.files, self.corrupt, self.calls = NodeFiles(), corrupt, []

    def __getattr__(self, name: str) -> Any:
        node = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                node.calls.append(name)
                return asyncio.ensure_future(node._call(name, args))

        return Method

    async def _call(self, name: str, args: tuple) -> Any:
        out = await getattr(self.files, name)(*args)
        if name == "files_read" and self.corrupt and out:
            out = bytes([out[0] ^ 1]) + out[1:]
        return out


def _save(root: Path, step: int, nbytes: int = 5000) -> Path:
    g = torch.Generator().manual_seed(step)
    return checkpoint.save(root, step=step, version=step, config_text="cfg",
                           tensors={"model": {"w": torch.randn(nbytes // 4, generator=g)}}, state={"step": step})


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK_BYTES", 1000)  # every file spans several chunks


def _same_files(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and \
        all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_a_fetched_checkpoint_verifies_and_holds_the_trainers_bytes(tmp_path):
    there = _save(tmp_path / "trainer" / "checkpoints", 3)
    here = tmp_path / "run" / "checkpoints" / there.name
    asyncio.run(transfer.fetch(Node(), str(there), here, hashes=False))
    assert checkpoint.verify(here).step == 3
    assert _same_files(there, here)
    assert [p.name for p in here.parent.iterdir()] == [there.name]  # no .tmp- folder left


def test_a_chunk_changed_on_the_way_leaves_no_checkpoint_under_its_name(tmp_path):
    there = _save(tmp_path / "trainer" / "checkpoints", 3)
    here = tmp_path / "run" / "checkpoints" / there.name
    with pytest.raises(checkpoint.CheckpointError):
        asyncio.run(transfer.fetch(Node(corrupt=True), str(there), here, hashes=False))
    assert list(here.parent.iterdir()) == []


def test_a_file_that_changes_size_while_copied_is_refused(tmp_path, monkeypatch):
    there = _save(tmp_path / "trainer" / "checkpoints", 3)
    files = transfer.list_files(there, hashes=False)
    grown = [(rel, size + 10 if rel.endswith(".safetensors") else size, sha) for rel, size, sha in files]
    monkeypatch.setattr(transfer, "list_files", lambda *a, **k: grown)
    here = tmp_path / "run" / "step"
    with pytest.raises(checkpoint.CheckpointError, match="changed while copied"):
        asyncio.run(transfer.fetch(Node(), str(there), here, hashes=False))
    assert not here.exists()


def test_file_names_that_leave_the_folder_are_refused(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="outside the folder"):
        transfer.write_chunk(tmp_path, "../escape", 0, b"x")
    with pytest.raises(checkpoint.CheckpointError, match="outside the folder"):
        transfer.read_chunk(tmp_path, "/etc/passwd", 0, 10)


class Trainer:
    """The trainer's proxy: saves with checkpoint.save under the root it is given (its own node's folder)."""

    def __init__(self) -> None:
        self.step, self.loaded = 0, []

    async def save_state(self, root: str, *, step: int, keep_last: int = 0, **_: Any) -> str:
        return str(_save(Path(root), step))

    async def load_state(self, path: str) -> int:
        self.loaded.append(path)
        return checkpoint.load(path).manifest.version

    async def evaluate(self) -> dict:
        return {"eval": 1.0}


def test_the_relay_fetches_every_save_into_run_dir_and_keeps_the_newest(tmp_path):
    node, run = Node(), tmp_path / "run" / "checkpoints"
    relay = CheckpointRelay(Trainer(), [(node, False)], str(tmp_path / "trainer"), keep_last=2)
    paths = [asyncio.run(relay.save_state(str(run), step=s, keep_last=2)) for s in (1, 2, 3)]
    assert paths == [str(run / f"step_{s:08d}") for s in (1, 2, 3)]
    assert [p.name for _, p in checkpoint.list_checkpoints(run)] == ["step_00000002", "step_00000003"]
    for _, p in checkpoint.list_checkpoints(run):
        checkpoint.verify(p)
        assert _same_files(tmp_path / "trainer" / "checkpoints" / p.name, p)
    assert asyncio.run(relay.evaluate()) == {"eval": 1.0}  # every other call goes to the trainer unchanged


def test_resume_ships_the_checkpoint_only_to_a_node_without_a_valid_copy(tmp_path):
    local = _save(tmp_path / "run" / "checkpoints", 4)
    there = tmp_path / "trainer" / "checkpoints" / local.name
    trainer, node = Trainer(), Node()
    relay = CheckpointRelay(trainer, [(node, False)], str(tmp_path / "trainer"), keep_last=2)
    assert asyncio.run(relay.load_state(str(local))) == 4
    assert trainer.loaded == [str(there)] and _same_files(local, there)
    node.calls.clear()
    asyncio.run(relay.load_state(str(local)))  # the same manifest there: nothing travels
    assert "files_write" not in node.calls
    (there / "model.safetensors").write_bytes(b"broken")  # a damaged copy on the trainer's node is replaced
    asyncio.run(relay.load_state(str(local)))
    assert "files_write" in node.calls and checkpoint.verify(there).step == 4


class Exporter(NodeFiles):
    """A trainer actor whose save_checkpoint writes an HF-like folder (a subfolder, an empty file)."""

    def __init__(self, content: bytes) -> None:
        self.content = content

    async def save_checkpoint(self, path: str) -> str:
        out = Path(path)
        (out / "critic").mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_bytes(self.content)
        (out / "critic" / "config.json").write_text("{}")
        (out / "empty.txt").write_bytes(b"")
        return path


def test_the_final_export_is_fetched_over_an_older_one(tmp_path):
    node = Node()
    node.files = Exporter(bytes(range(256)) * 20)
    old = tmp_path / "run" / "checkpoint"
    old.mkdir(parents=True)
    (old / "stale.bin").write_bytes(b"old")
    relay = CheckpointRelay(Trainer(), [(node, False)], str(tmp_path / "trainer"), keep_last=2)
    asyncio.run(relay.save_export(str(old)))
    assert _same_files(tmp_path / "trainer" / "checkpoint", old) and not (old / "stale.bin").exists()


def test_the_relay_stands_in_only_when_a_trainer_rank_does_not_see_the_run_directory(tmp_path):
    run, folder = tmp_path / "run", tmp_path / "trainer"
    same = asyncio.run(transfer.relay_for(Trainer(), [Node(), Node()], run_dir=str(run), trainer_dir="",
                                               keep_last=2, fresh=True))
    assert same is None  # both ranks found the driver's marker: shared storage, nothing travels
    old = _save(folder / "checkpoints", 7)  # an earlier run's, in the trainer's own folder
    kept = asyncio.run(transfer.relay_for(Trainer(), [Node()], run_dir=str(run), trainer_dir=str(folder),
                                               keep_last=2, fresh=False))
    assert isinstance(kept, CheckpointRelay) and old.exists()  # a resume keeps the trainer's copies
    fresh = asyncio.run(transfer.relay_for(Trainer(), [Node()], run_dir=str(run), trainer_dir=str(folder),
                                                keep_last=2, fresh=True))
    assert isinstance(fresh, CheckpointRelay) and not old.exists()  # a new run may save step 7 there again
    assert not [p for p in run.iterdir() if p.name.startswith(transfer.MARKER_PREFIX)]


def test_an_in_process_run_refuses_a_trainer_dir_in_one_line(make_config, tmp_path):
    from asyncrl.deploy.local import LocalDeployment

    with pytest.raises(ValueError, match=r"^run.trainer_dir = '.*': an in-process run \(--local\) writes run\.output"):
        LocalDeployment(make_config(f'run.trainer_dir="{tmp_path / "elsewhere"}"'))
