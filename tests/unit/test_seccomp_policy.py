"""The sandbox's system-call policy, decided on paper: its BPF program and its Docker profile.

The BPF program runs on synthetic ``seccomp_data`` in a small classic-BPF
interpreter, and the Docker profile is read the way Docker and runc apply it
(a call's rules ORed, a rule's conditions ANDed), so both renderings are held
to the same decisions. The real thing (the probe inside a bubblewrap sandbox,
``egressd run`` on another architecture): tests/integration/sandbox/test_seccomp.py.
"""

from __future__ import annotations

import errno
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.sandbox import seccomp

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
ALLOW = 0x7FFF0000
KILL_PROCESS = 0x80000000
ERRNO = 0x00050000
ALLOWED_FAMILIES = {1, 2, 10, 16}  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK: DESIGN.md, "The two boundaries"
AF_VSOCK = 40
SOCKET, SOCKETPAIR, IOCTL, CLONE = 41, 53, 16, 56
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
HIGH = 1 << 32  # a bit the kernel drops when it reads an int argument


def errno_of(action: int) -> int:
    return ERRNO | action


# -- a classic-BPF interpreter (the subset a seccomp filter may use) --------------------------


def run_bpf(program: bytes, nr: int, args: Sequence[int] = (), arch: int = AUDIT_ARCH_X86_64) -> int:
    """What the kernel would do with ``program`` for one call: the filter's return value."""
    words = [a & (2**64 - 1) for a in args] + [0] * (6 - len(args))
    data = struct.pack("<IIQ6Q", nr & 0xFFFFFFFF, arch, 0, *words)
    insns = [struct.unpack("<HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    for _ in range(len(insns)):  # classic BPF only jumps forward: each instruction runs at most once
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x25, 0x35, 0x45):  # BPF_JMP | JEQ, JGT, JGE, JSET with K
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"instruction {code:#x} is not expected in the filter")
    raise AssertionError("the program ran off its end")


def bpf(nr: int | str, *args: int, arch: int = AUDIT_ARCH_X86_64) -> int:
    number = seccomp.X86_64_SYSCALLS[nr] if isinstance(nr, str) else nr
    return run_bpf(seccomp.build_filter("x86_64"), number, args, arch)


# -- a Docker profile, read the way Docker and runc apply it ----------------------------------


def _action(rule: dict[str, Any], default_errno: int = errno.EPERM) -> int:
    if rule["action"] == "SCMP_ACT_ALLOW":
        return ALLOW
    assert rule["action"] == "SCMP_ACT_ERRNO", rule["action"]
    return ERRNO | rule.get("errnoRet", default_errno)


def _holds(cond: dict[str, Any], args: Sequence[int]) -> bool:
    arg = (list(args) + [0] * 6)[cond["index"]] & (2**64 - 1)
    value, two = cond["value"], cond.get("valueTwo", 0)
    return {
        "SCMP_CMP_EQ": arg == value, "SCMP_CMP_NE": arg != value, "SCMP_CMP_LT": arg < value,
        "SCMP_CMP_LE": arg <= value, "SCMP_CMP_GT": arg > value, "SCMP_CMP_GE": arg >= value,
        "SCMP_CMP_MASKED_EQ": arg & value == two,
    }[cond["op"]]


def profile_decides(profile: dict[str, Any], name: str, args: Sequence[int] = ()) -> int:
    """The action ``profile`` takes for ``name(args)`` on the native architecture."""
    default = ERRNO | profile.get("defaultErrnoRet", errno.EPERM)
    actions = set()
    for rule in profile["syscalls"]:
        if name not in rule["names"]:
            continue
        conds = rule.get("args") or []
        # runc would turn two conditions on one argument into an OR: never write one.
        assert len({c["index"] for c in conds}) == len(conds), rule
        if all(_holds(c, args) for c in conds):
            actions.add(_action(rule))
    # Which of two matching rules wins is the runtime's choice: never leave it one.
    assert len(actions) <= 1, (name, args, actions)
    return actions.pop() if actions else default


