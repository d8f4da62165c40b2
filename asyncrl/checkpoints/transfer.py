"""Checkpoints between the trainer's node and the driver's run directory, through Ray, when they share no storage.

Place in the dataflow (Ray runs only):

    Controller ── save_state / load_state ──► CheckpointRelay (the deployment's `trainer`) ──► trainer actor
    deployment.save_checkpoint (final HF export) ──► CheckpointRelay.save_export ──────────────► trainer actor
                                                    ◄── fetch: the written folder, in chunks ──┘ (NodeFiles)
                                                    ── push: the checkpoint to resume from ───►

The trainer writes checkpoints (asyncrl/checkpoints/store.py) and the final export on its own node, under
`run.trainer_dir` (empty: `run.output_dir`, the same path as the driver's). Whether the driver sees what the
trainer writes is decided once per deployment, not assumed from the node ids: the driver writes a marker file with a
random token into RUN_DIR and each trainer rank looks for it under its folder (`relay_for`). Seen: the storage is
shared (or both are on one node) and nothing changes. Not seen (another node without shared storage, or
`run.trainer_dir` naming another folder): the deployment's `trainer` becomes a CheckpointRelay, which

    save_state    asks rank 0 to write the checkpoint under its folder, fetches the folder into RUN_DIR/checkpoints
                  with checkpoint.py's layout rules (written into a `.tmp-` folder, every file fsynced, `verify`
                  passed, renamed into place, the parent fsynced) and prunes RUN_DIR/checkpoints to run.keep_last;
    load_state    (`--resume`, and the automatic resume after the trainer died) ships the driver's checkpoint to
                  every trainer rank whose folder lacks a copy with the same manifest, then loads that copy;
    save_export   asks rank 0 for the HF export under its folder and fetches it into RUN_DIR/checkpoint, each file
                  checked against the sha256 the trainer listed.

A fresh run (no --resume) first removes the checkpoints a trainer rank's folder holds from an earlier run (the
driver's RUN_DIR is the run's record; the trainer's folder is its working copy, and checkpoint.save refuses to
overwrite a valid step). Files travel in chunks of CHUNK_BYTES, at most two in flight, so a checkpoint of any size
never sits whole in the object store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from asyncrl.checkpoints import store as checkpoint

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 2**20
IN_FLIGHT = 2  # chunk calls outstanding: the next chunk travels while this one is written
MARKER_PREFIX = ".asyncrl-shared-"
EXPORT = "checkpoint"  # RUN_DIR/checkpoint: the final HF export (run.save_checkpoint)

FileList = list[tuple[str, int, str]]  # (path relative to the folder, bytes, sha256 or "" when a manifest covers it)


# ---------------------------------------------------------------- one node's side (plain functions, blocking)


def list_files(folder: str | Path, *, hashes: bool) -> FileList:
    """Every file under `folder` (recursively, sorted); sha256 each when `hashes` (an HF export has no manifest)."""
    root = Path(folder)
    if not root.is_dir():
        raise checkpoint.CheckpointError(f"{root}: no such folder on this node")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return [(p.relative_to(root).as_posix(), p.stat().st_size, checkpoint.file_sha256(p) if hashes else "")
            for p in files]


def read_chunk(folder: str | Path, rel: str, offset: int, length: int) -> bytes:
    with open(_inside(folder, rel), "rb") as f:
        f.seek(offset)
        return f.read(length)


def open_tmp(final: str | Path) -> str:
    """A fresh `.tmp-` folder beside `final` to receive into (checkpoint.save removes leftovers of this name)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent)


def write_chunk(tmp: str | Path, rel: str, offset: int, data: bytes) -> None:
    path = _inside(tmp, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)


def commit(tmp: str | Path, final: str | Path, files: FileList) -> None:
    """Check what arrived in `tmp` (a checkpoint: `checkpoint.verify`; else each file's size and sha256 against
    `files`), fsync it, and rename it to `final`, replacing what is there. Any failure removes `tmp` and raises
    CheckpointError; `final` is then untouched."""
    tmp, final = Path(tmp), Path(final)
    try:
        got = {rel: (size, sha) for rel, size, sha in list_files(tmp, hashes=False)}
        if set(got) != {rel for rel, _, _ in files}:
            raise checkpoint.CheckpointError(f"{final}: received files {sorted(got)}, expected {[f[0] for f in files]}")
        for rel, size, sha in files:
            if got[rel][0] != size:
                raise checkpoint.CheckpointError(f"{final / rel}: {got[rel][0]} bytes arrived, {size} were sent")
            with open(tmp / rel, "rb") as f:
                os.fsync(f.fileno())
            if sha and checkpoint.file_sha256(tmp / rel) != sha:
                raise checkpoint.CheckpointError(f"{final / rel}: sha256 differs from the sender's")
        if checkpoint.MANIFEST in got:
            checkpoint.verify(tmp)  # every listed file against the manifest, the manifest against itself
        checkpoint.fsync_dir(tmp)
        if final.exists():
            checkpoint._discard(final)  # renamed aside first: no half-deleted folder under its own name
        os.rename(tmp, final)
        checkpoint.fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def manifest_bytes(folder: str | Path) -> bytes | None:
    """The manifest of the checkpoint at `folder` if it is there and verifies, else None."""
    try:
        checkpoint.verify(folder)
    except checkpoint.CheckpointError:
        return None
    return (Path(folder) / checkpoint.MANIFEST).read_bytes()


