"""The sandbox's system-call policy for real: PROBE inside a bubblewrap sandbox through ``egressd run``.

tests/integration/sandbox/test_docker_seccomp.py runs the same probe in a real
sandbox container; the BPF program and the Docker profile are decided on paper
in tests/unit/test_seccomp_policy.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness import have, require


def test_egressd_run_on_another_architecture_exits_125_with_one_line(tmp_path: Path) -> None:
    fake = ("import platform, sys; platform.machine = lambda: 'aarch64'; "
            "from egressd.cli.main import main; sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    out = subprocess.run([sys.executable, "-c", fake, "run", "--audit-log", str(tmp_path / "audit.jsonl"), "--",
                          "true"], capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 125, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("egressd: ") and "x86_64" in out.stderr and "aarch64" in out.stderr


# -- the real thing --------------------------------------------------------------------------

# Run inside a sandbox: every socket family, high bits, socketpair, io_uring, the
# x32 ABI and the i386 ABI (socket and socketcall through int 0x80), as JSON.
# It only creates sockets: it never connects anywhere.
PROBE = r"""
import ctypes, errno, json, mmap, os, socket, struct, subprocess, sys
I386 = r'''
import ctypes, mmap, struct, sys
page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40,  # MAP_32BIT
                 prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
base = ctypes.addressof(ctypes.c_char.from_buffer(page))
page[256:268] = struct.pack("<III", 40, 1, 0)  # socketcall's arguments: AF_VSOCK, SOCK_STREAM, 0
eax, ebx, ecx = (359, 40, 1) if sys.argv[1] == "socket" else (102, 1, base + 256)  # SYS_SOCKET
code = (b"\x53" + b"\xb8" + struct.pack("<I", eax) + b"\xbb" + struct.pack("<I", ebx)
        + b"\xb9" + struct.pack("<I", ecx) + b"\x31\xd2\xcd\x80\x5b\xc3")  # push rbx .. int 0x80; pop rbx; ret
page[0:len(code)] = code
print(ctypes.CFUNCTYPE(ctypes.c_int)(base)(), flush=True)
'''

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
results = {}

def call(nr, *args):
    rc = libc.syscall(ctypes.c_ulong(nr), *(ctypes.c_ulong(a & (2**64 - 1)) for a in args))
    return rc if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

def sock(name, nr, family, kind=socket.SOCK_DGRAM):  # a type every allowed family has
    pair = (ctypes.c_int * 2)()
    rc = call(nr, family, kind, 0, ctypes.addressof(pair)) if nr == 53 else call(nr, family, kind, 0)
    if isinstance(rc, int):
        for fd in (list(pair) if nr == 53 else [rc]):
            os.close(fd)
        rc = "opened"
    results[name] = rc

def named(name, family, kind, proto=0):
    try:
        socket.socket(family, kind, proto).close()
        results[name] = "opened"
    except OSError as exc:
        results[name] = errno.errorcode.get(exc.errno, str(exc.errno))

for family in range(64):
    sock(f"socket {family}", 41, family)
sock("socket AF_VSOCK with high bits", 41, (1 << 32) | 40, socket.SOCK_STREAM)
sock("socket AF_PACKET with high bits", 41, (1 << 32) | 17, socket.SOCK_RAW)
for family in (40, 17, 38, (1 << 32) | 40):
    sock(f"socketpair {family}", 53, family, socket.SOCK_STREAM)
sock("socketpair AF_UNIX", 53, 1, socket.SOCK_STREAM)
named("AF_VSOCK stream", 40, socket.SOCK_STREAM)
named("AF_VSOCK dgram", 40, socket.SOCK_DGRAM)
named("AF_PACKET raw", 17, socket.SOCK_RAW)
named("AF_ALG", 38, socket.SOCK_SEQPACKET)
named("AF_UNIX", socket.AF_UNIX, socket.SOCK_STREAM)
named("AF_INET", socket.AF_INET, socket.SOCK_STREAM)
named("AF_INET6", socket.AF_INET6, socket.SOCK_DGRAM)
named("AF_NETLINK", socket.AF_NETLINK, socket.SOCK_RAW)
params = ctypes.create_string_buffer(120)
rc = call(425, 4, ctypes.addressof(params))
if isinstance(rc, int):
    os.close(rc)
    rc = "opened"
results["io_uring_setup"] = rc
results["io_uring_enter"] = call(426, -1, 1, 0, 0, 0, 0)  # EBADF would mean the kernel saw it
results["io_uring_register"] = call(427, -1, 0, 0, 0)
X32 = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
rc = libc.syscall(ctypes.c_ulong(0x40000000 | 41), ctypes.c_ulong(40), ctypes.c_ulong(1), ctypes.c_ulong(0))
print(rc if rc >= 0 else -ctypes.get_errno(), flush=True)
'''
# Another ABI may get the process killed (SIGSYS): each attempt runs in a child of its own.
for name, code, how in (("x32 socket", X32, ""), ("i386 socket", I386, "socket"),
                        ("i386 socketcall", I386, "socketcall")):
    child = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True)
    if child.returncode < 0:
        results[name] = f"killed by signal {-child.returncode}"
    else:
        value = int(child.stdout.strip() or "-9999")
        results[name] = "opened" if value >= 0 else errno.errorcode.get(-value, str(value))
print(json.dumps(results))
"""


def assert_confined(results: dict[str, Any], *, i386_killed: bool) -> None:
    """What PROBE must have met in any sandbox of egressd's (``i386_killed``: the bwrap filter's own action)."""
    refused = {name: r for name, r in results.items()
               if name.startswith(("socket ", "socketpair ", "AF_VSOCK", "AF_PACKET", "AF_ALG"))
               and name not in ("socket 1", "socket 2", "socket 10", "socket 16", "socketpair AF_UNIX")}
    assert len(refused) == 60 + 2 + 4 + 4
    assert {name: r for name, r in refused.items() if r != "EAFNOSUPPORT"} == {}
    for name in ("socket 1", "socket 2", "socket 10", "socket 16", "socketpair AF_UNIX",
                 "AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"):
        assert results[name] == "opened", (name, results[name])
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        assert results[name] in ("EPERM", "ENOSYS"), (name, results[name])
    for name in ("x32 socket", "i386 socket", "i386 socketcall"):
        if name.startswith("i386") and i386_killed:
            assert results[name] == "killed by signal 31", (name, results[name])  # SIGSYS
        else:
            assert results[name] != "opened" and results[name].startswith(("killed", "E")), (name, results[name])


async def test_the_bwrap_sandbox_refuses_foreign_socket_families_io_uring_and_other_abis(tmp_path: Path, dns) -> None:  # type: ignore[no-untyped-def]
    require(os.geteuid() == 0, "the sandbox tests need root (network namespaces, nftables, cgroups)")
    for tool in ("bwrap", "nft", "ip", "nsenter"):
        require(have(tool), f"{tool} is not installed")
    from tests.integration.sandbox.test_sandbox import egressd_run

    code, out, err = await egressd_run(tmp_path, dns, "--", "python3", "-c", PROBE)
    assert code == 0, err
    assert_confined(json.loads(out.strip().splitlines()[-1]), i386_killed=True)


async def test_doctor_says_which_sockets_and_io_uring_the_filter_refuses() -> None:
    require(have("bwrap"), "bubblewrap is not installed")
    from egressd.sandbox.doctor import check_seccomp

    check = await check_seccomp()
    assert check.ok, check
    assert "AF_VSOCK" in check.detail and "io_uring" in check.detail
