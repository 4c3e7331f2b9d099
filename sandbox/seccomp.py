"""The sandbox's system-call policy, one source for both backends (pure).

The policy (DESIGN.md, "The two boundaries", item 1), in the order it is checked:

1. Only the native x86_64 ABI. A call through another one kills the process:
   the i386 ABI (``int 0x80``) numbers its calls differently and hides the
   socket family of ``socketcall`` in memory where no filter can read it. A
   call through the x32 ABI fails with EPERM (under runc, whose libseccomp
   treats x32 as another architecture, it kills the process too).
2. A call newer than ``X86_64_SYSCALLS`` (Linux 6.19), or in a hole of that
   table, fails with ENOSYS, as on an older kernel: the C library falls back,
   and nothing nobody reviewed runs.
3. ``DENIED_SYSCALLS`` fail with EPERM (so programs see an ordinary error, not
   a crash): the usual first step of a kernel or namespace escape, and what a
   build or an agent never needs:
   - debugging other processes: ptrace, process_vm_readv/writev,
     process_madvise, kcmp, pidfd_getfd;
   - mounting, namespaces and roots: mount, umount2, pivot_root, chroot, the
     mount API (fsopen, fsconfig, fsmount, fspick, move_mount, open_tree,
     open_tree_attr, mount_setattr), unshare, setns, listns;
   - kernel keyrings: keyctl, add_key, request_key;
   - kernel extension points: bpf, perf_event_open, userfaultfd,
     fanotify_init, and io_uring_setup, io_uring_enter, io_uring_register
     (io_uring's operations run in kernel workers that seccomp never sees,
     sockets included);
   - kernel and module loading: kexec_load, kexec_file_load, init_module,
     finit_module, delete_module, create_module, query_module,
     get_kernel_syms;
   - host-wide state: reboot, swapon, swapoff, sethostname, setdomainname,
     acct, quotactl, quotactl_fd, syslog, settimeofday, clock_settime,
     clock_adjtime, adjtimex, iopl, ioperm, vhangup, uselib, nfsservctl,
     _sysctl, sysfs, ustat, lookup_dcookie, the LSM attribute calls, and
     name_to_handle_at, open_by_handle_at (the last escapes a bind mount);
   - NUMA placement of memory: mbind, set_mempolicy, set_mempolicy_home_node,
     get_mempolicy, migrate_pages, move_pages.
4. ``socket()`` and ``socketpair()`` only for ``ALLOWED_SOCKET_FAMILIES``
   (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK); any other family fails with
   EAFNOSUPPORT, as on a kernel built without it. AF_VSOCK is the reason:
   network namespaces do not confine it, so on a VM with virtio-vsock
   (Firecracker, Kata, WSL2, Nitro) it reaches the hypervisor's side around
   the veth and the nftables fence. The rest (AF_PACKET, AF_XDP, AF_ALG,
   AF_KEY, Bluetooth, TIPC, RDS, CAN, ...) is kernel surface a build never
   needs. The family is compared on its low 32 bits, the ``int`` the kernel
   reads, so high bits smuggle nothing past the filter.
5. ``clone()`` with any CLONE_NEW* flag: EPERM. ``clone3()``: ENOSYS (its
   flags are in memory; the C library falls back to ``clone``).
6. ``ioctl()`` TIOCSTI and TIOCLINUX (terminal injection), compared on the
   low 32 bits of the command as the kernel reads it: EPERM.
7. Everything else is allowed.

Two renderings of it:

- ``build_filter()``: a classic BPF program for bubblewrap's ``--seccomp FD``;
  bwrap sets no_new_privs and loads it after setting up the sandbox, so it
  binds every process inside.
- ``docker_profile()``: a Docker seccomp profile for the sandbox's containers
  (HostConfig.SecurityOpt ``seccomp=<json>``). Deny-by-default (ENOSYS),
  every call of the table not denied allowed by name, and each argument rule
  as single-condition ``SCMP_CMP_MASKED_EQ`` rules: Docker ORs the rules of a
  call, and runc turns one rule with two conditions on the same argument into
  an OR as well, so a set is written as one rule per member (allow) and one
  per aligned block of its complement (refuse).

How this differs from the others, and why (moby's profiles/seccomp
default.json as of 2026, Docker 20.10's, runc, gVisor):

- Docker's default is an allowlist (about 360 names, more when a capability
  is added) with EPERM for the rest. Our Docker profile is deny-by-default
  too (an engine that predates ``defaultErrnoRet``, like Docker 20.10,
  answers EPERM instead of ENOSYS); the bwrap filter gets the same shape
  from rule 2. Newer than moby's list and allowed here: file_getattr and
  file_setattr (the inode flags chattr sets through ioctl) and uprobe (it
  works only from a uprobe's trampoline).
- Sockets: Docker 20.10 allows every family (a container opened AF_VSOCK,
  also through the i386 ABI, on this project's test machine). moby's default
  refuses AF_VSOCK since December 2022 and now AF_ALG too, with 64-bit
  comparisons (allow below 38, 39, above 40): a family passed with high
  bits set (0x1_0000_0028) is "above 40" to the filter and AF_VSOCK to the
  kernel (tests/integration/sandbox/test_docker_seccomp.py shows it on the engine at hand). Its
  i386 ``socketcall`` is allowed again since 2026 (moby leaves that to an
  LSM); ours kills the process. We allow four families, compared as the
  kernel does, for socketpair() too.
- io_uring: Docker 20.10 allows it; moby's default refuses it since
  November 2023; we refuse.
- ptrace, process_vm_readv/writev: Docker allows them (kernel 4.8 and later
  check seccomp after ptrace); a build needs no debugger, so we refuse.
  adjtimex, clock_adjtime, name_to_handle_at: Docker allows (adjtimex only
  reads without CAP_SYS_TIME); we refuse, nothing here needs them.
- personality: Docker allows five values; we allow all (it changes the
  caller's own execution domain; READ_IMPLIES_EXEC or ADDR_NO_RANDOMIZE
  weaken only the caller's own hardening, not the boundary).
- ioctl: Docker does not filter it (its containers have no terminal); we
  refuse TIOCSTI and TIOCLINUX on both backends alike.
- Calls Docker allows only with a capability (CAP_SYS_ADMIN, CAP_SYS_NICE,
  CAP_SYS_PTRACE, ...): our containers drop every capability and bwrap's
  sandbox has none, so we refuse those calls outright (rule 3), among them
  chroot, fanotify_init, the NUMA calls, process_madvise, quotactl_fd and the
  LSM attribute calls. The never-implemented afs_syscall, getpmsg, putpmsg,
  security, tuxcall and vserver are left to the kernel's own ENOSYS.
- runc has no default profile: it loads what the engine hands it (containerd's
  and Podman's defaults are copies of Docker's).
- gVisor (``runsc``, which the Docker backend uses when the engine has it):
  the sandbox's calls reach gVisor's own kernel, which implements Unix,
  IPv4/IPv6, netlink and packet sockets but not AF_VSOCK, and io_uring only
  under its test-only ``--iouring`` flag. runsc ignores a container's seccomp
  profile unless started with ``--oci-seccomp``, so under runsc it is
  gVisor's surface that holds, not this profile.

Only x86_64 has a table here: elsewhere ``SeccompUnsupported`` is raised
(``egressd run`` then exits 125 saying so) rather than a sandbox being
started without its filter.
"""

