"""asyncrl/deploy/native_memory.py: a role's process caps the kernel caches and fixes malloc's mmap threshold, so
that blocks of ever-new sizes do not stay in the heap; a setting the user made wins. Each case runs in a fresh
interpreter (the settings are the process's, read once)."""

import os
import subprocess
import sys

import pytest

# A 24 MiB block freed raises glibc's dynamic threshold to 24 MiB: a 6 MiB block allocated after it is carved from
# the heap by default, and mapped of its own once the threshold is fixed at 4 MiB.
SCRIPT = """
import ctypes, os, sys
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "bound":
    from asyncrl.deploy.native_memory import bound_native_memory
    print("set", bound_native_memory())
libc.free(libc.malloc(24 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(6 << 20)
print("mapped", libc.mallinfo2().hblkhd - before >= 6 << 20)
libc.free(block)
print("caches", os.environ.get("LRU_CACHE_CAPACITY"), os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"))
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                           reason="glibc's malloc")


def run(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_MMAP_THRESHOLD_")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split("\n")


@glibc
def test_large_blocks_are_mapped_and_the_caches_capped():
    assert run("default")[:2] == ["mapped False", "caches None None"]  # what the process does unbounded
    assert run("bound")[:3] == ["set True", "mapped True", "caches 128 128"]


@glibc
def test_the_users_settings_win():
    out = run("bound", LRU_CACHE_CAPACITY="4096", MALLOC_MMAP_THRESHOLD_=str(64 << 20))
    assert out[:3] == ["set False", "mapped False", "caches 4096 128"]
