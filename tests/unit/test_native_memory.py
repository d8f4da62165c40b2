"""asyncrl/deploy/native_memory.py: a role's process caps ideep's and oneDNN's kernel caches unless the user set
them. Each case runs in a fresh interpreter (the settings are the process's, read once by each library)."""

import os
import subprocess
import sys

SCRIPT = """
import os
from asyncrl.deploy.native_memory import bound_native_memory
bound_native_memory()
print(os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])
"""


def caps(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_the_kernel_caches_are_capped():
    assert caps() == "128 128"


def test_the_users_settings_win():
    assert caps(LRU_CACHE_CAPACITY="4096") == "4096 128"
    assert caps(ONEDNN_PRIMITIVE_CACHE_CAPACITY="0") == "128 0"


ARENAS = """
import ctypes, os, threading
from asyncrl.deploy.native_memory import bound_native_memory
bound_native_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
done = threading.Barrier(8)
def work():
    libc.malloc(4096)  # a thread's first malloc takes an arena: a new one while the limit allows
    done.wait()        # all eight alive at once, none hands its arena back to another
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()    # glibc: one "Arena N:" block per heap, on stderr
"""


def arenas(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    proc = subprocess.run([sys.executable, "-c", ARENAS], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr.count("Arena ")


def test_a_roles_threads_share_two_malloc_arenas_unless_the_user_set_them():
    """Each thread that allocates would take a heap of its own (up to 8 a core), each keeping its freed blocks:
    the role's process shares MALLOC_ARENAS of them; MALLOC_ARENA_MAX in the environment wins."""
    assert arenas() <= 2
    assert arenas(MALLOC_ARENA_MAX="16") > 2
