"""A run across two Ray nodes on this machine (`ray.cluster_utils.Cluster`, two raylets, one head, each offering a
custom resource of its own): `asyncrl launch --address` against that cluster with `cluster.resources` pinning the
trainer to one node and the generator and scorer to the other (the driver's); the run trains every step, placement.json
shows the roles on their nodes, and every step's weight broadcast crossed between them (gloo over the nodes' address).

Checkpoints come back from the trainer on the other node (asyncrl/checkpoints/transfer.py): it writes into
`run.trainer_dir`, a folder the driver's RUN_DIR is not (one machine shares one filesystem, so a node
without shared storage is stood for by a folder of its own; the relay decides by whether the trainer sees the
driver's marker file, not by node ids).

Run 1 trains 3 steps with run.save_every = 2: RUN_DIR/checkpoints gets step 2 and step 3 and RUN_DIR/checkpoint the
final export, each a copy of what the trainer wrote in its folder, every checkpoint passing `checkpoint.verify`.
Run 2 resumes RUN_DIR to step 5 with a trainer whose folder is empty (a fresh node): the driver ships step 3 to it,
the trainer continues from it, and steps 4 and 5 come back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.checkpoints import store as checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CLUSTER = textwrap.dedent("""
    import subprocess, sys
    from ray.cluster_utils import Cluster
    config, run_dir, fresh_node = sys.argv[1:4]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"rollout_node": 2},
                      "include_dashboard": False, "object_store_memory": 100 * 2**20})
    cluster.add_node(num_cpus=2, resources={"trainer_node": 1}, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    launch = [sys.executable, "-m", "asyncrl.cli", "launch", "--address", cluster.address, "--set",
              "logging.live=false"]
    try:
        rc = subprocess.call([*launch, config])
        if rc == 0:  # the same run resumed by a trainer whose folder is empty
            rc = subprocess.call([*launch, "--resume", run_dir, "--set", "trainer.total_steps=5", "--set",
                                  f'run.trainer_dir="{fresh_node}"'])
    finally:
        cluster.shutdown()
    sys.exit(rc)
""")


def _steps(root: Path) -> list[str]:
    return [p.name for _, p in checkpoint.list_checkpoints(root)]


def _same_files(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return bool(files) and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and \
        all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


@pytest.mark.timeout(600)
def test_a_run_across_two_nodes_trains_every_step_and_its_checkpoints_come_back_and_a_resume_ships_one_there(
        tiny_config_file, tmp_path):
    run_dir, node_1, node_2 = tmp_path / "run", tmp_path / "trainer_node_1", tmp_path / "trainer_node_2"
    config = tiny_config_file.read_text().replace(
        "[cluster]\n", "[cluster]\nnetwork_interface = \"lo\"\n").replace(
        "[run]\n", f"[run]\nsave_every = 2\nkeep_last = 0\ntrainer_dir = \"{node_1}\"\n")
    config += textwrap.dedent("""
        [cluster.resources]
        trainer = {trainer_node = 1}
        generator = {rollout_node = 1}
        scorer = {rollout_node = 0.5}
    """)
    path = tmp_path / "relay.toml"
    path.write_text(config)
    done = subprocess.run([sys.executable, "-c", CLUSTER, str(path), str(run_dir), str(node_2)],
                          capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-4000:]
    where = json.loads((run_dir / "placement.json").read_text())
    assert where["trainer"]["node_id"] != where["generator 0"]["node_id"]  # the generator shares the driver's node
    assert where["scorer 0"]["node_id"] == where["generator 0"]["node_id"]

    here = run_dir / "checkpoints"
    assert _steps(here) == [f"step_{s:08d}" for s in (2, 3, 4, 5)]
    for name in _steps(here):
        checkpoint.verify(here / name)
    # run 1: written by the trainer in its folder, fetched into RUN_DIR
    assert _steps(node_1 / "checkpoints") == ["step_00000002", "step_00000003"]
    assert all(_same_files(node_1 / "checkpoints" / n, here / n) for n in _steps(node_1 / "checkpoints"))
    # run 2: step 3 shipped to the fresh trainer's folder, steps 4 and 5 written there and fetched
    assert _steps(node_2 / "checkpoints") == ["step_00000003", "step_00000004", "step_00000005"]
    assert all(_same_files(node_2 / "checkpoints" / n, here / n) for n in _steps(node_2 / "checkpoints"))
    assert checkpoint.read_state(here / "step_00000005")[0].version == 5
    # the final export of run 2, fetched over run 1's
    assert _same_files(node_2 / "checkpoint", run_dir / "checkpoint")
    assert (run_dir / "checkpoint" / "config.json").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if "trainer/samples" in r]
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5]
    assert all(r["sync/bytes"] > 0 for r in trained)  # every step's weights crossed to the other node
    assert "shipped checkpoint step_00000003" in done.stdout + done.stderr
