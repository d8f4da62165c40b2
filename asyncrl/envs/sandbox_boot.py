"""The first code the Python tool's sandboxed interpreter runs: it locks the process in, then runs the snippet.

Place in the dataflow: `PythonTool` (asyncrl/envs/sandbox.py) starts `python -I -B sandbox_boot.py FEATURES CODE`;
this script applies the confinement FEATURES names (comma-separated), then runs CODE as `__main__`, as
`python -c CODE` would. It imports only the standard library and never imports asyncrl.

Features:
    landlock=N     Landlock (kernel ABI N >= 1), irrevocable for this process and every process it starts:
                   no file may be created, written, truncated (ABI >= 3), linked, renamed or removed outside
                   the working directory (the call's temporary folder) except writing /dev/null; with
                   ABI >= 4 no TCP bind or connect; with ABI >= 6 no signals to, and no abstract Unix sockets
                   of, processes outside the sandbox. Reads and metadata (chmod, chown, utime) are not
                   restricted. If the kernel refuses, the snippet does not run.
    socket_block   `socket.socket`, `create_connection` and `socketpair` raise (a Python-level block that code
                   importing `_socket` can bypass; the fallback where no network namespace is available).
"""

import ctypes
import os
import socket
import sys

_PR_SET_NO_NEW_PRIVS = 38
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_WRITE_FILE = 1 << 1
_WRITES = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write file, remove dir/file, make char/dir/
#                                                                    reg/sock/fifo/block/symlink
_REFER, _TRUNCATE = 1 << 13, 1 << 14           # ABI 2, ABI 3
_NET_TCP = (1 << 0) | (1 << 1)                 # ABI 4: bind, connect
_SCOPES = (1 << 0) | (1 << 1)                  # ABI 6: abstract Unix sockets, signals


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(abi: int) -> None:
    """Forbid writes outside the working directory (and, by ABI, TCP, signals out): see the module docstring."""
    libc = ctypes.CDLL(None, use_errno=True)
    writes = _WRITES | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(writes, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # older kernels refuse fields they do not know

    def check(ret: int, what: str) -> int:
        if ret < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox: landlock {what} failed: {os.strerror(err)}")
        return ret

    ruleset = check(libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0), "create_ruleset")
    for path, access in ((".", writes), ("/dev/null", _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneath(access, fd)
        check(libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0), f"rule for {path}")
        os.close(fd)
    check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.syscall(_RESTRICT_SELF, ruleset, 0), "restrict_self")
    os.close(ruleset)


def block_sockets() -> None:
    def no_net(*args: object, **kwargs: object) -> socket.socket:
        raise OSError("network access is disabled in the python tool")

    socket.socket = socket.create_connection = socket.socketpair = no_net  # type: ignore[assignment,misc]


def main(features: str, code: str) -> None:
    for feature in filter(None, features.split(",")):
        name, _, value = feature.partition("=")
        if name == "landlock":
            landlock(int(value))
        elif name == "socket_block":
            block_sockets()
        else:
            raise SystemExit(f"sandbox: unknown feature {feature!r}")
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
