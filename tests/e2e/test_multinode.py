"""Two Ray nodes on this machine (`ray.cluster_utils.Cluster`: two raylets, one head), each offering a custom
resource of its own; `asyncrl launch --address` against that cluster with `cluster.resources` pinning the trainer
to one node and the generator to the other: the run trains every step, placement.json shows the roles on
different nodes, and the weight broadcast crossed between them (gloo over the nodes' address)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CLUSTER = textwrap.dedent("""
    import subprocess, sys
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer_node": 1},
                      "include_dashboard": False, "object_store_memory": 100 * 2**20})
    cluster.add_node(num_cpus=2, resources={"generator_node": 2}, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    try:
        rc = subprocess.call([sys.executable, "-m", "asyncrl.cli", "launch", sys.argv[1], "--address",
                              cluster.address])
    finally:
        cluster.shutdown()
    sys.exit(rc)
""")


@pytest.mark.timeout(300)
def test_launch_on_a_two_node_cluster_pins_roles_to_nodes_by_resources_and_syncs_across(tiny_config_file,
                                                                                         tmp_path):
    config = tiny_config_file.read_text().replace("[cluster]\n", "[cluster]\nnetwork_interface = \"lo\"\n")
    config += textwrap.dedent("""
        [cluster.resources]
        trainer = {trainer_node = 1}
        generator = {generator_node = 1}
        scorer = {generator_node = 0.5}
    """)
    path = tmp_path / "two_nodes.toml"
    path.write_text(config)
    done = subprocess.run([sys.executable, "-c", CLUSTER, str(path)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    where = json.loads((run_dir / "placement.json").read_text())
    assert where["trainer"]["node_id"] != where["generator 0"]["node_id"]
    assert where["scorer 0"]["node_id"] == where["generator 0"]["node_id"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    trained = [r for r in rows if "trainer/samples" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["sync/bytes"] > 0 for r in trained)  # every step's weights crossed to the other node