# -- the policy, decided by the BPF program --------------------------------------------------


@pytest.mark.parametrize("call", ["socket", "socketpair"])
def test_every_socket_family_but_unix_inet_inet6_netlink_is_refused_with_eafnosupport(call: str) -> None:
    for family in range(256):
        expected = ALLOW if family in ALLOWED_FAMILIES else errno_of(errno.EAFNOSUPPORT)
        assert bpf(call, family, 1, 0) == expected, (call, family)
    assert bpf(call, 2**32 - 1, 1, 0) == errno_of(errno.EAFNOSUPPORT)  # -1 as an int


def test_high_bits_do_not_smuggle_a_refused_family_past_the_filter() -> None:
    # The kernel reads the family as an int: 0x1_0000_0028 is AF_VSOCK to it.
    for family in (AF_VSOCK | HIGH, AF_VSOCK | (2**63), 17 | HIGH):
        assert bpf("socket", family, 1, 0) == errno_of(errno.EAFNOSUPPORT)
        assert bpf("socketpair", family, 1, 0) == errno_of(errno.EAFNOSUPPORT)
    assert bpf("socket", 2 | HIGH, 1, 0) == ALLOW  # AF_INET to the kernel: allowed, nothing gained


def test_io_uring_calls_are_refused() -> None:
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        assert bpf(name, 1, 0) == errno_of(errno.EPERM)


def test_a_call_newer_than_the_table_or_in_its_hole_fails_with_enosys() -> None:
    newest = max(seccomp.X86_64_SYSCALLS.values())
    for nr in (newest + 1, newest + 100, 337, 400, 423, 0x3FFFFFFF):
        assert bpf(nr) == errno_of(errno.ENOSYS), nr
    assert bpf("file_setattr") == ALLOW and bpf("pidfd_send_signal") == ALLOW and bpf("uprobe") == ALLOW


def test_a_foreign_architecture_is_killed_and_the_x32_abi_refused() -> None:
    assert bpf(359, AF_VSOCK, 1, 0, arch=AUDIT_ARCH_I386) == KILL_PROCESS  # i386 socket()
    assert bpf(102, 1, 0, arch=AUDIT_ARCH_I386) == KILL_PROCESS  # i386 socketcall(SYS_SOCKET, args)
    assert bpf(0x40000000 | SOCKET, AF_VSOCK, 1, 0) == errno_of(errno.EPERM)


def test_namespace_flags_of_clone_are_refused_and_clone3_says_enosys() -> None:
    assert bpf("clone", 0x01200011) == ALLOW  # what fork() passes
    for flag in (0x00020000, 0x10000000, 0x40000000, 0x80):  # NEWNS, NEWUSER, NEWNET, NEWTIME
        assert bpf("clone", 0x01200011 | flag) == errno_of(errno.EPERM)
    assert bpf("clone3", 0) == errno_of(errno.ENOSYS)


def test_terminal_injection_ioctls_are_refused_even_with_high_bits() -> None:
    for cmd in (TIOCSTI, TIOCLINUX, TIOCSTI | HIGH):
        assert bpf("ioctl", 0, cmd) == errno_of(errno.EPERM)
    assert bpf("ioctl", 0, 0x5401) == ALLOW  # TCGETS


def test_the_named_calls_are_refused_with_eperm_and_ordinary_ones_allowed() -> None:
    for name in ("ptrace", "mount", "unshare", "setns", "bpf", "keyctl", "chroot", "quotactl_fd", "mbind",
                 "open_tree_attr", "fanotify_init", "process_madvise"):
        assert name in seccomp.DENIED_SYSCALLS
        assert bpf(name) == errno_of(errno.EPERM), name
    for name in ("read", "openat", "execve", "connect", "futex", "rseq", "clock_gettime", "landlock_create_ruleset"):
        assert bpf(name) == ALLOW, name


