"""The sandbox's parts run for real: the seccomp filter inside bubblewrap, and ``egressd doctor``.

Their pure halves (the filter's program, bwrap's argv) are tested in
tests/unit/test_sandbox_units.py; these start processes, so they live here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from egressd.sandbox.seccomp import build_filter
from tests.harness import have, require


def test_seccomp_refuses_the_named_calls_for_real(tmp_path: Path) -> None:
    require(have("bwrap"), "bubblewrap is not installed")
    probe = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "res = {}\n"
        "for name, nr in [('ptrace', 101), ('mount', 165), ('unshare', 272), ('keyctl', 250), ('bpf', 321),"
        " ('userfaultfd', 323), ('perf_event_open', 298), ('setns', 308)]:\n"
        "    rc = libc.syscall(nr, 0, 0, 0, 0, 0)\n"
        "    res[name] = errno.errorcode.get(ctypes.get_errno(), '?') if rc == -1 else 'ran'\n"
        "print(res)\n"
    )
    path = tmp_path / "filter"
    path.write_bytes(build_filter())
    fd = os.open(path, os.O_RDONLY)
    try:
        out = subprocess.run(
            ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
             "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--unshare-user", "--unshare-pid",
             "--seccomp", str(fd), "--", "/usr/bin/python3", "-c", probe],
            capture_output=True, text=True, pass_fds=(fd,), timeout=30,
        )
    finally:
        os.close(fd)
    result = eval(out.stdout)  # a dict literal printed by the probe
    assert all(v == "EPERM" for v in result.values()), result


def test_doctor_reports_every_feature_and_is_green_in_ci() -> None:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("egressd")), "doctor"], capture_output=True, text=True, timeout=60
    )
    features = ("bubblewrap", "network namespaces", "nftables", "seccomp", "cgroup memory limits", "docker",
                "audit line", "rootless: user namespaces", "rootless: nftables in a user namespace",
                "rootless: cgroup delegation", "rootless run")
    for name in features:
        assert name in out.stdout
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        assert out.returncode == 0 and "FAIL" not in out.stdout and " no  " not in out.stdout, out.stdout


def test_doctor_probes_what_an_ordinary_user_gets_as_that_user() -> None:
    """The rootless probes drop to nobody when run as root: what they find is what a user gets, not root."""
    import asyncio

    from egressd.sandbox.rootless import probe

    found = asyncio.run(probe())
    # As nobody, an unshare without a user namespace needs CAP_SYS_ADMIN it has not: refused, whatever root may do.
    refused = subprocess.run(["nsenter", "--setgid", "65534", "--setuid", "65534", "--", "unshare", "--net", "true"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    if os.geteuid() == 0:
        assert refused.returncode != 0, "nobody made a network namespace without a user namespace"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # this machine's kind allows both
        assert found.userns is None and found.nftables is None, found
        assert found.backend.startswith("bubblewrap in a user and network namespace"), found.backend
