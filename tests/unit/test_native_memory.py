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