from __future__ import annotations

import errno
import platform
import struct
from collections.abc import Iterable
from typing import Any

# arch/x86/entry/syscalls/syscall_64.tbl (Linux 6.19), the native ("common" and
# "64") calls in number order: 0-336, then from 424 on (387-423 are reserved).
_CALLS_FROM_0 = """
read write open close stat fstat lstat poll lseek mmap mprotect munmap brk rt_sigaction rt_sigprocmask
rt_sigreturn ioctl pread64 pwrite64 readv writev access pipe select sched_yield mremap msync mincore madvise
shmget shmat shmctl dup dup2 pause nanosleep getitimer alarm setitimer getpid sendfile socket connect accept
sendto recvfrom sendmsg recvmsg shutdown bind listen getsockname getpeername socketpair setsockopt
getsockopt clone fork vfork execve exit wait4 kill uname semget semop semctl shmdt msgget msgsnd msgrcv
msgctl fcntl flock fsync fdatasync truncate ftruncate getdents getcwd chdir fchdir rename mkdir rmdir creat
link unlink symlink readlink chmod fchmod chown fchown lchown umask gettimeofday getrlimit getrusage sysinfo
times ptrace getuid syslog getgid setuid setgid geteuid getegid setpgid getppid getpgrp setsid setreuid
setregid getgroups setgroups setresuid getresuid setresgid getresgid getpgid setfsuid setfsgid getsid capget
capset rt_sigpending rt_sigtimedwait rt_sigqueueinfo rt_sigsuspend sigaltstack utime mknod uselib
personality ustat statfs fstatfs sysfs getpriority setpriority sched_setparam sched_getparam
sched_setscheduler sched_getscheduler sched_get_priority_max sched_get_priority_min sched_rr_get_interval
mlock munlock mlockall munlockall vhangup modify_ldt pivot_root _sysctl prctl arch_prctl adjtimex setrlimit
chroot sync acct settimeofday mount umount2 swapon swapoff reboot sethostname setdomainname iopl ioperm
create_module init_module delete_module get_kernel_syms query_module quotactl nfsservctl getpmsg putpmsg
afs_syscall tuxcall security gettid readahead setxattr lsetxattr fsetxattr getxattr lgetxattr fgetxattr
listxattr llistxattr flistxattr removexattr lremovexattr fremovexattr tkill time futex sched_setaffinity
sched_getaffinity set_thread_area io_setup io_destroy io_getevents io_submit io_cancel get_thread_area
lookup_dcookie epoll_create epoll_ctl_old epoll_wait_old remap_file_pages getdents64 set_tid_address
restart_syscall semtimedop fadvise64 timer_create timer_settime timer_gettime timer_getoverrun timer_delete
clock_settime clock_gettime clock_getres clock_nanosleep exit_group epoll_wait epoll_ctl tgkill utimes
vserver mbind set_mempolicy get_mempolicy mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify
mq_getsetattr kexec_load waitid add_key request_key keyctl ioprio_set ioprio_get inotify_init
inotify_add_watch inotify_rm_watch migrate_pages openat mkdirat mknodat fchownat futimesat newfstatat
unlinkat renameat linkat symlinkat readlinkat fchmodat faccessat pselect6 ppoll unshare set_robust_list
get_robust_list splice tee sync_file_range vmsplice move_pages utimensat epoll_pwait signalfd timerfd_create
eventfd fallocate timerfd_settime timerfd_gettime accept4 signalfd4 eventfd2 epoll_create1 dup3 pipe2
inotify_init1 preadv pwritev rt_tgsigqueueinfo perf_event_open recvmmsg fanotify_init fanotify_mark
prlimit64 name_to_handle_at open_by_handle_at clock_adjtime syncfs sendmmsg setns getcpu process_vm_readv
process_vm_writev kcmp finit_module sched_setattr sched_getattr renameat2 seccomp getrandom memfd_create
kexec_file_load bpf execveat userfaultfd membarrier mlock2 copy_file_range preadv2 pwritev2 pkey_mprotect
pkey_alloc pkey_free statx io_pgetevents rseq uretprobe uprobe
"""
_CALLS_FROM_424 = """
pidfd_send_signal io_uring_setup io_uring_enter io_uring_register open_tree move_mount fsopen fsconfig
fsmount fspick pidfd_open clone3 close_range openat2 pidfd_getfd faccessat2 process_madvise epoll_pwait2
mount_setattr quotactl_fd landlock_create_ruleset landlock_add_rule landlock_restrict_self memfd_secret
process_mrelease futex_waitv set_mempolicy_home_node cachestat fchmodat2 map_shadow_stack futex_wake
futex_wait futex_requeue statmount listmount lsm_get_self_attr lsm_set_self_attr lsm_list_modules mseal
setxattrat getxattrat listxattrat removexattrat open_tree_attr file_getattr file_setattr listns
"""

