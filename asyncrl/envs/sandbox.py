"""The Python tool: a snippet runs in a fresh, limited interpreter and its stdout comes back as the observation.

Place in the dataflow: `ToolBox.call` (asyncrl/envs/tools.py) awaits `PythonTool(code)` inside an env's `step`;
the text it returns (or "error: <one line>") is appended to the transcript with loss_mask False.

One call, in order:
    1. a temporary folder (the child's working directory) and, where the machine allows, a pids cgroup
    2. fork; in the child, in a new session (it leads its own process group), before exec (`_enter`): join
       the cgroup, set the rlimits and PR_SET_PDEATHSIG=SIGKILL
    3. exec `unshare --user --map-root-user --net --pid --fork --kill-child --mount --mount-proc` where it
       works, then `python -I -B sandbox_boot.py FEATURES CODE`; the boot script applies Landlock (or the
       socket block) and runs CODE
    4. read a bounded head of stdout and tail of stderr until the child exits or `timeout_s` passes
    5. on every way out of step 4 — exit, timeout, cancellation of the awaiting task, an exception — kill
       the process group and everything in the cgroup, reap the child, remove the cgroup and the folder

What is confined (`PythonTool.confinement` names the mechanism in force on this machine):
| aspect       | where the machine allows it                              | otherwise                                 |
|--------------|----------------------------------------------------------|-------------------------------------------|
| memory       | RLIMIT_AS `memory_mb`, per process                       |                                           |
| cpu          | RLIMIT_CPU `cpu_s`, per process; wall clock `timeout_s`  |                                           |
| processes    | pids cgroup: `max_processes` tasks (+1 for unshare)      | RLIMIT_NPROC, non-root only: it counts    |
|              |                                                          | all the user's tasks, so it is set to     |
|              |                                                          | those running + `max_processes`; root     |
|              |                                                          | without a writable cgroup: no limit       |
| file size    | RLIMIT_FSIZE `max_file_mb` (a bigger write: EFBIG)       |                                           |
| open files   | RLIMIT_NOFILE `max_open_files`                           |                                           |
| core dumps   | RLIMIT_CORE 0                                            |                                           |
| network      | user + network namespace: only a downed loopback         | `socket.socket` replaced (bypassable via  |
|              |                                                          | `_socket`); with Landlock >= 4 no TCP     |
| writes       | Landlock: only in the temporary folder and /dev/null     | the user's file permissions only          |
| signals      | Landlock >= 6: none to processes outside the sandbox     | any process of the same user              |
| process tree | pid namespace: when its init dies, every descendant dies | process group: a descendant that calls    |
|              | (`--kill-child` ties that init to unshare)               | setsid() escapes, unless in the cgroup    |
| parent death | PR_SET_PDEATHSIG=SIGKILL on the child, then the pid ns   | only the child dies                       |

Not confined anywhere: reads (the snippet can read any file the user can: keys, checkpoints, configs), Unix
sockets bound to a path the user may write (e.g. Ray's under /tmp/ray: a network namespace does not
separate them), metadata changes to the user's files anywhere (chmod, chown, utime: Landlock does not cover
them), disk use by many files each under `max_file_mb` inside the temporary folder, and system calls in
general (no seccomp). This is resource limiting and damage control for model-written code, not a
boundary for deliberately hostile code.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_BOOT = str(Path(__file__).with_name("sandbox_boot.py"))
_NAMESPACES = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Confinement:
    """The mechanism in force for each aspect on this machine (see the module docstring's table)."""
    network: str        # "namespace" | "socket_block" | "socket_block+landlock_tcp"
    filesystem: str     # "landlock" (writes only in the temporary folder) | "permissions"
    processes: str      # "cgroup" | "rlimit" | "none"
    process_tree: str   # "pid_namespace" | "process_group"
    parent_death: str   # "pdeathsig" | "none"

    def __str__(self) -> str:
        return " ".join(f"{k}={getattr(self, k)}" for k in self.__slots__)


class PythonTool:
    """Runs a code snippet in a fresh, limited interpreter; returns its stdout (or 'error: ...')."""

    def __init__(self, *, timeout_s: float = 2.0, memory_mb: int = 256, cpu_s: int = 2, max_processes: int = 16,
                 max_file_mb: int = 16, max_open_files: int = 64, max_output: int = 2000,
                 isolation: str = "auto", landlock: bool = True) -> None:
        if isolation not in ("auto", "namespace", "socket_block"):
            raise ValueError(f"PythonTool isolation must be auto, namespace or socket_block, got {isolation!r}")
        self.timeout_s = timeout_s
        self.memory_bytes = memory_mb * 2**20
        self.cpu_s = cpu_s
        self.max_processes = max_processes
        self.max_file_bytes = max_file_mb * 2**20
        self.max_open_files = max_open_files
        self.max_output = max_output
        namespaces = _working_namespaces() if isolation != "socket_block" else None
        if isolation == "namespace" and namespaces is None:
            raise ValueError("PythonTool isolation='namespace' but `unshare -rn` does not work here")
        self._unshare = [shutil.which("unshare") or "unshare", *namespaces] if namespaces else []
        self.isolation = "namespace" if namespaces else "socket_block"  # the network mechanism, as before
        self._landlock = _landlock_abi() if landlock else 0  # False: only to show what Landlock adds
        self._libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
        self._cgroups = PidsCgroups.find()
        self._root = os.getuid() == 0  # the kernel does not apply RLIMIT_NPROC to root
        self.confinement = Confinement(
            network="namespace" if namespaces else
            "socket_block+landlock_tcp" if self._landlock >= 4 else "socket_block",
            filesystem="landlock" if self._landlock else "permissions",
            processes="cgroup" if self._cgroups else "none" if self._root else "rlimit",
            process_tree="pid_namespace" if "--pid" in (namespaces or []) else "process_group",
            parent_death="pdeathsig" if self._libc else "none")
        (log.warning if self.confinement.processes == "none" else log.info)(
            "python tool confinement: %s", self.confinement)

    async def __call__(self, code: str) -> str:
        """Run a Python program in a fresh, limited interpreter and return what it printed.

        Args:
            code: The program's source; print the values you want to see.
        """
        features = ",".join(([f"landlock={self._landlock}"] if self._landlock else [])
                            + ([] if self._unshare else ["socket_block"]))
        argv = [*self._unshare, sys.executable, "-I", "-B", _BOOT, features, code]
        with tempfile.TemporaryDirectory(prefix="asyncrl-py-", ignore_cleanup_errors=True) as cwd:
            cgroup = self._cgroups.create(self.max_processes + bool(self._unshare)) if self._cgroups else None
            try:
                return await self._run(argv, cwd, cgroup)
            finally:
                if cgroup is not None:
                    await cgroup.remove()

    async def _run(self, argv: list[str], cwd: str, cgroup: PidsCgroup | None) -> str:
        nproc = None
        if cgroup is None and not self._root:  # RLIMIT_NPROC counts every task of the user, not just ours
            nproc = _user_tasks(os.getuid()) + self.max_processes + bool(self._unshare)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, start_new_session=True,
            preexec_fn=functools.partial(self._enter, os.getpid(), cgroup.path if cgroup else None, nproc))
        try:
            # Not communicate(): it would hold everything the child prints (GBs within the time limit)
            # in this process, past the child's own memory limit. Keep a bounded head / tail instead.
            out, err, _ = await asyncio.wait_for(asyncio.gather(
                _drain(proc.stdout, self.max_output), _drain(proc.stderr, 8192, tail=True), proc.wait()),
                self.timeout_s)
        except asyncio.TimeoutError:
            return f"error: python timed out after {self.timeout_s:g}s"
        finally:  # every exit path, cancellation included: nothing the snippet started outlives the call
            _kill_group(proc.pid)
            if cgroup is not None:
                cgroup.kill()
            await proc.wait()
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            if proc.returncode < 0:
                why = f"killed by signal {-proc.returncode} (cpu or memory limit)"
            return f"error: {why[:200]}"
        return out.decode(errors="replace")[: self.max_output].rstrip("\n")

    def _enter(self, parent: int, cgroup: str | None, nproc: int | None) -> None:
        """Runs in the child between fork and exec (after setsid): the limits it and its descendants inherit."""
        if cgroup is not None:  # raw os calls: the less Python runs between fork and exec, the better
            fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        for limit, value in ((resource.RLIMIT_AS, self.memory_bytes), (resource.RLIMIT_CPU, self.cpu_s),
                             (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, self.max_file_bytes),
                             (resource.RLIMIT_NOFILE, self.max_open_files)):
            resource.setrlimit(limit, (value, value))
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        if self._libc is not None:
            # SIGKILL when the thread that forked us dies (asyncio forks on the event loop's thread)
            if self._libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
            if os.getppid() != parent:  # the parent died before the prctl: nobody will read our output
                os._exit(1)