def test_the_table_agrees_with_this_machines_kernel_headers() -> None:
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip("no x86_64 kernel headers here to compare the table with")
    theirs = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", header.read_text())}
    assert theirs and {name: seccomp.X86_64_SYSCALLS.get(name) for name in theirs} == theirs


# -- the Docker rendering --------------------------------------------------------------------


_INTERESTING = [0, 1, 2, 10, 16, 17, AF_VSOCK, AF_VSOCK | HIGH, 2 | HIGH, TIOCSTI, TIOCLINUX, TIOCSTI | HIGH,
                0x80, 0x00020000, 0x10000000, 0x01200011, 2**32 - 1, 2**64 - 1]
_args = st.lists(st.one_of(st.sampled_from(_INTERESTING), st.integers(0, 2**64 - 1)), min_size=2, max_size=2)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(sorted(seccomp.X86_64_SYSCALLS)), args=_args)
def test_the_docker_profile_decides_every_call_like_the_bpf_filter(name: str, args: list[int]) -> None:
    assert profile_decides(seccomp.docker_profile("x86_64"), name, args) == bpf(name, *args)


def test_the_docker_profile_decides_each_socket_family_like_the_bpf_filter() -> None:
    profile = seccomp.docker_profile("x86_64")
    for name in ("socket", "socketpair"):
        for family in [*range(300), *(f | HIGH for f in range(64)), 2**32 - 1, 2**64 - 1]:
            assert profile_decides(profile, name, [family]) == bpf(name, family), (name, family)
    assert profile_decides(profile, "socket", [AF_VSOCK | HIGH]) == errno_of(errno.EAFNOSUPPORT)


def test_the_docker_profile_admits_only_the_native_abi_and_refuses_unknown_calls() -> None:
    profile = seccomp.docker_profile("amd64")
    assert profile["architectures"] == ["SCMP_ARCH_X86_64"] and "archMap" not in profile
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == errno.ENOSYS
    assert profile_decides(profile, "some_call_from_the_future") == errno_of(errno.ENOSYS)
    named = {name for rule in profile["syscalls"] for name in rule["names"]}
    assert named <= set(seccomp.X86_64_SYSCALLS)  # no name a typo made up (runc would skip it)


@settings(max_examples=300, deadline=None)
@given(values=st.sets(st.integers(0, 2**32 - 1), max_size=6), probe=st.integers(0, 2**64 - 1))
def test_the_complement_blocks_match_exactly_what_is_not_listed(values: set[int], probe: int) -> None:
    blocks = seccomp.low32_blocks_outside(values)
    for x in [probe, *values, *(v + 1 for v in values), *(v - 1 for v in values if v)]:
        hits = [b for b in blocks if x & b[0] == b[1]]
        assert len(hits) == (0 if x & 0xFFFFFFFF in values else 1), (x, hits)


# -- another architecture --------------------------------------------------------------------


def test_another_architecture_gets_neither_a_filter_nor_a_profile() -> None:
    for machine in ("aarch64", "arm64", "i686", "riscv64"):
        with pytest.raises(seccomp.SeccompUnsupported, match=f"written for x86_64 and this machine is {machine}"):
            seccomp.build_filter(machine)
        with pytest.raises(seccomp.SeccompUnsupported):
            seccomp.docker_profile(machine)


def test_no_sandbox_and_no_sandbox_container_is_made_without_the_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import platform

    from egressd.sandbox.backend import SandboxError
    from egressd.sandbox.docker.config import CommandSpec, command_config
    from egressd.sandbox.launcher import BwrapSandbox

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(SandboxError, match="this machine is aarch64"):
        BwrapSandbox(network=None, workdir=tmp_path, proxy_url="http://r:t@169.254.100.1:3128")  # type: ignore[arg-type]
    spec = CommandSpec(image="img", argv=["true"], env={}, workdir="/w", network="net", address="169.254.64.3",
                       dns="169.254.64.2", labels={}, machine="arm64")
    with pytest.raises(SandboxError, match="this machine is arm64"):
        command_config(spec)