X86_64_SYSCALLS: dict[str, int] = {
    **{name: nr for nr, name in enumerate(_CALLS_FROM_0.split())},
    **{name: 424 + i for i, name in enumerate(_CALLS_FROM_424.split())},
}

_DENIED_NAMES = """
ptrace process_vm_readv process_vm_writev process_madvise kcmp pidfd_getfd
mount umount2 pivot_root chroot fsopen fsconfig fsmount fspick move_mount open_tree open_tree_attr mount_setattr
unshare setns listns
keyctl add_key request_key
bpf perf_event_open userfaultfd fanotify_init io_uring_setup io_uring_enter io_uring_register
kexec_load kexec_file_load init_module finit_module delete_module create_module query_module get_kernel_syms
reboot swapon swapoff sethostname setdomainname acct quotactl quotactl_fd syslog settimeofday clock_settime
clock_adjtime adjtimex iopl ioperm vhangup uselib nfsservctl _sysctl sysfs ustat lookup_dcookie
lsm_get_self_attr lsm_set_self_attr lsm_list_modules name_to_handle_at open_by_handle_at
mbind set_mempolicy set_mempolicy_home_node get_mempolicy migrate_pages move_pages
"""
DENIED_SYSCALLS: dict[str, int] = {name: X86_64_SYSCALLS[name] for name in _DENIED_NAMES.split()}