async def _drain(stream: asyncio.StreamReader | None, cap: int, *, tail: bool = False) -> bytes:
    """Read `stream` to its end, keeping only its first (or, with `tail`, last) `cap` bytes."""
    buf = bytearray()
    if stream is None:
        return b""
    while chunk := await stream.read(65536):
        buf += chunk
        if len(buf) > cap:
            buf = buf[-cap:] if tail else buf[:cap]
    return bytes(buf)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- what this machine allows -------------------------------------------------------------------------


def _working_namespaces() -> list[str] | None:
    """The unshare flags that work here: all of _NAMESPACES, else user + network only, else None."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for flags in (_NAMESPACES, ["-rn"]):
        try:
            if subprocess.run([exe, *flags, "true"], capture_output=True, timeout=5).returncode == 0:
                return flags
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (not Linux, too old, disabled)."""
    if sys.platform != "linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    return max(0, libc.syscall(444, None, ctypes.c_size_t(0), 1))  # landlock_create_ruleset(VERSION)


def _user_tasks(uid: int) -> int:
    """Tasks (threads) of processes owned by `uid`, as RLIMIT_NPROC counts them (approximately: owner = euid)."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:  # the process ended meanwhile
                pass
    return n


class PidsCgroups:
    """Where this process may create pids cgroups (cgroup v1 `pids` hierarchy, or v2 with pids delegated)."""

    PREFIX = "asyncrl-py-"

    def __init__(self, parent: str) -> None:
        self.parent = parent
        self._sweep()

    @classmethod
    def find(cls) -> PidsCgroups | None:
        try:
            parent = _own_pids_cgroup()
            if parent is None:
                return None
            probe = tempfile.mkdtemp(prefix=cls.PREFIX, dir=parent)
        except OSError:
            return None
        try:
            usable = os.path.exists(os.path.join(probe, "pids.max"))
        finally:
            os.rmdir(probe)
        return cls(parent) if usable else None

    def create(self, max_tasks: int) -> PidsCgroup:
        cgroup = PidsCgroup(tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}-", dir=self.parent))
        with open(os.path.join(cgroup.path, "pids.max"), "w") as f:
            f.write(str(max_tasks))
        return cgroup

    def _sweep(self) -> None:
        """Remove the empty cgroups of our processes that died before removing theirs."""
        for name in os.listdir(self.parent):
            m = re.fullmatch(rf"{self.PREFIX}(\d+)-\w+", name)
            if m and not _alive(int(m.group(1))):
                try:
                    os.rmdir(os.path.join(self.parent, name))
                except OSError:
                    pass


class PidsCgroup:
    """One call's cgroup: caps its tasks, lists them for killing (even those that left the process group)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pids(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(line) for line in f.read().split()]

    def kill(self) -> None:
        for _ in range(100):  # a bounded race against forks still in flight; pids.max bounds each round
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def remove(self) -> None:
        for _ in range(200):  # killed tasks leave the cgroup once reaped, a few ms later
            try:
                os.rmdir(self.path)
                return
            except OSError:
                self.kill()
                await asyncio.sleep(0.01)
        log.warning("could not remove the python tool's cgroup %s (still busy)", self.path)


def _own_pids_cgroup() -> str | None:
    """The directory of this process's cgroup in the hierarchy holding the pids controller, or None."""
    mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "pids" not in controllers.split(","):
            continue
        for fields in mounts:
            fs = fields[fields.index("-") + 1:]
            if (fs[0] == "cgroup2") if v2 else (fs[0] == "cgroup" and "pids" in fs[2].split(",")):
                root, mount_point = fields[3], fields[4]
                if path.startswith(root):
                    return os.path.join(mount_point, os.path.relpath(path, root))
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