def clear_checkpoints(root: str | Path) -> list[str]:
    """Remove the checkpoint folders (and leftovers of interrupted saves) under `root`; -> their names."""
    return checkpoint.clear(root)


class NodeFiles:
    """The file calls a driver makes to an actor on another node (RoleActor inherits them). Each runs on a worker
    thread: hashing or writing a large file must not block the actor's event loop."""

    async def files_probe(self, folder: str, name: str, token: str) -> bool:
        """Whether `folder/name` holds `token` here: the driver wrote it into its run directory (`relay_for`)."""
        def seen() -> bool:
            try:
                return (Path(folder) / name).read_text() == token
            except OSError:
                return False
        return await asyncio.to_thread(seen)

    async def files_list(self, folder: str, hashes: bool) -> FileList:
        return await asyncio.to_thread(list_files, folder, hashes=hashes)

    async def files_read(self, folder: str, rel: str, offset: int, length: int) -> bytes:
        return await asyncio.to_thread(read_chunk, folder, rel, offset, length)

    async def files_open(self, final: str) -> str:
        return await asyncio.to_thread(open_tmp, final)

    async def files_write(self, tmp: str, rel: str, offset: int, data: bytes) -> None:
        await asyncio.to_thread(write_chunk, tmp, rel, offset, data)

    async def files_commit(self, tmp: str, final: str, files: FileList) -> None:
        await asyncio.to_thread(commit, tmp, final, files)

    async def files_manifest(self, folder: str) -> bytes | None:
        return await asyncio.to_thread(manifest_bytes, folder)

    async def files_clear(self, root: str) -> list[str]:
        return await asyncio.to_thread(clear_checkpoints, root)


# ---------------------------------------------------------------- moving a folder (the driver's side)


async def fetch(node: Any, src: str, dst: Path, *, hashes: bool) -> None:
    """Copy folder `src` of `node` (an actor handle with NodeFiles' methods) to `dst` here, atomically (`commit`)."""
    files = await node.files_list.remote(src, hashes)
    tmp = await asyncio.to_thread(open_tmp, dst)

    def ask(rel: str, offset: int) -> Awaitable[bytes]:
        return node.files_read.remote(src, rel, offset, CHUNK_BYTES)

    async def store(rel: str, offset: int, data: bytes) -> None:
        await asyncio.to_thread(write_chunk, tmp, rel, offset, data)

    try:
        await _stream(files, ask, store)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    await asyncio.to_thread(commit, tmp, dst, files)


async def push(node: Any, src: Path, dst: str) -> None:
    """Copy folder `src` here to `dst` on `node`, atomically there (`commit` on the node)."""
    files = await asyncio.to_thread(list_files, src, hashes=not (src / checkpoint.MANIFEST).is_file())
    tmp = await node.files_open.remote(dst)

    def ask(rel: str, offset: int) -> Awaitable[bytes]:
        return asyncio.ensure_future(asyncio.to_thread(read_chunk, src, rel, offset, CHUNK_BYTES))

    async def store(rel: str, offset: int, data: bytes) -> None:
        await node.files_write.remote(tmp, rel, offset, data)

    await _stream(files, ask, store)  # a failure leaves a `.tmp-` folder there: the next save there removes it
    await node.files_commit.remote(tmp, dst, files)


async def _stream(files: FileList, ask: Callable[[str, int], Awaitable[bytes]],
                  store: Callable[[str, int, bytes], Awaitable[None]]) -> None:
    """Every chunk of every file: asked for IN_FLIGHT ahead, stored in order."""
    chunks: Iterator[tuple[str, int, int]] = ((rel, off, size) for rel, size, _ in files
                                              for off in range(0, max(size, 1), CHUNK_BYTES))
    pending: deque[tuple[str, int, int, Awaitable[bytes]]] = deque()
    for rel, off, size in chunks:
        pending.append((rel, off, size, ask(rel, off)))
        if len(pending) >= IN_FLIGHT:
            await _store_next(pending, store)
    while pending:
        await _store_next(pending, store)


async def _store_next(pending: deque, store: Callable[[str, int, bytes], Awaitable[None]]) -> None:
    rel, off, size, asked = pending.popleft()
    data = await asked
    if len(data) != min(CHUNK_BYTES, size - off):
        raise checkpoint.CheckpointError(f"{rel}: {len(data)} bytes at offset {off} of {size} (changed while copied?)")
    await store(rel, off, data)