# <linux/socket.h>: the families a build, a package manager or an agent uses
# (local IPC, TCP/UDP through egressd, and netlink, which the C library's
# getaddrinfo and `ip` read interfaces with).
ALLOWED_SOCKET_FAMILIES: dict[str, int] = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}

_CLONE = X86_64_SYSCALLS["clone"]
_CLONE3 = X86_64_SYSCALLS["clone3"]
_IOCTL = X86_64_SYSCALLS["ioctl"]
_SOCKET_CALLS = ("socket", "socketpair")
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
TERMINAL_INJECTION_IOCTLS = (_TIOCSTI, _TIOCLINUX)
# What the kernel reads of an int argument (socket's family, ioctl's command).
_LOW32 = 0xFFFFFFFF

# <linux/filter.h>, <linux/bpf_common.h>
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGT_K = 0x25
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

# <linux/seccomp.h>
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# struct seccomp_data offsets: nr, arch, instruction_pointer, args[6] (u64, little-endian).
_OFF_NR = 0
_OFF_ARCH = 4


def _arg_low(index: int) -> int:
    return 16 + 8 * index


class SeccompUnsupported(Exception):
    """The policy's system call numbers are x86_64's; this machine is another."""


def check_machine(machine: str | None = None) -> None:
    """Raise ``SeccompUnsupported`` unless ``machine`` (default: this one) is x86_64.

    Docker's /version names it ``amd64``, ``platform.machine()`` ``x86_64``.
    """
    machine = machine or platform.machine()
    if machine not in ("x86_64", "amd64", "AMD64"):
        raise SeccompUnsupported(
            f"the sandbox's system-call filter is written for x86_64 and this machine is {machine}: "
            "egressd does not start a sandbox without it"
        )


def _unknown_ranges() -> list[tuple[int, int | None]]:
    """The numbers no call of the table has, as (first, last) ranges; last None: no end."""
    known = sorted(X86_64_SYSCALLS.values())
    gaps = [(a + 1, b - 1) for a, b in zip(known, known[1:], strict=False) if b > a + 1]
    return [*gaps, (known[-1] + 1, None)]


def low32_blocks_outside(values: Iterable[int]) -> list[tuple[int, int]]:
    """Aligned blocks covering every 32-bit number but ``values``, as (mask, value) pairs.

    ``x & mask == value`` holds exactly for the numbers of one block, whatever
    the high 32 bits of ``x``; together the blocks match precisely the
    numbers that are not in ``values``. A single-condition rule per block is
    how "not one of these" is written where a call's rules are ORed.
    """
    taken = sorted(set(values))
    blocks: list[tuple[int, int]] = []
    start = 0
    for end in [*taken, 1 << 32]:  # the free stretch [start, end)
        while start < end:
            size = start & -start if start else 1 << 32
            while size > end - start:
                size //= 2
            blocks.append((_LOW32 & ~(size - 1), start))
            start += size
        start = end + 1
    return blocks


# -- the bwrap rendering: classic BPF ------------------------------------------------------


def _stmt(code: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, 0, 0, k)


