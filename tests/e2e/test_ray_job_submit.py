"""An existing Ray cluster started by hand, the run sent to it as a Ray job (README, Several machines): `ray start
--head` (with the dashboard, which serves the job API), then `ray job submit --runtime-env-json '{"working_dir":
"."}' -- asyncrl launch CONFIG --address auto` from the repository: the job runs this checkout's code (its working
directory, uploaded) on the cluster and trains every step into the config's absolute run directory.

The job server needs Ray's dashboard dependencies (`pip install "ray[default]"`), which the project's own
environment does not install: without them this test is skipped. The head is a `ray start --block` process of its
own (its own temp dir and ports, token authentication off: it listens on 127.0.0.1 only), ended by SIGTERM, which
stops every process it started."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DEPS = ("aiohttp_cors", "colorful", "opencensus", "smart_open", "virtualenv")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def ray_head():
    """-> (the job server's http address, the env to talk to it); a head node started with `ray start --block`."""
    missing = [m for m in DASHBOARD_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Ray's job server needs ray[default] (missing here: {', '.join(missing)})")
    ray_cli = str(Path(sys.executable).parent / "ray")
    gcs, dash, *more = _free_ports(9)
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    names = ("--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port", "--object-manager-port")
    ports = [x for name, port in zip(names, more) for x in (name, str(port))]
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--num-cpus", "4", "--port", str(gcs), "--node-ip-address",
         "127.0.0.1", "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
         "--temp-dir", temp, "--object-store-memory", str(200 * 2**20), "--disable-usage-stats", *ports],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while subprocess.run([ray_cli, "job", "list", "--address", address], env=env,
                             capture_output=True).returncode:
            assert head.poll() is None, f"ray start --head exited with {head.returncode}"
            assert time.monotonic() < deadline, "the job server did not answer within 180 s"
            time.sleep(2)
        yield address, env
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(600)
def test_a_run_submitted_as_a_ray_job_trains_on_the_existing_cluster(ray_head, tiny_config_file, tmp_path):
    address, env = ray_head
    ray_cli = str(Path(sys.executable).parent / "ray")
    done = subprocess.run(
        [ray_cli, "job", "submit", "--address", address, "--runtime-env-json", json.dumps({"working_dir": "."}),
         "--", sys.executable, "-c", "import asyncrl, sys; print('ASYNCRL FROM', asyncrl.__file__); "
         "from asyncrl.cli import main; sys.exit(main(sys.argv[1:]))",
         "launch", str(tiny_config_file), "--address", "auto"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout + done.stderr
    # the job ran the uploaded copy of this checkout, not an installed asyncrl
    origin = next(line for line in done.stdout.splitlines() if line.startswith("ASYNCRL FROM"))
    assert "working_dir_files" in origin, origin
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows if "trainer/samples" in r] == [1, 2, 3]