# ---------------------------------------------------------------- the relay


class CheckpointRelay:
    """The deployment's `trainer` when some trainer rank does not see RUN_DIR (module doc); every other call goes
    to the trainer's proxy unchanged. `ranks`: every trainer rank's actor handle (rank 0 first) and whether its
    folder is RUN_DIR; `folder`: the trainer's run folder on its node (run.trainer_dir or run.output_dir)."""

    def __init__(self, proxy: Any, ranks: list[tuple[Any, bool]], folder: str, keep_last: int) -> None:
        self._proxy = proxy
        self._ranks = ranks
        self._folder = PurePosixPath(folder)
        self._keep_last = keep_last

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._proxy, name)

    @property
    def _shared0(self) -> bool:
        return self._ranks[0][1]

    def _there(self, local: str | Path, under: str) -> str:
        """The path on the trainer's node of `local` (a folder of RUN_DIR/`under`)."""
        return str(local) if self._shared0 else str(self._folder / under / Path(local).name)

    async def save_state(self, root: str, **kwargs: Any) -> str:
        """A durable checkpoint: written by rank 0 under its folder, fetched into `root` (RUN_DIR/checkpoints)."""
        if self._shared0:
            return await self._proxy.save_state(root, **kwargs)
        there = await self._proxy.save_state(str(self._folder / checkpoint.CHECKPOINTS), **kwargs)
        here = Path(root) / PurePosixPath(there).name
        await fetch(self._ranks[0][0], there, here, hashes=False)
        # the rule checkpoint.save applies after its own writes, so RUN_DIR keeps what the trainer's folder keeps
        await asyncio.to_thread(checkpoint._prune, Path(root), here, self._keep_last)
        log.info("fetched checkpoint %s from the trainer's node (%s) into %s", here.name, there, here)
        return str(here)

    async def load_state(self, path: str) -> int:
        """Continue from the driver's checkpoint at `path`: shipped first to each rank whose copy is missing."""
        there = self._there(path, checkpoint.CHECKPOINTS)
        manifest = (Path(path) / checkpoint.MANIFEST).read_bytes()
        for handle, shared in self._ranks:
            if not shared and await handle.files_manifest.remote(there) != manifest:
                await push(handle, Path(path), there)
                log.info("shipped checkpoint %s to a trainer rank's node (%s)", Path(path).name, there)
        return await self._proxy.load_state(there)

    async def save_export(self, path: str) -> None:
        """The final HF export: written by rank 0 under its folder, fetched into `path` (RUN_DIR/checkpoint)."""
        handle = self._ranks[0][0]
        if self._shared0:
            await handle.save_checkpoint.remote(path)
            return
        there = str(self._folder / EXPORT)
        await handle.save_checkpoint.remote(there)
        await fetch(handle, there, Path(path), hashes=True)
        log.info("fetched the final export from the trainer's node (%s) into %s", there, path)


async def relay_for(proxy: Any, ranks: list[Any], *, run_dir: str, trainer_dir: str, keep_last: int,
                    fresh: bool) -> CheckpointRelay | None:
    """A CheckpointRelay when some trainer rank (`ranks`: actor handles, rank 0 first) does not see `run_dir` under
    its folder (`trainer_dir`, or `run_dir` itself when empty); else None. `fresh`: a new run, which first removes
    an earlier run's checkpoints from those ranks' folders."""
    folder = trainer_dir or run_dir
    name, token = f"{MARKER_PREFIX}{secrets.token_hex(8)}", secrets.token_hex(16)
    marker = Path(run_dir) / name
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(token)
    try:
        seen = await asyncio.gather(*[r.files_probe.remote(folder, name, token) for r in ranks])
    finally:
        marker.unlink(missing_ok=True)
    if all(seen):
        return None
    log.info("trainer rank(s) %s do not see %s in %s: checkpoints travel through Ray (asyncrl/checkpoints/transfer.py)",
             [r for r, s in enumerate(seen) if not s], run_dir, folder)
    root = str(PurePosixPath(folder) / checkpoint.CHECKPOINTS)
    if fresh:
        for handle, shared in zip(ranks, seen):
            if not shared and (gone := await handle.files_clear.remote(root)):
                log.warning("removed an earlier run's checkpoints %s from the trainer's folder %s", gone, folder)
    return CheckpointRelay(proxy, list(zip(ranks, seen)), folder, keep_last)


# ---------------------------------------------------------------- internals


def _inside(folder: str | Path, rel: str) -> Path:
    """folder/rel, refusing a `rel` that leaves the folder (the other side names the files)."""
    parts = PurePosixPath(rel)
    if parts.is_absolute() or ".." in parts.parts or not rel:
        raise checkpoint.CheckpointError(f"refusing a file outside the folder: {rel!r}")
    return Path(folder) / parts