def _jump(code: int, k: int, jt: int, jf: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _ret(value: int) -> bytes:
    return _stmt(_RET_K, value)


def build_filter(machine: str | None = None) -> bytes:
    """The BPF program (``struct sock_filter[]`` bytes) for ``bwrap --seccomp``, rules 1-7 above."""
    check_machine(machine)
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    prog = [
        _stmt(_LD_W_ABS, _OFF_ARCH),
        _jump(_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        _ret(RET_KILL_PROCESS),
        _stmt(_LD_W_ABS, _OFF_NR),
        _jump(_JGE_K, X32_SYSCALL_BIT, 0, 1),
        _ret(eperm),
    ]
    for first, last in _unknown_ranges():
        if last is None:
            prog += [_jump(_JGE_K, first, 0, 1), _ret(enosys)]
        else:
            prog += [_jump(_JGE_K, first, 0, 2), _jump(_JGT_K, last, 1, 0), _ret(enosys)]
    for nr in sorted(DENIED_SYSCALLS.values()):
        prog += [_jump(_JEQ_K, nr, 0, 1), _ret(eperm)]
    prog += [_jump(_JEQ_K, _CLONE3, 0, 1), _ret(enosys)]
    # clone(flags, ...): refuse any new namespace; then reload nr for the next check.
    prog += [
        _jump(_JEQ_K, _CLONE, 0, 3),
        _stmt(_LD_W_ABS, _arg_low(0)),
        _jump(_JSET_K, CLONE_NEW_FLAGS, 0, 1),
        _ret(eperm),
        _stmt(_LD_W_ABS, _OFF_NR),
    ]
    # ioctl(fd, cmd, ...): refuse pushing input into a terminal.
    prog += [
        _jump(_JEQ_K, _IOCTL, 0, 5),
        _stmt(_LD_W_ABS, _arg_low(1)),
        _jump(_JEQ_K, _TIOCSTI, 1, 0),
        _jump(_JEQ_K, _TIOCLINUX, 0, 1),
        _ret(eperm),
        _stmt(_LD_W_ABS, _OFF_NR),
    ]
    # socket(family, ...) and socketpair(family, ...): the allowed families, else EAFNOSUPPORT.
    families = sorted(ALLOWED_SOCKET_FAMILIES.values())
    body = [_stmt(_LD_W_ABS, _arg_low(0))]
    body += [_jump(_JEQ_K, family, len(families) - i, 0) for i, family in enumerate(families)]
    body += [_ret(RET_ERRNO | errno.EAFNOSUPPORT), _ret(RET_ALLOW)]
    socket_nr, socketpair_nr = (X86_64_SYSCALLS[name] for name in _SOCKET_CALLS)
    prog += [_jump(_JEQ_K, socket_nr, 1, 0), _jump(_JEQ_K, socketpair_nr, 0, len(body)), *body]
    prog.append(_ret(RET_ALLOW))
    return b"".join(prog)


# -- the Docker rendering: a seccomp profile -------------------------------------------------


def _masked(index: int, mask: int, value: int) -> dict[str, Any]:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _rule(names: Iterable[str], action: str, *, errno_ret: int | None = None,
          arg: dict[str, Any] | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"names": list(names), "action": action}
    if errno_ret is not None:
        rule["errnoRet"] = errno_ret
    if arg is not None:
        rule["args"] = [arg]
    return rule


def docker_profile(machine: str | None = None) -> dict[str, Any]:
    """The Docker seccomp profile for the sandbox's containers: rules 1-7 above, by name.

    Not a capability-dependent rule in it: the containers drop them all.
    """
    check_machine(machine)
    errno_act, allow = "SCMP_ACT_ERRNO", "SCMP_ACT_ALLOW"
    special = {"clone", "clone3", "ioctl", *_SOCKET_CALLS}
    plain = sorted(name for name in X86_64_SYSCALLS if name not in DENIED_SYSCALLS and name not in special)
    families = sorted(ALLOWED_SOCKET_FAMILIES.values())
    bits = [1 << i for i in range(32) if CLONE_NEW_FLAGS & (1 << i)]
    rules = [
        _rule(plain, allow),
        _rule(sorted(DENIED_SYSCALLS), errno_act, errno_ret=errno.EPERM),
        _rule(["clone3"], errno_act, errno_ret=errno.ENOSYS),
        _rule(["clone"], allow, arg=_masked(0, CLONE_NEW_FLAGS, 0)),
        *(_rule(["clone"], errno_act, errno_ret=errno.EPERM, arg=_masked(0, bit, bit)) for bit in bits),
        *(_rule(["ioctl"], errno_act, errno_ret=errno.EPERM, arg=_masked(1, _LOW32, cmd))
          for cmd in TERMINAL_INJECTION_IOCTLS),
        *(_rule(["ioctl"], allow, arg=_masked(1, mask, value))
          for mask, value in low32_blocks_outside(TERMINAL_INJECTION_IOCTLS)),
        *(_rule(_SOCKET_CALLS, allow, arg=_masked(0, _LOW32, family)) for family in families),
        *(_rule(_SOCKET_CALLS, errno_act, errno_ret=errno.EAFNOSUPPORT, arg=_masked(0, mask, value))
          for mask, value in low32_blocks_outside(families)),
    ]
    return {
        # A call the table does not name: ENOSYS, as on an older kernel (rule 2).
        "defaultAction": errno_act,
        "defaultErrnoRet": errno.ENOSYS,
        # Only the native ABI: i386 and x32 calls get the runtime's bad-architecture action.
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": rules,
    }
