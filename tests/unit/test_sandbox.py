"""The sandboxed Python tool: its limits (time, memory, processes, file size, open files, network, writes) and
that nothing it starts outlives the call — on exit, timeout, cancellation and the death of its parent.

Tests of a mechanism this machine lacks skip and say so; `PythonTool.confinement` names what is in force."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from asyncrl.envs.sandbox import Confinement, PythonTool

REPO = Path(__file__).resolve().parents[2]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def py() -> PythonTool:
    return PythonTool(timeout_s=3.0, memory_mb=256, cpu_s=2)


def pids_with(marker: str, *, exclude: set[int] = frozenset()) -> set[int]:
    """Live processes whose command line holds `marker` (a zombie's command line is empty)."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) not in exclude:
            try:
                if marker.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                pass
    return found


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def spawns_grandchild(marker: str, tool: PythonTool, then: str) -> str:
    """Code that starts a sleeping grandchild — whose command line alone holds `marker`-grand — then runs `then`.
    The grandchild leaves the process group (setsid) where the tool should still reach it: a pid namespace or
    a cgroup."""
    new_session = tool.confinement.process_tree == "pid_namespace" or tool.confinement.processes == "cgroup"
    return ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {marker}' + '-grand'], "
            f"stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session={new_session})\n"
            "print('started', flush=True)\n" + then)


# -- what runs, and its limits -----------------------------------------------------------------------


def test_python_tool_runs_code_and_reports_errors(py):
    assert run(py("print(6*7)")) == "42"
    assert run(py("raise ValueError('bad input')")) == "error: ValueError: bad input"
    assert run(py("print(__name__, open('f', 'w').write('ok'))")) == "__main__ 2"  # its folder is writable


def test_confinement_names_a_mechanism_for_every_aspect(py):
    c = py.confinement
    assert c.network in ("namespace", "socket_block", "socket_block+landlock_tcp")
    assert c.filesystem in ("landlock", "permissions") and c.processes in ("cgroup", "rlimit", "none")
    assert c.process_tree in ("pid_namespace", "process_group") and c.parent_death in ("pdeathsig", "none")
    assert str(c).startswith(f"network={c.network} filesystem=")
    off = PythonTool(isolation="socket_block", landlock=False).confinement
    assert off == Confinement("socket_block", "permissions", c.processes, "process_group", c.parent_death)


def test_child_runs_under_every_resource_limit():
    tool = PythonTool(memory_mb=300, cpu_s=3, max_file_mb=5, max_open_files=40)
    code = ("import resource as r\n"
            "print([r.getrlimit(getattr(r, 'RLIMIT_' + k))[1] for k in ('AS', 'CPU', 'FSIZE', 'NOFILE', 'CORE')])")
    assert run(tool(code)) == str([300 * 2**20, 3, 5 * 2**20, 40, 0])


def test_python_tool_limits_time_and_memory(py):
    quick = PythonTool(timeout_s=0.5, cpu_s=5)
    assert "timed out" in run(quick("import time\ntime.sleep(30)"))
    out = run(py("x = bytearray(1024 * 2**20)\nprint(len(x))"))
    assert out.startswith("error:") and "MemoryError" in out


def test_writing_a_file_past_max_file_mb_fails():
    tool = PythonTool(max_file_mb=1)
    assert run(tool("open('small', 'wb').write(b'x' * 2**19)\nprint('ok')")) == "ok"
    out = run(tool("f = open('big', 'wb', buffering=0)\nf.write(b'x' * 2**20)\nf.write(b'x')"))
    assert out.startswith("error: OSError") and "File too large" in out


def test_opening_more_than_max_open_files_fails():
    tool = PythonTool(max_open_files=32)
    code = ("files = []\ntry:\n    while True:\n        files.append(open('f', 'w'))\n"
            "except OSError as e:\n    print(len(files), e.strerror)")
    n, why = run(tool(code)).split(" ", 1)
    assert 0 < int(n) < 32 and why == "Too many open files"


def test_processes_beyond_max_processes_cannot_start():
    tool = PythonTool(max_processes=8, timeout_s=5.0)
    if tool.confinement.processes == "none":
        pytest.skip("no process limit here: RLIMIT_NPROC does not apply to root and no pids cgroup is writable")
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print(n, type(e).__name__)")
    n, err = run(tool(code)).split()
    assert err == "BlockingIOError" and 0 < int(n) < 8


def test_fork_bomb_is_contained_and_leaves_nothing_behind():
    tool = PythonTool(max_processes=8, timeout_s=1.5)
    if tool.confinement.processes == "none":
        pytest.skip("no process limit here: RLIMIT_NPROC does not apply to root and no pids cgroup is writable")
    marker = f"bomb-{uuid.uuid4().hex}"
    try:
        out = run(tool(f"import os  # {marker}\nwhile True:\n    os.fork()"))
        assert out.startswith("error:")  # "BlockingIOError ..." or "timed out"
        assert wait_until(lambda: not pids_with(marker), 5.0)
        assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    finally:
        kill_all(pids_with(marker))


