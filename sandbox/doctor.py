"""``egressd doctor``: which sandbox features work on this machine, and why not.

Each check really tries the feature (creates a namespace, starts bubblewrap,
loads the seccomp filter, makes a cgroup, asks the Docker Engine) and says,
when it fails, the exact reason and the fix.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from . import rootless
from .limits import Limits, cgroup_mode
from .probe import run_probe as _run
from .seccomp import SeccompUnsupported, build_filter, check_machine

DOCKER_SOCKET = "/var/run/docker.sock"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # needed by the bwrap backend
    info: bool = False  # what this machine offers something not built yet: said, never a failure


_BWRAP_PROBE = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--unshare-user",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--cap-drop", "ALL", "--die-with-parent"]


async def check_bwrap() -> Check:
    if shutil.which("bwrap") is None:
        return Check("bubblewrap", False, "bwrap is not installed", "apt-get install bubblewrap")
    code, version = await _run("bwrap", "--version")
    # As the sandbox starts it: as an ordinary user (the working directory's owner), never as root,
    # so the user namespace must be one an unprivileged user may create.
    unprivileged = ["nsenter", "--setgid", "65534", "--setuid", "65534", "--"] if os.geteuid() == 0 else []
    code, out = await _run(*unprivileged, "bwrap", *_BWRAP_PROBE, "--", "/bin/true")
    if code != 0:
        return Check("bubblewrap", False, f"{version} cannot start a sandbox as an ordinary user: {out}",
                     "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                     "user.max_user_namespaces>0; on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0 "
                     "or an AppArmor profile for bwrap)")
    return Check("bubblewrap", True, f"{version}; user, PID, IPC and UTS namespaces work")


async def check_netns() -> Check:
    if os.geteuid() != 0:
        return Check("network namespaces", False, "not root: creating a namespace and a veth needs CAP_NET_ADMIN",
                     "run egressd run as root")
    if shutil.which("ip") is None:
        return Check("network namespaces", False, "ip (iproute2) is not installed", "apt-get install iproute2")
    name = f"egd-doctor{os.getpid()}"
    code, out = await _run("ip", "netns", "add", name)
    if code != 0:
        return Check("network namespaces", False, f"ip netns add failed: {out}",
                     "run as root on a kernel with network namespaces")
    try:
        code, out = await _run("ip", "link", "add", f"egdd{os.getpid() % 100000}h", "type", "veth",
                               "peer", "name", f"egdd{os.getpid() % 100000}s", "netns", name)
        if code != 0:
            return Check("network namespaces", False, f"cannot create a veth pair: {out}",
                         "load the veth module (modprobe veth)")
        return Check("network namespaces", True, "namespaces and veth pairs can be created")
    finally:
        await _run("ip", "netns", "del", name)
        await _run("ip", "link", "del", f"egdd{os.getpid() % 100000}h")


async def check_nftables() -> Check:
    if shutil.which("nft") is None:
        return Check("nftables", False, "nft is not installed", "apt-get install nftables")
    if os.geteuid() != 0:
        return Check("nftables", False, "not root", "run as root")
    name = f"egd-doctornft{os.getpid()}"
    code, out = await _run("ip", "netns", "add", name)
    if code != 0:
        return Check("nftables", False, f"no namespace to test in: {out}", "see network namespaces")
    try:
        code, out = await _run("ip", "netns", "exec", name, "nft", "add", "table", "inet", "egressd_probe")
        if code != 0:
            return Check("nftables", False, f"cannot add a table: {out}", "load nf_tables (modprobe nf_tables)")
        return Check("nftables", True, "tables can be loaded in a namespace")
    finally:
        await _run("ip", "netns", "del", name)


async def check_cgroups() -> Check:
    mode, why = cgroup_mode()
    if mode is None:
        return Check("cgroup memory limits", False,
                     why + "; falling back to RLIMIT_AS (allocations fail instead of exit 137)",
                     "run as root on a host with a writable cgroup memory controller", required=False)
    from .limits import Cgroup

    cg = Cgroup.create(f"doctor{os.getpid()}", Limits(memory_mb=64))
    if cg is None:
        return Check("cgroup memory limits", False, f"{why}, but a cgroup could not be created",
                     "check permissions on /sys/fs/cgroup", required=False)
    await cg.remove()
    return Check("cgroup memory limits", True, why, required=False)


# Inside the filtered probe: what an AF_VSOCK socket and an io_uring instance get.
_SOCKET_PROBE = (
    "import ctypes, errno, socket\n"
    "try:\n"
    "    socket.socket(40, socket.SOCK_STREAM).close()\n"
    "    vsock = 'opened'\n"
    "except OSError as exc:\n"
    "    vsock = errno.errorcode.get(exc.errno, '?')\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "rc = libc.syscall(425, 1, ctypes.create_string_buffer(120))\n"
    "print('vsock=' + vsock, 'io_uring=' + ('opened' if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), '?')))\n"
)
_PYTHON = "/usr/bin/python3"


def _host_has_vsock() -> bool:
    """Whether this host opens AF_VSOCK sockets (a VM's way to its hypervisor); nothing is connected."""
    try:
        socket.socket(40, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


async def check_seccomp() -> Check:
    try:
        program = build_filter()
    except SeccompUnsupported as exc:
        return Check("seccomp", False, str(exc), "egressd's sandboxes need an x86_64 machine")
    if shutil.which("bwrap") is None:
        return Check("seccomp", False, "needs bubblewrap", "apt-get install bubblewrap")
    with tempfile.TemporaryFile() as fh:
        fh.write(program)
        fh.flush()
        fd = fh.fileno()

        async def probe(*argv: str) -> tuple[int, str]:
            fh.seek(0)
            return await _run("bwrap", *_BWRAP_PROBE, "--seccomp", str(fd), "--", *argv, pass_fds=(fd,))

        code, out = await probe("/bin/sh", "-c", "unshare -U true 2>/dev/null && echo escaped || echo refused")
        if code != 0 or "refused" not in out:
            return Check("seccomp", False, f"the filter did not load or did not refuse unshare: {out}",
                         "a kernel with seccomp-bpf (CONFIG_SECCOMP_FILTER)")
        if not os.path.exists(_PYTHON):  # noqa: ASYNC240 - one stat of a local path, not worth a thread
            tried = "AF_VSOCK and io_uring not tried (no python3)"
        else:
            code, out = await probe(_PYTHON, "-c", _SOCKET_PROBE)
            if code != 0 or out.split() != ["vsock=EAFNOSUPPORT", "io_uring=EPERM"]:
                return Check("seccomp", False, f"the filter did not refuse AF_VSOCK or io_uring: {out}",
                             "report this: the filter is not the one egressd builds")
            tried = "AF_VSOCK: EAFNOSUPPORT, io_uring: EPERM"
    host = "; this host has AF_VSOCK (a way to its hypervisor), refused inside" if _host_has_vsock() else ""
    return Check("seccomp", True, "filter loads; sockets but AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK, io_uring, "
                 f"unshare, mount, ptrace, bpf, keyctl, ... are refused ({tried}){host}")


async def check_docker() -> Check:
    if not os.path.exists(DOCKER_SOCKET):  # noqa: ASYNC240 - one stat of a local socket path, not worth a thread
        return Check("docker", False, f"no Docker Engine socket at {DOCKER_SOCKET}", "install and start Docker Engine",
                     required=False)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(3):
            await loop.sock_connect(sock, DOCKER_SOCKET)
            await loop.sock_sendall(sock, b"GET /version HTTP/1.0\r\nHost: docker\r\n\r\n")
            data = b""
            while chunk := await loop.sock_recv(sock, 65536):
                data += chunk
    except (OSError, TimeoutError) as exc:
        return Check("docker", False, f"cannot talk to the Docker Engine: {exc}",
                     "start dockerd; check the socket's permissions", required=False)
    finally:
        sock.close()
    import json

    head, _, body = data.partition(b"\r\n\r\n")
    try:
        version = json.loads(body).get("Version", "?")
    except ValueError:
        return Check("docker", False, f"unexpected answer from the Docker Engine: {head[:80]!r}", "check dockerd",
                     required=False)
    try:
        check_machine(json.loads(body).get("Arch") or None)
    except SeccompUnsupported as exc:
        return Check("docker", False, f"Docker Engine {version}: {exc}", "an x86_64 Docker Engine", required=False)
    detail = f"Docker Engine {version} answers on {DOCKER_SOCKET}; sandbox containers get egressd's seccomp profile"
    return Check("docker", True, detail + await _docker_images(), required=False)


async def _docker_images() -> str:
    """Whether the images ``egressd run --backend docker`` uses by default are here."""
    from .docker.config import DEFAULT_EGRESSD_IMAGE, DEFAULT_IMAGE
    from .docker.engine import DockerEngine, DockerUnavailable

    try:
        async with DockerEngine.connect() as engine:
            images = (DEFAULT_EGRESSD_IMAGE, DEFAULT_IMAGE)
            missing = [image for image in images if not await engine.image_exists(image)]
    except DockerUnavailable as exc:
        return f"; cannot list images: {exc}"
    if missing:
        return f"; {' and '.join(missing)} not built yet (bash docker/build.sh)"
    return f"; images {DEFAULT_EGRESSD_IMAGE} and {DEFAULT_IMAGE} are here"


async def clean_docker() -> list[str]:
    """Remove containers, networks and volumes of Docker runs whose egressd died, then their fences on the host
    ([] without Docker)."""
    from .docker.engine import DockerEngine, DockerUnavailable, clean_leftovers
    from .docker.fence import clean_leftover_fences

    try:
        async with DockerEngine.connect() as engine:
            removed = await clean_leftovers(engine)
    except DockerUnavailable:
        return []
    return removed + [f"nft table {table}" for table in await clean_leftover_fences()]


# A run's private temporary directories carry its run key (sandbox/network.py's 8 hex
# characters), so a dead run's are told apart from a live run's and from anyone else's.
# egressd-work-* carries none and may hold a user's files: never removed here.
_RUN_TMP = re.compile(r"egressd-(?:etc|run)-(?P<key>[0-9a-f]{8})-[A-Za-z0-9_]+")


def stale_tmp_names(names: Iterable[str], alive: Callable[[str], bool]) -> list[str]:
    """The names of dead runs' temporary directories among ``names`` (``alive(run_key)``: its egressd runs)."""
    return sorted(n for n in names if (m := _RUN_TMP.fullmatch(n)) and not alive(m["key"]))


def clean_tmp(tmp: Path | None = None) -> list[str]:
    """Remove /tmp/egressd-etc-KEY-* and /tmp/egressd-run-KEY-* of runs whose egressd is gone.

    Only a real directory (no symlink) owned by us: /tmp is everyone's, and a name
    is no proof of who made it.
    """
    from .network import owner_alive

    tmp = Path(tempfile.gettempdir()) if tmp is None else tmp
    removed = []
    for name in stale_tmp_names(os.listdir(tmp), owner_alive):
        path = tmp / name
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(str(path))
    return removed


async def check_rootless() -> list[Check]:
    """What an ordinary user's ``egressd run`` could build on here (``rootless``; the backend is not built yet)."""
    found = await rootless.probe()
    parts = [
        ("user namespaces", found.userns, "a user and network namespace of its own"),
        ("nftables in a user namespace", found.nftables, "connections and DNS queries can be captured"),
        ("cgroup delegation", found.cgroups, "memory and CPU limits in a delegated cgroup"),
    ]
    checks = [Check(f"rootless: {name}", why is None, works if why is None else why, required=False, info=True)
              for name, why, works in parts]  # fmt: skip
    checks.append(Check("rootless run", False, f"not built yet (issue 32; run needs root); an ordinary user would "
                                               f"get {found.backend}", required=False, info=True))  # fmt: skip
    return checks


async def run_checks() -> list[Check]:
    return [
        await check_bwrap(),
        await check_netns(),
        await check_nftables(),
        await check_seccomp(),
        await check_cgroups(),
        await check_docker(),
        *await check_rootless(),
    ]


def render(checks: list[Check]) -> list[str]:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = "info" if c.info else "ok  " if c.ok else ("FAIL" if c.required else "no  ")
        lines.append(f"{c.name:<{width}}  {mark}  {c.detail}")
        if not c.ok and c.fix and not c.info:
            lines.append(f"{'':<{width}}        fix: {c.fix}")
    return lines
