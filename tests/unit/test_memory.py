"""Peak memory per role (asyncrl/telemetry/memory.py): each reader gets the process's peak since its own
previous read, however many readers share the process; the real host mark sees an allocation and is reset."""

from __future__ import annotations

import mmap
import os

import pytest

from asyncrl.telemetry.memory import PeakMemory, cuda_peak_gb, host_peak_gb, peak_memory_metrics
from asyncrl.telemetry.metrics import Max


class Marks:
    """A resettable high-water mark, like VmHWM: `use(x)` raises it, a read returns it and resets it."""

    def __init__(self) -> None:
        self.now = self.peak = 1.0

    def use(self, gb: float) -> None:
        self.peak = max(self.peak, gb)

    def read(self) -> float:
        peak, self.peak = self.peak, self.now
        return peak


def test_each_reader_gets_the_peak_since_its_own_previous_read():
    host = Marks()
    memory = PeakMemory(host=host.read, cuda=lambda: None)
    host.use(5.0)
    assert memory.take("generator/0") == (5.0, None)  # first read: since the process started
    host.use(3.0)
    assert memory.take("trainer") == (5.0, None)  # its first read too: the 5 GB before is the process's
    host.use(2.0)
    assert memory.take("generator/0") == (3.0, None)  # the 3 GB came after its previous read, 5 before
    assert memory.take("trainer") == (2.0, None)  # the generator's read reset the mark, not the trainer's peak
    assert memory.take("trainer") == (1.0, None)  # nothing since: what the process holds now


def test_cuda_peaks_merge_like_host_peaks_and_stay_none_without_cuda():
    readings = iter([None, 2.0, 0.5, None])
    memory = PeakMemory(host=lambda: 1.0, cuda=lambda: next(readings))
    assert memory.take("a") == (1.0, None)
    assert memory.take("a") == (1.0, 2.0)
    assert memory.take("b") == (1.0, 2.0)  # since the start
    assert memory.take("a") == (1.0, 0.5)


def test_peak_memory_metrics_are_max_metrics_named_by_role_type():
    memory = PeakMemory(host=lambda: 1.5, cuda=lambda: None)
    assert peak_memory_metrics("generator", "generator/0", memory) == {"memory/generator_peak_gb": Max(1.5)}
    memory = PeakMemory(host=lambda: 1.5, cuda=lambda: 0.25)
    assert peak_memory_metrics("trainer", "trainer", memory) == {"memory/trainer_peak_gb": Max(1.5),
                                                                 "memory/trainer_cuda_peak_gb": Max(0.25)}


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable VmHWM")
def test_the_host_mark_sees_an_allocation_and_is_reset_by_the_read():
    host_peak_gb()
    baseline = host_peak_gb()  # reset just before: about what the process holds now
    # a fresh anonymous mapping, not the allocator's: after a long test session malloc may hand back memory that
    # is still resident from earlier tests, which would not move the peak
    block = mmap.mmap(-1, 256 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):  # touch every page: resident
        block[offset] = 1
    block.close()  # unmapped
    assert host_peak_gb() >= baseline + 0.2  # freed again, but the peak saw it
    assert host_peak_gb() < baseline + 0.1  # the read reset the mark


def test_cuda_peak_is_none_where_the_process_has_not_initialised_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    assert cuda_peak_gb() is None


@pytest.mark.gpu
def test_cuda_peak_sees_an_allocation_and_is_reset_by_the_read():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.zeros(1, device="cuda")
    cuda_peak_gb()
    block = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    del block
    assert cuda_peak_gb() >= 0.5
    assert cuda_peak_gb() < 0.1