# -- network and filesystem --------------------------------------------------------------------------


def test_python_tool_has_no_network(py):
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 9), timeout=1)\nprint('connected')"
    out = run(py(code))
    assert out.startswith("error:") and "connected" not in out
    assert py.isolation in ("namespace", "socket_block")


def test_network_namespace_and_landlock_block_even_raw_sockets():
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = ("import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.settimeout(1)\n"
            f"s.connect(('127.0.0.1', {port}))\nprint('connected')")
    try:
        bare = PythonTool(isolation="socket_block", landlock=False)
        assert run(bare(code)) == "connected"  # the socket.socket block alone is bypassable
        tools = [PythonTool(isolation="socket_block"), PythonTool()]
        confined = [t for t in tools if t.confinement.network != "socket_block"]
        if not confined:
            pytest.skip("neither `unshare -rn` nor Landlock ABI >= 4 is available here")
        for tool in confined:
            out = run(tool(code))
            assert out.startswith("error:") and "connected" not in out, tool.confinement
    finally:
        server.close()


def test_writes_outside_the_temporary_folder_fail(tmp_path):
    tool = PythonTool()
    if tool.confinement.filesystem != "landlock":
        pytest.skip("no Landlock here: the python tool's writes are bounded only by the user's permissions")
    target = tmp_path / "escaped"
    code = (f"open('inside', 'w').write('ok')\nopen('/dev/null', 'w').write('ok')\nimport os\nos.mkdir('d')\n"
            f"os.remove('inside')\nprint('inside ok', flush=True)\nopen({str(target)!r}, 'w')")
    out = run(tool(code))
    assert out.startswith("error: PermissionError") and not target.exists()
    assert run(PythonTool(landlock=False)(code.replace("print('inside ok', flush=True)\n", ""))) == ""
    assert target.exists()  # the same code without Landlock writes there


def test_landlock_stops_signals_to_processes_outside_the_sandbox():
    tool = PythonTool()
    if tool.confinement.filesystem != "landlock" or not _landlock_scopes_signals():
        pytest.skip("Landlock ABI >= 6 (signal scoping) is not available here")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        out = run(PythonTool(isolation="socket_block")(f"import os\nos.kill({victim.pid}, 9)"))
        assert out.startswith("error: PermissionError") and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def _landlock_scopes_signals() -> bool:
    from asyncrl.envs.sandbox import _landlock_abi

    return _landlock_abi() >= 6


# -- nothing outlives the call -----------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["auto", "socket_block"])
@pytest.mark.parametrize("exit_path", ["exit", "timeout", "cancel"])
def test_nothing_the_snippet_started_outlives_the_call(exit_path, isolation):
    tool = PythonTool(timeout_s=1.0 if exit_path == "timeout" else 30.0, isolation=isolation)
    marker = f"tree-{uuid.uuid4().hex}"
    code = spawns_grandchild(marker, tool, "import time\ntime.sleep(60)" if exit_path != "exit" else "")

    async def call_then_cancel() -> str:
        task = asyncio.create_task(tool(code))
        while not pids_with(f"{marker}-grand") and not task.done():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return "cancelled"

    try:
        out = run(call_then_cancel() if exit_path == "cancel" else tool(code))
        assert out == {"exit": "started", "timeout": "error: python timed out after 1s", "cancel": "cancelled"}[
            exit_path]
        assert wait_until(lambda: not pids_with(marker), 5.0), pids_with(marker)
    finally:
        kill_all(pids_with(marker))


_ORPHAN = """
import asyncio, sys
from asyncrl.envs.sandbox import PythonTool
tool = PythonTool(timeout_s=60, isolation=sys.argv[1])
asyncio.run(tool(sys.stdin.read()))
"""


@pytest.mark.parametrize("isolation", ["auto", "socket_block"])
def test_sandbox_dies_with_the_process_that_started_it(isolation):
    probe = PythonTool(isolation=isolation)
    if probe.confinement.parent_death != "pdeathsig":
        pytest.skip("no PR_SET_PDEATHSIG here")
    marker = f"orphan-{uuid.uuid4().hex}"
    tree = probe.confinement.process_tree == "pid_namespace"  # only a pid ns takes the grandchild along
    code = spawns_grandchild(marker, probe, "") if tree else ""
    code += f"import time\ntime.sleep(60)  # {marker}"
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, isolation], stdin=subprocess.PIPE, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": path})
    parent.stdin.write(code.encode())
    parent.stdin.close()
    try:
        assert wait_until(lambda: pids_with(f"{marker}-grand") if tree else pids_with(marker, exclude={parent.pid}))
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not pids_with(marker), 5.0), pids_with(marker)
    finally:
        parent.kill()
        kill_all(pids_with(marker))
