"""Peak memory per role: the process's high-water marks since each role's previous report.

Place in the dataflow: every role's `stats()` (generator, scorer, trainer, buffer) adds `memory/<role>_peak_gb`
and, where the process uses CUDA, `memory/<role>_cuda_peak_gb` (`peak_memory_metrics`); the Controller reduces
them with `Max` over the role's actors like any window metric (docs/metrics.md). With colocated placement they
show what each side needs of the shared device, and that the engines' sleep gave it back.

The marks belong to the process, not to a role: the kernel's peak resident set (`VmHWM` in /proc/self/status,
reset by writing 5 to /proc/self/clear_refs) and the CUDA caching allocator's peak (`max_memory_allocated`,
reset by `reset_peak_memory_stats`). A reset is seen by every reader in the process, so one `PeakMemory` per
process (`process_peak_memory`) folds each reading into every reader's pending peak before it resets: each
reader gets the peak since *its own* previous read (its first: since the process started), however many roles
share the process (all of them in process, `--local`; the buffer and the scorers it hosts). Where the kernel
does not allow the reset, the host figure is the peak since the process started (`ru_maxrss`): never below the
true peak of the window.
"""

from __future__ import annotations

import os
import re
import resource
import sys
import threading
from typing import Callable

from asyncrl.telemetry.metrics import Max, proc_fd

Peaks = tuple[float, float | None]  # (host GB, CUDA GB or None where the process does not use CUDA)

_VM_HWM = re.compile(rb"^VmHWM:\s+(\d+)\s+kB", re.M)


def host_peak_gb() -> float:
    """The process's peak resident set in GiB since the previous call, which resets it (Linux); elsewhere, or
    where /proc/self/clear_refs is not writable, the peak since the process started. Every role reads it once a
    step: /proc/<pid>/status and clear_refs stay open (`proc_fd`; 9 µs a call against 60 µs opening both)."""
    try:
        match = _VM_HWM.search(os.pread(proc_fd("status"), 8192, 0))
    except (OSError, AttributeError):  # no /proc (macOS), no pread (Windows)
        match = None
    if match is None:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return maxrss / (2**30 if sys.platform == "darwin" else 2**20)
    try:
        os.write(proc_fd("clear_refs", os.O_WRONLY), b"5")  # 5: reset the peak resident set to the current one
        # (Linux >= 4.0); touches nothing else
    except OSError:
        pass  # not resettable here: the next reading is the peak since the start, an upper bound
    return int(match.group(1)) / 2**20


def cuda_peak_gb() -> float | None:
    """Peak memory the CUDA caching allocator handed out on the current device since the previous call (which
    resets it), in GiB; None where this process has not initialised CUDA (torch not imported counts too)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak / 2**30


def _merge(a: Peaks, b: Peaks) -> Peaks:
    cuda = b[1] if a[1] is None else a[1] if b[1] is None else max(a[1], b[1])
    return max(a[0], b[0]), cuda


class PeakMemory:
    """The peaks of one process since each reader's previous `take` (see the module docstring). `host` and
    `cuda` read a mark and reset it (the defaults read this process's); thread-safe."""

    def __init__(self, host: Callable[[], float] = host_peak_gb,
                 cuda: Callable[[], float | None] = cuda_peak_gb) -> None:
        self._host = host
        self._cuda = cuda
        self._lock = threading.Lock()
        self._since_start: Peaks = (0.0, None)
        self._pending: dict[str, Peaks] = {}  # reader -> peaks since its previous take

    def take(self, reader: str) -> Peaks:
        """(host GiB, CUDA GiB or None): the peaks since `reader`'s previous take; at its first, since the
        process started."""
        with self._lock:
            now = (self._host(), self._cuda())
            self._since_start = _merge(self._since_start, now)
            for name, peaks in self._pending.items():
                self._pending[name] = _merge(peaks, now)
            peaks = self._pending.get(reader, self._since_start)
            self._pending[reader] = (0.0, None)
            return peaks


_PROCESS: PeakMemory | None = None
_PROCESS_LOCK = threading.Lock()


def process_peak_memory() -> PeakMemory:
    """This process's one `PeakMemory`. One per process, not one per role, because the marks it resets are the
    process's: two instances would each reset what the other has not read yet."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = PeakMemory()
        return _PROCESS


def peak_memory_metrics(role_type: str, reader: str, memory: PeakMemory | None = None) -> dict[str, Max]:
    """`memory/<role_type>_peak_gb` (and `memory/<role_type>_cuda_peak_gb` where CUDA is in use) for the role
    `reader` ("generator/0"): the process's peaks since that role's previous report."""
    host, cuda = (memory or process_peak_memory()).take(reader)
    out = {f"memory/{role_type}_peak_gb": Max(host)}
    if cuda is not None:
        out[f"memory/{role_type}_cuda_peak_gb"] = Max(cuda)
    return out
