"""The sandbox's seccomp filter, built as a classic BPF program (pure).

bubblewrap loads it with ``--seccomp FD`` after setting up the sandbox, so it
binds every process inside. The policy is an allowlist-by-default with a
denylist of system calls that a build or an agent never needs and that are the
usual first step of a kernel or namespace escape. Each refused call fails with
EPERM (so programs see an ordinary error, not a crash); ``clone3`` fails with
ENOSYS so the C library falls back to ``clone``, whose flags we can inspect.

Refused (x86_64):
- debugging other processes: ptrace, process_vm_readv/writev, kcmp, pidfd_getfd;
- mounting and namespaces: mount, umount2, pivot_root, fsopen, fsconfig,
  fsmount, fspick, move_mount, open_tree, mount_setattr, unshare, setns, and
  ``clone`` with any CLONE_NEW* flag;
- kernel keyrings: keyctl, add_key, request_key;
- kernel extension points: bpf, perf_event_open, userfaultfd, io_uring_setup,
  io_uring_enter, io_uring_register (io_uring's operations are not seen by seccomp);
- kernel and module loading: kexec_load, kexec_file_load, init_module,
  finit_module, delete_module, create_module, query_module, get_kernel_syms;
- host-wide state: reboot, swapon, swapoff, sethostname, setdomainname, acct,
  quotactl, syslog, settimeofday, clock_settime, clock_adjtime, adjtimex,
  iopl, ioperm, vhangup, uselib, nfsservctl, _sysctl, lookup_dcookie,
  name_to_handle_at, open_by_handle_at (the last escapes a bind mount);
- terminal injection: ioctl TIOCSTI and TIOCLINUX;
- every x32-ABI call (a second syscall table that would dodge the numbers above);
- a foreign architecture kills the process (the numbers would not match).
"""

from __future__ import annotations

import errno
import platform
import struct

# <linux/filter.h>, <linux/bpf_common.h>
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

# <linux/seccomp.h>
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

# struct seccomp_data offsets: nr, arch, instruction_pointer, args[6] (u64, little-endian).
_OFF_NR = 0
_OFF_ARCH = 4


def _arg_low(index: int) -> int:
    return 16 + 8 * index


DENIED_SYSCALLS: dict[str, int] = {
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "pidfd_getfd": 438,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "unshare": 272,
    "setns": 308,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "create_module": 174,
    "query_module": 178,
    "get_kernel_syms": 177,
    "reboot": 169,
    "swapon": 167,
    "swapoff": 168,
    "sethostname": 170,
    "setdomainname": 171,
    "acct": 163,
    "quotactl": 179,
    "syslog": 103,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "adjtimex": 159,
    "iopl": 172,
    "ioperm": 173,
    "vhangup": 153,
    "uselib": 134,
    "nfsservctl": 180,
    "_sysctl": 156,
    "lookup_dcookie": 212,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
}

_CLONE = 56
_CLONE3 = 435
_IOCTL = 16
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C


class SeccompUnsupported(Exception):
    """The filter is written for x86_64 system call numbers."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def build_filter(machine: str | None = None) -> bytes:
    """The BPF program (``struct sock_filter[]`` bytes) for ``bwrap --seccomp``."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "amd64", "AMD64"):
        raise SeccompUnsupported(f"no seccomp filter for {machine}; only x86_64 is supported")
    eperm = _RET_ERRNO | errno.EPERM
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
        _insn(_JGE_K, 0, 1, _X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, eperm),
    ]
    for nr in sorted(DENIED_SYSCALLS.values()):
        prog += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, eperm)]
    prog += [_insn(_JEQ_K, 0, 1, _CLONE3), _insn(_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    # clone(flags, ...): refuse any new namespace; then reload nr for the next check.
    prog += [
        _insn(_JEQ_K, 0, 3, _CLONE),
        _insn(_LD_W_ABS, 0, 0, _arg_low(0)),
        _insn(_JSET_K, 0, 1, _CLONE_NEW_FLAGS),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    # ioctl(fd, cmd, ...): refuse pushing input into a terminal.
    prog += [
        _insn(_JEQ_K, 0, 4, _IOCTL),
        _insn(_LD_W_ABS, 0, 0, _arg_low(1)),
        _insn(_JEQ_K, 1, 0, _TIOCSTI),
        _insn(_JEQ_K, 0, 1, _TIOCLINUX),
        _insn(_RET_K, 0, 0, eperm),
    ]
    prog.append(_insn(_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(prog)
