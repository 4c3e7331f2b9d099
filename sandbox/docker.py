"""The Docker backend: the launcher's sandbox as containers on a Docker Engine.

    async with DockerEngine.connect() as engine:
        await clean_leftovers(engine)                       # crashed runs, by label
        net = await DockerRunNetwork.create(engine)         # internal + outgoing networks
                                                            # (--connect: SharedEgressdNetwork, attach)
        ... start egressd on net.plan.egressd_ip (``start_egressd``), register a run
            for net.plan.sandbox_ip ...
        box = DockerSandbox(engine, network=net.internal_name, address=net.plan.sandbox_ip,
                            dns=net.plan.egressd_ip, image=..., workdir=..., proxy_url=...)
        obs = await box.run(["pip", "download", "requests"], limits=Limits(timeout_s=60))
        await box.copy_out(["dist/*.whl"], Path("out"))
        await box.destroy(); await net.destroy()

The network (DESIGN.md, "The two boundaries"): per run an ``internal``
bridge network whose only members are egressd and the sandbox. Internal means
Docker routes nothing off it, and ``inhibit_ipv4`` leaves the bridge without
an address on the host, so the host is not reachable from it either; the
sandbox's default route points at a gateway that does not exist. egressd is
also on an outgoing network (its way out, and where its control API is
published on the host's loopback). Subnets are /28s taken from a configured
range: link-local by default (169.254.64.0/18: never routed, never a LAN's;
169.254.169.0/24, cloud metadata, is skipped).

A run of an egressd that is already running (``--connect``) gets an internal
network of its own all the same (``SharedEgressdNetwork``): that egressd's
container is attached to it for the run's lifetime and detached before it is
removed, so sandboxes of different runs never share a network and cannot
reach each other.

The sandbox: each command is a fresh container (like each bwrap invocation:
/tmp is per command, the working directory persists), with a read-only root
filesystem, every capability dropped, no-new-privileges, egressd's own seccomp
profile instead of Docker's default (``sandbox.seccomp``: the bwrap filter's
policy, so AF_VSOCK and io_uring are refused here too), the working
directory's owner as its uid and gid (``identity``: never root; 1000 for a
fresh one), /work mounted nosuid and nodev (through a bind mount of ours
whose flags the container's inherits, ``stage``), a private IPC namespace,
its own PID namespace with an init, tmpfs /tmp, IPv6 off, the run's DNS set
to egressd's address (Docker's resolver at 127.0.0.11 relays to it from the
sandbox's own address), and the limits as cgroup settings: memory with no
swap (OOM kill: exit 137, ``memory_exceeded``), a pids limit, CPU time as
RLIMIT_CPU and a CPU share. Past the timeout the container is killed,
which takes its whole PID namespace down (exit 124). gVisor's ``runsc`` is
used when the engine has it.

Everything created carries the label ``egressd.run=<key>`` and the owner's
identity (``egressd.owner``: boot id, pid, process start time), so leftovers of
a run whose egressd died are found and removed (``clean_leftovers``).

The sandbox package never imports the proxy: egressd's addresses and the
proxy URL arrive as plain values.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import io
import ipaddress
import json
import os
import secrets
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Generic, Self, TypeVar

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError

from .bwrap import SANDBOX_GID, SANDBOX_HOSTNAME, SANDBOX_UID, SANDBOX_WORKDIR, base_environment
from .copyout import MAX_BYTES, MAX_FILES, CopyReport, Destination, check_pattern, unmatched_patterns
from .identity import refusal, run_as
from .launcher import (
    DEFAULT_MAX_OUTPUT,
    EXIT_MEMORY,
    EXIT_TIMEOUT,
    BoundedOutput,
    FdOutput,
    Observation,
    OutputSink,
    SandboxError,
)
from .limits import Limits
from .seccomp import SeccompUnsupported, docker_profile
from .stage import stage, unstage

DEFAULT_IMAGE = "egressd-sandbox:latest"  # docker/sandbox.Dockerfile, as docker/build.sh tags it
DEFAULT_EGRESSD_IMAGE = "egressd:latest"  # docker/Dockerfile
LABEL_RUN = "egressd.run"
LABEL_OWNER = "egressd.owner"
LABEL_ROLE = "egressd.role"
# /28s from the link-local range: 16 addresses are plenty for egressd and one
# sandbox, and 169.254.64.0/18 holds 1024 concurrent runs.
DEFAULT_DOCKER_RANGE = "169.254.64.0/18"
FALLBACK_DOCKER_RANGE = "100.64.64.0/18"  # carrier-grade NAT, for engines that refuse link-local
SUBNET_PREFIX = 28
METADATA_NET = ipaddress.ip_network("169.254.169.0/24")
CONTROL_PORT = 3129
PROXY_PORT = 3128
EGRESSD_STATE = "/var/lib/egressd"  # the egressd image's volume: audit log and token
# The sidecar's secrets: files in its state volume, put there before it starts
# (``secrets_archive``) and gone with the volume when the run ends. Not
# variables: the container's environment is in ``docker inspect``.
SECRETS_DIR = f"{EGRESSD_STATE}/secrets"
# Who egressd is in its image (docker/Dockerfile's USER): the secret files are theirs alone.
SIDECAR_UID = 10001
SIDECAR_GID = 10001
# Every API call but a command's own wait is bounded: an engine that hangs
# must not hang egressd run.
API_TIMEOUT_S = 60.0
# Bounds for the sidecar: enough for thousands of connections, no more.
SIDECAR_MEMORY_MB = 512
SIDECAR_PIDS = 256
# /tmp of a command: room for a build's scratch files, not for filling the host's memory.
TMPFS_OPTIONS = "rw,nosuid,nodev,size=256m,mode=1777"
DEFAULT_CPUS = 1.0  # a runaway command keeps at most one core busy
COPY_TIMEOUT_S = 300.0
# Another egressd may be removing the same leftovers (a container still going
# holds its network and volume): what failed is tried again, a few times.
CLEAN_PASSES = 3
CLEAN_RETRY_S = 0.5
NO_LIMITS = Limits()  # the launcher's defaults: no time or memory limit, 512 processes
WORKDIR_ROOT = SANDBOX_WORKDIR.strip("/")  # the archive of /work names its members work/...


class DockerUnavailable(SandboxError):
    """The Docker Engine cannot be reached or refused what the backend needs."""


@contextlib.contextmanager
def engine_errors(what: str) -> Any:
    """Turn aiodocker's and aiohttp's failures into ``SandboxError`` (the package's family), once."""
    try:
        yield
    except DockerError as exc:
        raise DockerUnavailable(f"{what}: {exc.message}") from exc
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise DockerUnavailable(f"{what}: {exc or type(exc).__name__}") from exc


# -- owners: which egressd created a resource, and is it still running --------


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()[19]


def owner_token(pid: int | None = None) -> str:
    """This process as ``BOOT_ID:PID:START``: unique across pid reuse and reboots."""
    pid = os.getpid() if pid is None else pid
    return f"{_boot_id()}:{pid}:{_start_time(pid)}"


def owner_alive(token: str, *, boot_id: str, start_time_of: Any = _start_time) -> bool:
    """True while the owner named by ``token`` still runs on this boot (pure given ``start_time_of``)."""
    boot, _, rest = token.partition(":")
    pid_text, _, start = rest.partition(":")
    if boot != boot_id or not pid_text.isdigit():
        return False
    return start_time_of(int(pid_text)) == start


# -- addresses -------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """The run's own internal subnet and its fixed addresses (pure data).

    Every run has one, with ``--connect`` too: its only members are the
    sandbox and egressd, so sandboxes of different runs never share a network.
    """

    run_key: str
    internal: ipaddress.IPv4Network

    @property
    def egressd_ip(self) -> ipaddress.IPv4Address:
        """egressd on the internal network: the sandbox's proxy, DNS and only neighbour."""
        return self.internal.network_address + 2  # .1 is the gateway Docker reserves

    @property
    def sandbox_ip(self) -> ipaddress.IPv4Address:
        return self.internal.network_address + 3

    @property
    def internal_name(self) -> str:
        return f"egressd-{self.run_key}-internal"


@dataclass(frozen=True)
class DockerPlan(RunPlan):
    """A run with egressd of its own: the internal subnet and egressd's outgoing one (pure data)."""

    outgoing: ipaddress.IPv4Network

    @property
    def egressd_outgoing_ip(self) -> ipaddress.IPv4Address:
        return self.outgoing.network_address + 2

    @property
    def outgoing_name(self) -> str:
        return f"egressd-{self.run_key}-outgoing"


PlanT = TypeVar("PlanT", bound=RunPlan)


def choose_subnets(
    pool: str,
    taken: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
    count: int = 2,
    prefix: int = SUBNET_PREFIX,
) -> list[ipaddress.IPv4Network]:
    """``count`` free /``prefix`` subnets of ``pool`` that overlap nothing taken (pure).

    Raises ValueError when the pool is not an IPv4 network, is in a range
    egressd never uses (private 10/8, 172.16/12, 192.168/16, or public
    space), or has no room left.
    """
    network = ipaddress.ip_network(pool, strict=True)
    if not isinstance(network, ipaddress.IPv4Network):
        raise ValueError(f"{pool} is not an IPv4 network")
    allowed = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("100.64.0.0/10"))
    if not any(network.subnet_of(a) for a in allowed):
        raise ValueError(f"{pool} is outside 169.254.0.0/16 (link-local) and 100.64.0.0/10 (carrier-grade NAT)")
    if network.prefixlen > prefix:
        raise ValueError(f"{pool} is smaller than one /{prefix}")
    taken = [t for t in taken if t.version == 4] + [METADATA_NET]
    found = []
    for candidate in network.subnets(new_prefix=prefix):
        if any(candidate.overlaps(t) for t in taken):
            continue
        found.append(candidate)
        if len(found) == count:
            return found
    raise ValueError(f"no free /{prefix} left in {pool}")


def _labels(run_key: str, role: str, owner: str, extra: Mapping[str, str]) -> dict[str, str]:
    return {**extra, LABEL_RUN: run_key, LABEL_ROLE: role, LABEL_OWNER: owner}


# -- container specifications (pure) -----------------------------------------------


def hardened_host_config(*, network: str) -> dict[str, Any]:
    """The HostConfig both containers share: what a careful operator expects.

    Read-only root filesystem, no capabilities, no-new-privileges (setuid
    binaries gain nothing), a private IPC namespace, an init as PID 1 (reaps
    orphans, forwards signals), IPv6 off (no link-local way around the IPv4
    fences), never restarted.
    """
    return {
        "NetworkMode": network,
        "ReadonlyRootfs": True,
        "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges:true"],
        "IpcMode": "private",
        "Init": True,
        "Privileged": False,
        "Sysctls": {
            "net.ipv6.conf.all.disable_ipv6": "1",
            "net.ipv6.conf.default.disable_ipv6": "1",
        },
        "RestartPolicy": {"Name": "no"},
    }


def sandbox_user(owner_uid: int, owner_gid: int, *, workdir: str) -> tuple[int, int]:
    """The uid:gid commands run as, given the working directory's owner (pure; ``identity.run_as``).

    Without user-namespace remapping a container's uid is the host's, so the
    command runs as the directory's owner (its files stay that user's), with
    no other group — never as root: a root-owned directory (uid 0 or gid 0,
    whatever its mode) is refused with ``identity.refusal``.
    """
    ids = run_as(owner_uid, owner_gid)
    if ids is None:
        raise SandboxError(refusal(workdir))
    return ids


@dataclass(frozen=True)
class CommandSpec:
    """One sandboxed command's container, as plain values."""

    image: str
    argv: Sequence[str]
    env: Mapping[str, str]
    workdir: str  # host path (on the engine's host) mounted read-write at /work: the nosuid,nodev stage
    network: str
    address: str
    dns: str
    labels: Mapping[str, str]
    limits: Limits = Limits()
    user: tuple[int, int] = (SANDBOX_UID, SANDBOX_GID)
    cpus: float | None = DEFAULT_CPUS
    runtime: str | None = None
    stdin: bool = False
    machine: str = "x86_64"  # the engine's architecture (its /version "Arch"): the seccomp profile's


@functools.lru_cache(maxsize=4)
def seccomp_option(machine: str) -> str:
    """The ``SecurityOpt`` entry that gives a sandbox container egressd's seccomp profile (pure).

    Raises ``SandboxError`` when the engine's architecture (``amd64``) has no
    profile: no container is started without it.
    """
    try:
        profile = docker_profile(machine)
    except SeccompUnsupported as exc:
        raise SandboxError(str(exc)) from None
    return "seccomp=" + json.dumps(profile, separators=(",", ":"))


def command_config(spec: CommandSpec) -> dict[str, Any]:
    """The Engine API body that creates the container for one command (pure)."""
    host = hardened_host_config(network=spec.network)
    host["SecurityOpt"] = [*host["SecurityOpt"], seccomp_option(spec.machine)]
    host.update(
        {
            # The source is the working directory's stage: /work inherits its nosuid,nodev (Docker's
            # binds take no such options themselves; see ``stage``).
            "Mounts": [{"Type": "bind", "Source": spec.workdir, "Target": SANDBOX_WORKDIR, "ReadOnly": False,
                        "BindOptions": {"Propagation": "rprivate"}}],
            "Tmpfs": {"/tmp": TMPFS_OPTIONS, "/var/tmp": TMPFS_OPTIONS},
            "Dns": [spec.dns],
            "DnsOptions": ["ndots:0"],
            "PidsLimit": spec.limits.max_pids,
            "Ulimits": [{"Name": "core", "Soft": 0, "Hard": 0}],
            "LogConfig": {"Type": "none", "Config": {}},  # the output is ours; the engine keeps none of it
            "OomScoreAdj": 500,  # when memory runs short on the host, the sandbox goes first
        }
    )
    if spec.limits.memory_mb:
        size = spec.limits.memory_mb * 1024 * 1024
        host["Memory"] = size
        host["MemorySwap"] = size  # memory + swap = memory: no swap at all
    if spec.limits.cpu_s:
        host["Ulimits"].append({"Name": "cpu", "Soft": spec.limits.cpu_s, "Hard": spec.limits.cpu_s + 1})
    if spec.cpus:
        host["NanoCpus"] = int(spec.cpus * 1e9)
    if spec.runtime:
        host["Runtime"] = spec.runtime
    return {
        "Image": spec.image,
        "Entrypoint": [""],  # exactly the command asked for, whatever the image's entrypoint
        "Cmd": list(spec.argv),
        "Env": [f"{k}={v}" for k, v in spec.env.items()],
        "User": f"{spec.user[0]}:{spec.user[1]}",
        "WorkingDir": SANDBOX_WORKDIR,
        "Hostname": SANDBOX_HOSTNAME,
        "Labels": dict(spec.labels),
        "AttachStdin": spec.stdin,
        "OpenStdin": spec.stdin,
        "StdinOnce": spec.stdin,
        "AttachStdout": True,
        "AttachStderr": True,
        "Tty": False,
        "HostConfig": host,
        "NetworkingConfig": {"EndpointsConfig": {spec.network: {"IPAMConfig": {"IPv4Address": spec.address}}}},
    }


@dataclass(frozen=True)
class EgressdSpec:
    """egressd's own container: on the outgoing network, with a leg on the internal one."""

    image: str
    env: Mapping[str, str]
    outgoing_network: str
    outgoing_address: str
    volume: str
    labels: Mapping[str, str]


def secrets_archive(secrets: Mapping[str, str], *, uid: int = SIDECAR_UID, gid: int = SIDECAR_GID) -> bytes:
    """A tar of ``secrets/NAME`` files (mode 0400 in a 0700 directory, ``uid``:``gid``'s) for ``EGRESSD_STATE`` (pure).

    egressd reads them as NAME_file settings, which refuse a file that
    anyone but its owner may read. A name is a setting's: lower case and
    underscores, nothing that could climb out of the directory.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        directory = tarfile.TarInfo("secrets")
        directory.type, directory.mode, directory.uid, directory.gid = tarfile.DIRTYPE, 0o700, uid, gid
        tar.addfile(directory)
        for name, value in sorted(secrets.items()):
            if not name or not name.replace("_", "a").isalpha() or not name.islower():
                raise ValueError(f"{name!r} is not a setting's name")
            data = value.encode()
            member = tarfile.TarInfo(f"secrets/{name}")
            member.size, member.mode, member.uid, member.gid = len(data), 0o400, uid, gid
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def egressd_config(spec: EgressdSpec) -> dict[str, Any]:
    """The Engine API body for egressd's container (pure).

    Unprivileged ports start at 53 inside it, so the non-root egressd can
    serve DNS (53), HTTP (80) and TLS (443) without any capability. The
    control API is published on the host's loopback only, on a port the
    engine picks.
    """
    host = hardened_host_config(network=spec.outgoing_network)
    host["Sysctls"]["net.ipv4.ip_unprivileged_port_start"] = "53"
    # egressd is on several networks (a shared one on every --connect run's):
    # it relays connections and never routes a packet from one network to another.
    host["Sysctls"]["net.ipv4.ip_forward"] = "0"
    host.update(
        {
            "Mounts": [{"Type": "volume", "Source": spec.volume, "Target": EGRESSD_STATE, "ReadOnly": False}],
            "Tmpfs": {"/tmp": "rw,nosuid,nodev,noexec,size=16m"},
            "PortBindings": {f"{CONTROL_PORT}/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]},
            "Memory": SIDECAR_MEMORY_MB * 1024 * 1024,
            "MemorySwap": SIDECAR_MEMORY_MB * 1024 * 1024,
            "PidsLimit": SIDECAR_PIDS,
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}},
        }
    )
    return {
        "Image": spec.image,
        "Cmd": ["serve"],
        "Env": [f"{k}={v}" for k, v in spec.env.items()],
        "Labels": dict(spec.labels),
        "ExposedPorts": {f"{CONTROL_PORT}/tcp": {}},
        "HostConfig": host,
        "NetworkingConfig": {
            "EndpointsConfig": {spec.outgoing_network: {"IPAMConfig": {"IPv4Address": spec.outgoing_address}}}
        },
    }


def network_config(
    name: str, subnet: ipaddress.IPv4Network, *, internal: bool, labels: Mapping[str, str]
) -> dict[str, Any]:
    """A bridge network with an explicit subnet (pure); an internal one gets no host address."""
    options = {"com.docker.network.bridge.inhibit_ipv4": "true"} if internal else {}
    return {
        "Name": name,
        "Driver": "bridge",
        "CheckDuplicate": True,
        "Internal": internal,
        "EnableIPv6": False,
        "IPAM": {"Driver": "default", "Config": [{"Subnet": str(subnet), "Gateway": str(subnet.network_address + 1)}]},
        "Options": options,
        "Labels": dict(labels),
    }


# -- copy-out through the archive API (the member checks are pure) -----------------


@dataclass
class MemberCheck:
    """What to do with one tar member of the working directory's archive."""

    name: str | None  # its name relative to the working directory; None: not a file of ours
    skip: str | None = None  # why it is not copied (None: copy it)


def check_member(
    raw_name: str,
    kind: str,
    size: int,
    *,
    root: str,
    patterns: Sequence[str],
    links: set[str],
    report: CopyReport,
    max_files: int = MAX_FILES,
    max_bytes: int = MAX_BYTES,
) -> MemberCheck:
    """Decide one member of the archive of ``/work`` (pure; ``links`` is updated).

    ``kind`` is ``file``, ``dir``, ``symlink``, ``hardlink`` or ``other``.
    The same rules as ``copyout``, in order:

    1. the name must lie under ``root`` (the archive's top directory), be
       relative, free of ``..``, empty parts and NUL — else it is ignored as
       not ours (the engine never makes such a name; a hostile one gets nothing);
    2. directories are walked, never copied; a link is remembered, so nothing
       "inside" a linked directory is taken;
    3. a name no pattern matches is not mentioned;
    4. a link, or a path through one, is skipped: it could point anywhere;
    5. anything but a regular file is skipped;
    6. past ``max_files`` files or ``max_bytes`` bytes, skipped, saying which limit.
    """
    if "\0" in raw_name or "\\" in raw_name:
        return MemberCheck(None)
    path = PurePosixPath(raw_name)
    if path.is_absolute() or not path.parts or path.parts[0] != root:
        return MemberCheck(None)
    parts = path.parts[1:]
    if not parts or any(p in ("", ".", "..") for p in parts) or raw_name.rstrip("/") != "/".join(path.parts):
        return MemberCheck(None)
    name = "/".join(parts)
    through_link = any("/".join(parts[:i]) in links for i in range(1, len(parts)))
    if kind in ("symlink", "hardlink"):
        links.add(name)
    if kind == "dir":
        return MemberCheck(None)
    if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
        return MemberCheck(None)
    if through_link or kind in ("symlink", "hardlink"):
        return MemberCheck(name, "a link (not followed)")
    if kind != "file":
        return MemberCheck(name, "not a regular file")
    if len(report.copied) >= max_files:
        return MemberCheck(name, f"more than {max_files} files")
    if report.bytes + size > max_bytes:
        return MemberCheck(name, f"over the {max_bytes // (1024 * 1024)} MiB copy-out limit")
    return MemberCheck(name)


def member_kind(member: tarfile.TarInfo) -> str:
    if member.isreg():
        return "file"
    if member.isdir():
        return "dir"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    return "other"


# -- the engine ----------------------------------------------------------------------


def already_gone(status: int, message: str) -> bool:
    """Whether a failed DELETE means the resource is gone or going (pure).

    404: gone. 409 "removal ... already in progress": another egressd (say, a
    second run cleaning the same leftovers) is removing it right now. Any other
    conflict, such as a network with endpoints still attached, is a failure.
    """
    return status == 404 or (status == 409 and "already in progress" in message)


class DockerEngine:
    """An aiodocker client whose failures are ``SandboxError``s; use ``async with``."""

    def __init__(self, client: aiodocker.Docker) -> None:
        self.client = client

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str | None = None) -> AsyncIterator[DockerEngine]:
        try:
            client = aiodocker.Docker(url=url)
        except (ValueError, AssertionError) as exc:  # aiodocker's ways of saying it found no socket
            raise DockerUnavailable(f"no Docker Engine to talk to (DOCKER_HOST, /var/run/docker.sock): {exc}") from None
        try:
            engine = cls(client)
            yield engine
        finally:
            await client.close()

    async def version(self) -> dict[str, Any]:
        with engine_errors("cannot talk to the Docker Engine"):
            async with asyncio.timeout(API_TIMEOUT_S):
                return await self.client.version()

    async def runtimes(self) -> set[str]:
        with engine_errors("cannot read the engine's runtimes"):
            async with asyncio.timeout(API_TIMEOUT_S):
                info = await self.client.system.info()
        return set((info.get("Runtimes") or {}).keys())

    async def image_exists(self, image: str) -> bool:
        try:
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.client.images.inspect(image)
        except DockerError as exc:
            if exc.status == 404:
                return False
            raise DockerUnavailable(f"cannot inspect image {image}: {exc.message}") from exc
        return True

    async def taken_subnets(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """Every subnet of every engine network, and the host's own routes' networks."""
        with engine_errors("cannot list networks"):
            async with asyncio.timeout(API_TIMEOUT_S):
                networks = await self.client.networks.list()
        taken: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for net in networks:
            for config in (net.get("IPAM") or {}).get("Config") or []:
                with contextlib.suppress(ValueError, KeyError):
                    taken.append(ipaddress.ip_network(config["Subnet"], strict=False))
        taken += _host_routes()
        return taken

    async def _delete(self, what: str, path: str, params: Mapping[str, str]) -> None:
        """DELETE one resource; one already gone is fine."""
        try:
            with engine_errors(f"cannot remove {what}"):
                async with asyncio.timeout(API_TIMEOUT_S):
                    async with self.client._query(path, method="DELETE", params=dict(params)):
                        pass
        except DockerUnavailable as exc:
            cause = exc.__cause__
            if not (isinstance(cause, DockerError) and already_gone(cause.status, str(cause.message))):
                raise

    async def remove_container(self, container_id: str) -> None:
        """Kill and remove a container with its anonymous volumes."""
        params = {"force": "true", "v": "true"}
        await self._delete(f"container {container_id[:12]}", f"containers/{container_id}", params)

    async def remove_network(self, name: str) -> None:
        """Disconnect every container still attached (a running egressd of ``--connect``), then remove it."""
        for container_id in await self._attached_to(name):
            await self.disconnect(name, container_id)
        await self._delete(f"network {name}", f"networks/{name}", {})

    async def _attached_to(self, network: str) -> list[str]:
        # Stopped containers too: a network removed under one would keep it from starting again.
        filters = json.dumps({"network": [network]})
        with engine_errors(f"cannot list the containers on network {network}"):
            async with asyncio.timeout(API_TIMEOUT_S):
                containers = await self.client.containers.list(all=True, filters=filters)
        return [c.id for c in containers]

    async def attach(self, network: str, container_id: str, address: str) -> None:
        """Connect a container to a network at ``address``."""
        endpoint = {"IPAMConfig": {"IPv4Address": address}}
        with engine_errors(f"cannot attach container {container_id[:12]} to network {network}"):
            async with asyncio.timeout(API_TIMEOUT_S):
                net = await self.client.networks.get(network)
                await net.connect({"Container": container_id, "EndpointConfig": endpoint})

    async def disconnect(self, network: str, container_id: str) -> None:
        """Detach a container from a network (running or not); one already gone is fine."""
        try:
            with engine_errors(f"cannot detach container {container_id[:12]} from network {network}"):
                async with asyncio.timeout(API_TIMEOUT_S):
                    async with self.client._query(f"networks/{network}/disconnect", method="POST",
                                                  data=json.dumps({"Container": container_id, "Force": True}),
                                                  headers={"Content-Type": "application/json"}):
                        pass
        except DockerUnavailable as exc:
            cause = exc.__cause__
            if not (isinstance(cause, DockerError) and cause.status == 404):
                raise

    async def containers_serving(self, host: str, port: int) -> list[str]:
        """The running containers that serve ``host:port`` (see ``containers_serving``)."""
        with engine_errors("cannot list containers"):
            async with asyncio.timeout(API_TIMEOUT_S):
                containers = await self.client.containers.list()
        return containers_serving([c._container for c in containers], host, port)

    async def remove_volume(self, name: str) -> None:
        await self._delete(f"volume {name}", f"volumes/{name}", {"force": "true"})

    async def labelled(self, label: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        """Containers (running or not), networks and volumes carrying ``label`` (``key`` or ``key=value``)."""
        filters = {"label": [label]}
        with engine_errors("cannot list what egressd created"):
            async with asyncio.timeout(API_TIMEOUT_S):
                containers = await self.client.containers.list(all=True, filters=json.dumps(filters))
                networks = await self.client.networks.list(filters=filters)
                volumes = (await self.client.volumes.list(filters=filters)).get("Volumes") or []
        return [c._container for c in containers], networks, volumes


def containers_serving(summaries: Iterable[Mapping[str, Any]], host: str, port: int) -> list[str]:
    """Ids of the containers (the engine's list summaries) that serve ``host:port`` (pure).

    ``host:port`` is where we reach it: a port the container publishes on the
    engine's host (``host`` loopback, ``localhost``, or the published address
    itself), or the container's own address on one of its networks.
    """
    loopback = host == "localhost" or _is_loopback(host)
    found = []
    for summary in summaries:
        published = any(
            p.get("Type") == "tcp" and p.get("PublicPort") == port
            and (p.get("IP") in (host, "0.0.0.0", "::") or (loopback and p.get("IP") in ("127.0.0.1", "::1")))
            for p in summary.get("Ports") or ()
        )
        networks = ((summary.get("NetworkSettings") or {}).get("Networks") or {}).values()
        own = any(n.get("IPAddress") == host for n in networks)
        if published or own:
            found.append(str(summary["Id"]))
    return found


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_routes() -> list[ipaddress.IPv4Network]:
    """Networks the host routes already (/proc/net/route), so a run never shadows one."""
    routes = []
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or fields[1] == "00000000":
            continue
        with contextlib.suppress(ValueError):
            dest = ipaddress.IPv4Address(int(fields[1], 16).to_bytes(4, "little"))
            mask = bin(int(fields[7], 16)).count("1")
            routes.append(ipaddress.IPv4Network(f"{dest}/{mask}", strict=False))
    return routes


# -- leftovers -----------------------------------------------------------------------


async def clean_leftovers(engine: DockerEngine, *, everything_of: str | None = None) -> list[str]:
    """Remove containers, networks and volumes of runs whose egressd is gone.

    A resource is a leftover when its ``egressd.owner`` is not a live process
    on this boot (or it has no owner label). ``everything_of`` names one run
    key whose resources go regardless (a run removing its own). Returns what
    was removed, as ``kind name`` strings.
    """
    boot = _boot_id()
    label = f"{LABEL_RUN}={everything_of}" if everything_of else LABEL_RUN

    def dead(labels: Mapping[str, str] | None) -> bool:
        if everything_of:
            return True
        owner = (labels or {}).get(LABEL_OWNER, "")
        return not owner_alive(owner, boot_id=boot)

    removed: list[str] = []
    for _ in range(CLEAN_PASSES):
        failed: DockerUnavailable | None = None
        containers, networks, volumes = await engine.labelled(label)
        steps = (
            [(c, engine.remove_container, c["Id"], f"container {(c.get('Names') or [c['Id'][:12]])[0].lstrip('/')}")
             for c in containers]
            + [(n, engine.remove_network, n["Name"], f"network {n['Name']}") for n in networks]
            + [(v, engine.remove_volume, v["Name"], f"volume {v['Name']}") for v in volumes]
        )
        for resource, remove, key, shown in steps:
            if not dead(resource.get("Labels")):
                continue
            try:
                await remove(key)
            except DockerUnavailable as exc:
                failed = exc  # the rest still goes; this one is tried again in the next pass
                continue
            removed.append(shown)
        if failed is None:
            return removed
        await asyncio.sleep(CLEAN_RETRY_S)
    assert failed is not None
    raise failed


# -- a run's networks --------------------------------------------------------------


class DockerRun:
    """Everything one run creates on the engine, found by its label; ``destroy`` removes it all."""

    def __init__(self, engine: DockerEngine, run_key: str, labels: Mapping[str, str] = {}) -> None:
        self.engine = engine
        self.run_key = run_key
        self.labels = dict(labels)  # extra labels (tests mark theirs); the run's own are added
        self.owner = owner_token()
        self._destroyed = False

    def labels_for(self, role: str) -> dict[str, str]:
        return _labels(self.run_key, role, self.owner, self.labels)

    async def destroy(self) -> None:
        """Remove every container, network and volume labelled with this run (idempotent)."""
        if self._destroyed:
            return
        self._destroyed = True
        with contextlib.suppress(DockerUnavailable):
            await clean_leftovers(self.engine, everything_of=self.run_key)
            return
        # One more try, each resource on its own: a failure must not keep the rest.
        containers, networks, volumes = await self.engine.labelled(f"{LABEL_RUN}={self.run_key}")
        for c in containers:
            with contextlib.suppress(DockerUnavailable):
                await self.engine.remove_container(c["Id"])
        for n in networks:
            with contextlib.suppress(DockerUnavailable):
                await self.engine.remove_network(n["Name"])
        for v in volumes:
            with contextlib.suppress(DockerUnavailable):
                await self.engine.remove_volume(v["Name"])


class _RunNetworks(DockerRun, Generic[PlanT]):
    """A run with networks of its own (``plan``): ``create`` picks free subnets and makes them."""

    SUBNETS: ClassVar[int]

    def __init__(self, engine: DockerEngine, plan: PlanT, labels: Mapping[str, str] = {}) -> None:
        super().__init__(engine, plan.run_key, labels)
        self.plan = plan
        self.note = ""  # set when the networks are not where they were asked for

    @classmethod
    def _plan(cls, run_key: str, subnets: list[ipaddress.IPv4Network]) -> PlanT:
        raise NotImplementedError

    async def _build(self) -> None:
        raise NotImplementedError

    @classmethod
    async def create(
        cls,
        engine: DockerEngine,
        *,
        pool: str = DEFAULT_DOCKER_RANGE,
        labels: Mapping[str, str] = {},
        avoid: Iterable[ipaddress.IPv4Network] = (),
        attempts: int = 5,
    ) -> Self:
        """Pick free /28s and create the networks (retrying a subnet another run just took).

        ``avoid``: ranges to keep clear of besides the engine's networks and
        the host's routes (e.g. addresses a running egressd still binds to a
        run). An engine that refuses link-local subnets gets carrier-grade NAT
        ones (``FALLBACK_DOCKER_RANGE``) instead, when the pool is the
        default; ``note`` then says so.
        """
        last = ""
        note = ""
        avoid = list(avoid)
        for _ in range(attempts):
            try:
                subnets = choose_subnets(pool, [*await engine.taken_subnets(), *avoid], count=cls.SUBNETS)
            except ValueError as exc:
                raise SandboxError(f"cannot plan the run's networks: {exc}") from None
            net = cls(engine, cls._plan(secrets.token_hex(4), subnets), labels)
            try:
                await net._build()
                net.note = note
                return net
            except DockerUnavailable as exc:
                await net.destroy()
                last = str(exc)
                if "overlap" in last or "Pool" in last:
                    continue
                if pool != DEFAULT_DOCKER_RANGE:
                    raise
                note = (f"the Docker Engine refused the link-local subnets of {pool} ({last}); "
                        f"using carrier-grade NAT subnets of {FALLBACK_DOCKER_RANGE} instead")
                pool = FALLBACK_DOCKER_RANGE
        raise SandboxError(f"cannot create the run's networks: {last}")

    async def _create_network(self, name: str, subnet: ipaddress.IPv4Network, *, internal: bool) -> None:
        with engine_errors("cannot create the run's networks"):
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.engine.client.networks.create(
                    network_config(name, subnet, internal=internal, labels=self.labels_for("network")))


class DockerRunNetwork(_RunNetworks[DockerPlan]):
    """A run with egressd of its own: its internal and outgoing networks."""

    SUBNETS = 2

    @classmethod
    def _plan(cls, run_key: str, subnets: list[ipaddress.IPv4Network]) -> DockerPlan:
        internal, outgoing = subnets
        return DockerPlan(run_key, internal, outgoing)

    async def _build(self) -> None:
        p = self.plan
        await self._create_network(p.internal_name, p.internal, internal=True)
        await self._create_network(p.outgoing_name, p.outgoing, internal=False)


class SharedEgressdNetwork(_RunNetworks[RunPlan]):
    """A run of a running egressd (``--connect``): an internal network of its own.

    ``attach`` connects egressd's container to it at ``plan.egressd_ip`` for
    the run's lifetime; ``destroy`` disconnects it and removes the network
    (so does ``clean_leftovers`` after a crash: the network carries the run's
    labels, egressd's container does not and stays).
    """

    SUBNETS = 1

    @classmethod
    def _plan(cls, run_key: str, subnets: list[ipaddress.IPv4Network]) -> RunPlan:
        return RunPlan(run_key, subnets[0])

    async def _build(self) -> None:
        await self._create_network(self.plan.internal_name, self.plan.internal, internal=True)

    async def attach(self, container_id: str) -> None:
        await self.engine.attach(self.plan.internal_name, container_id, str(self.plan.egressd_ip))


# -- egressd's container -----------------------------------------------------------------


@dataclass
class EgressdContainer:
    id: str
    control_url: str  # on the host's loopback


async def start_egressd(
    net: DockerRunNetwork,
    *,
    image: str,
    env: Mapping[str, str],
    secrets: Mapping[str, str] = {},
    ready_timeout_s: float = 30.0,
) -> EgressdContainer:
    """Create egressd's container on both networks, start it and wait for ``/health``.

    ``env`` is its configuration (EGRESSD_* variables), ``secrets`` the
    files it reads its secrets from (name -> value: ``SECRETS_DIR/name``,
    see ``secrets_archive``; ``env`` names them as EGRESSD_<NAME>_FILE). If
    it exits or stays unhealthy, the error carries the last lines it printed.
    """
    engine, p = net.engine, net.plan
    volume = f"egressd-{p.run_key}-state"
    with engine_errors(f"cannot start egressd from image {image}"):
        async with asyncio.timeout(API_TIMEOUT_S):
            await engine.client.volumes.create({"Name": volume, "Labels": net.labels_for("volume")})
            spec = EgressdSpec(image=image, env=env, outgoing_network=p.outgoing_name,
                               outgoing_address=str(p.egressd_outgoing_ip), volume=volume,
                               labels=net.labels_for("egressd"))
            container = await engine.client.containers.create(egressd_config(spec), name=f"egressd-{p.run_key}")
            if secrets:  # into the volume (the root file system is read-only), before egressd reads them
                await container.put_archive(EGRESSD_STATE, secrets_archive(secrets))
            internal = await engine.client.networks.get(p.internal_name)
            await internal.connect({"Container": container.id,
                                    "EndpointConfig": {"IPAMConfig": {"IPv4Address": str(p.egressd_ip)}}})
            await container.start()
            info = await container.show()
    bindings = ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(f"{CONTROL_PORT}/tcp") or []
    if not bindings:
        raise SandboxError("egressd's control port was not published")
    url = f"http://127.0.0.1:{bindings[0]['HostPort']}"
    await _wait_healthy(engine, container.id, url, ready_timeout_s)
    return EgressdContainer(container.id, url)


async def _wait_healthy(engine: DockerEngine, container_id: str, url: str, timeout_s: float) -> None:
    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with asyncio.timeout(2):
                    async with http.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            return
            state = await _state(engine, container_id)
            if not state.get("Running", False) or loop.time() > deadline:
                tail = await container_log_tail(engine, container_id)
                why = "exited" if not state.get("Running", False) else f"did not answer /health within {timeout_s:g}s"
                raise SandboxError(f"egressd's container {why}" + (f": {tail}" if tail else ""))
            await asyncio.sleep(0.1)


async def _state(engine: DockerEngine, container_id: str) -> dict[str, Any]:
    with engine_errors("cannot inspect a container"):
        async with asyncio.timeout(API_TIMEOUT_S):
            info = await engine.client.containers.container(container_id).show()
    return dict(info.get("State") or {})


async def container_log_tail(engine: DockerEngine, container_id: str, lines: int = 5) -> str:
    """The last lines a container printed (for error messages), or ""."""
    try:
        async with asyncio.timeout(10):
            out = await engine.client.containers.container(container_id).log(stdout=True, stderr=True, tail=lines)
    except (DockerError, TimeoutError, OSError):
        return ""
    return " | ".join(line.strip() for line in "".join(out).splitlines() if line.strip())


async def read_file(engine: DockerEngine, container_id: str, path: str, max_bytes: int) -> bytes | None:
    """One regular file of a container through the archive API (None when absent), at most ``max_bytes``."""
    data = bytearray()
    try:
        async with asyncio.timeout(API_TIMEOUT_S):
            async with engine.client._query(f"containers/{container_id}/archive", params={"path": path}) as resp:
                async for chunk in resp.content.iter_chunked(65536):
                    data += chunk
                    if len(data) > max_bytes + 1024 * 1024:  # the tar framing is small
                        break
    except DockerError as exc:
        if exc.status == 404:
            return None
        raise DockerUnavailable(f"cannot read {path}: {exc.message}") from exc
    with contextlib.suppress(tarfile.TarError), tarfile.open(fileobj=io.BytesIO(bytes(data)), mode="r|") as tar:
        for member in tar:
            if member.isreg():
                fh = tar.extractfile(member)
                return fh.read(max_bytes) if fh is not None else None
    return None


# -- the sandbox -------------------------------------------------------------------------


@dataclass
class _Outcome:
    exit_code: int = -1
    oom: bool = False


@dataclass
class DockerSandbox:
    """Run commands as containers on the run's internal network; the launcher's ``Sandbox`` API.

    ``run`` returns the same ``Observation``; ``copy_out`` and ``destroy``
    are coroutines here (the engine is across a socket).
    """

    engine: DockerEngine
    network: str
    address: str
    dns: str
    image: str
    workdir: Path
    proxy_url: str
    labels: Mapping[str, str]
    extra_env: Mapping[str, str] = field(default_factory=dict)
    term: str | None = None
    runtime: str | None = None
    cpus: float | None = DEFAULT_CPUS
    machine: str = "x86_64"  # the engine's architecture, for the seccomp profile
    env: dict[str, str] = field(init=False)
    user: tuple[int, int] = field(init=False)
    _stage: Path = field(init=False)  # what the engine mounts at /work: the working directory, nosuid,nodev
    _current: str | None = field(default=None, init=False)
    _destroyed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.workdir = self.workdir.resolve()
        if not self.workdir.is_dir():
            raise SandboxError(f"working directory {self.workdir} does not exist")
        seccomp_option(self.machine)  # an engine the profile is not written for: refused here, not per command
        boot = _boot_id()
        try:
            self._stage, self.user = stage(
                self.workdir, owner=owner_token(), alive=lambda token: owner_alive(token, boot_id=boot),
                identity=lambda uid, gid: sandbox_user(uid, gid, workdir=str(self.workdir)),
            )
        except OSError as exc:
            raise SandboxError(f"cannot mount the working directory nosuid,nodev for the sandbox (egressd needs "
                               f"root for that): {exc}") from None
        self.env = base_environment(term=self.term, proxy_url=self.proxy_url, extra=self.extra_env)

    async def run(
        self,
        command: Sequence[str],
        *,
        limits: Limits = NO_LIMITS,
        capture: bool = True,
        max_output: int = DEFAULT_MAX_OUTPUT,
        stdin: int | None = None,
        relay: tuple[OutputSink, OutputSink] | None = None,
    ) -> Observation:
        """Run one command in a fresh container to completion (or its limits).

        ``capture=False`` passes stdout/stderr on as they come, to
        ``relay=(out_sink, err_sink)`` or else to ours as they are (the
        command never holds a descriptor of ours: its output crosses the
        engine's socket).
        ``stdin`` is a file descriptor whose contents the command reads
        (default: nothing, an empty stdin).
        """
        if self._destroyed:
            raise SandboxError("the sandbox was destroyed")
        spec = CommandSpec(image=self.image, argv=command, env=self.env, workdir=str(self._stage),
                           network=self.network, address=self.address, dns=self.dns, labels=self.labels,
                           limits=limits, user=self.user, cpus=self.cpus, runtime=self.runtime,
                           stdin=stdin is not None, machine=self.machine)
        started = time.monotonic()
        out, err = BoundedOutput(max_output), BoundedOutput(max_output)
        sinks = None if capture else (relay or (FdOutput(sys.stdout.fileno()), FdOutput(sys.stderr.fileno())))
        with engine_errors("cannot start the command's container"):
            async with asyncio.timeout(API_TIMEOUT_S):
                container = await self.engine.client.containers.create(command_config(spec))
        self._current = container.id
        timed_out = False
        outcome = _Outcome()
        try:
            with engine_errors("cannot attach to the command's container"):
                stream = container.attach(stdout=True, stderr=True, stdin=stdin is not None)
                async with asyncio.timeout(API_TIMEOUT_S):
                    await stream.__aenter__()  # attached before it starts: no output is missed
            try:
                with engine_errors("cannot start the command's container"):
                    async with asyncio.timeout(API_TIMEOUT_S):
                        await container.start()
                async with asyncio.TaskGroup() as tasks:
                    work = tasks.create_task(self._follow(container, stream, out, err, sinks, stdin, outcome))
                    try:
                        async with asyncio.timeout(limits.timeout_s):
                            await asyncio.shield(work)
                    except TimeoutError:
                        timed_out = True
                        await self._kill(container.id)
                        try:
                            async with asyncio.timeout(10):
                                await asyncio.shield(work)
                        except TimeoutError:
                            work.cancel()
            finally:
                await stream.close()
        finally:
            self._current = None
            # Removal must happen even when we are being cancelled (Ctrl-C).
            await asyncio.shield(self._remove(container.id))
        code = outcome.exit_code
        if timed_out:
            code = EXIT_TIMEOUT
        elif outcome.oom:
            code = EXIT_MEMORY
        return Observation(
            exit_code=code,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=timed_out,
            memory_exceeded=outcome.oom and not timed_out,
            duration_s=time.monotonic() - started,
            stdout_truncated=out.dropped,
            stderr_truncated=err.dropped,
        )

    async def _follow(
        self,
        container: Any,
        stream: Any,
        out: BoundedOutput,
        err: BoundedOutput,
        sinks: tuple[OutputSink, OutputSink] | None,
        stdin: int | None,
        outcome: _Outcome,
    ) -> None:
        """Pump output (and stdin) until the container ends, then read its exit status."""
        async with asyncio.TaskGroup() as tasks:
            feeder = tasks.create_task(_feed_stdin(stream, stdin)) if stdin is not None else None
            while (message := await stream.read_out()) is not None:
                if sinks is None:
                    (out if message.stream == 1 else err).add(message.data)
                else:
                    (sinks[0] if message.stream == 1 else sinks[1]).add(message.data)
            for sink in sinks or ():
                sink.end()
            with engine_errors("cannot wait for the command's container"):
                await container.wait()
            state = await _state(self.engine, container.id)
            outcome.exit_code = int(state.get("ExitCode", -1))
            outcome.oom = bool(state.get("OOMKilled", False))
            if feeder is not None:  # stdin may still be open: the command is done with it
                feeder.cancel()

    async def _kill(self, container_id: str) -> None:
        # SIGKILL to the container's init takes its PID namespace, every process in it, down.
        with contextlib.suppress(DockerError, TimeoutError, OSError):
            async with asyncio.timeout(API_TIMEOUT_S):
                await self.engine.client.containers.container(container_id).kill(signal="SIGKILL")

    async def _remove(self, container_id: str) -> None:
        with contextlib.suppress(DockerUnavailable, TimeoutError):
            await self.engine.remove_container(container_id)

    async def copy_out(
        self,
        patterns: list[str],
        dest: Path,
        *,
        max_files: int = MAX_FILES,
        max_bytes: int = MAX_BYTES,
    ) -> CopyReport:
        """Copy matching regular files of the working directory to ``dest`` via the archive API.

        The same rules as ``copyout.copy_out``: on the source side
        ``check_member`` (safe relative names, no links, no devices, bounded
        count and bytes, every skipped match and every pattern that matched
        nothing reported); on the destination side the same ``Destination``
        writer, opened before anything is fetched (CopyOutError: a link, or
        inside the working directory).
        """
        for pattern in patterns:
            check_pattern(pattern)
        report = CopyReport()
        out = await asyncio.to_thread(Destination.open, dest, workdir=self.workdir)
        try:
            # A created, never started container with the same mount: the archive
            # API reads /work from it, whatever the engine's host looks like.
            spec = CommandSpec(image=self.image, argv=["true"], env={}, workdir=str(self._stage), network="none",
                               address="", dns=self.dns, labels=self.labels)
            config = command_config(spec)
            config["HostConfig"]["NetworkMode"] = "none"
            for key in ("Dns", "DnsOptions"):
                config["HostConfig"].pop(key)
            config.pop("NetworkingConfig")
            with engine_errors("cannot read the working directory"):
                async with asyncio.timeout(API_TIMEOUT_S):
                    container = await self.engine.client.containers.create(config)
            try:
                async with asyncio.timeout(COPY_TIMEOUT_S):
                    with tempfile.TemporaryFile() as spool:
                        await self._fetch_archive(container.id, spool, max_bytes)
                        spool.seek(0)
                        await asyncio.to_thread(_extract, spool, patterns, out, report, max_files, max_bytes)
            except TimeoutError:
                raise SandboxError(f"copy-out took longer than {COPY_TIMEOUT_S:g}s") from None
            finally:
                await asyncio.shield(self._remove(container.id))
        finally:
            out.close()
        return report

    async def _fetch_archive(self, container_id: str, spool: Any, max_bytes: int) -> None:
        # The whole working directory is read (only the engine can walk it), but
        # at most a bounded amount beyond the copy-out limit is kept.
        limit = max_bytes * 4 + 64 * 1024 * 1024
        total = 0
        with engine_errors("cannot read the working directory"):
            async with self.engine.client._query(
                f"containers/{container_id}/archive", params={"path": SANDBOX_WORKDIR}
            ) as resp:
                async for chunk in resp.content.iter_chunked(1024 * 1024):
                    total += len(chunk)
                    if total > limit:
                        mib = limit // (1024 * 1024)
                        raise SandboxError(f"the working directory is over {mib} MiB; copy-out refused")
                    await asyncio.to_thread(spool.write, chunk)

    async def destroy(self) -> None:
        """Kill and remove a command's container still running (the network's owner removes the rest)."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._current is not None:
            await self._remove(self._current)
        unstage(self._stage)


def _extract(
    spool: Any, patterns: list[str], out: Destination, report: CopyReport, max_files: int, max_bytes: int
) -> None:
    """Write the files ``check_member`` lets through with ``out`` (runs in a thread: plain file I/O)."""
    links: set[str] = set()
    matched: list[str] = []
    with tarfile.open(fileobj=spool, mode="r|") as tar:
        for member in tar:
            check = check_member(member.name, member_kind(member), member.size, root=WORKDIR_ROOT, patterns=patterns,
                                 links=links, report=report, max_files=max_files, max_bytes=max_bytes)
            if check.name is None:
                continue
            matched.append(check.name)
            if check.skip is not None:
                report.skipped.append((check.name, check.skip))
                continue
            source = tar.extractfile(member)
            if source is None:
                report.skipped.append((check.name, "not a regular file"))
                continue
            why = out.write(check.name, source, report=report, max_bytes=max_bytes)
            if why is not None:
                report.skipped.append((check.name, why))
    report.unmatched = unmatched_patterns(patterns, matched)


async def _feed_stdin(stream: Any, fd: int) -> None:
    """Copy ``fd`` into the container's stdin, then half-close it (EOF for the command)."""
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        # A file or a device such as /dev/null: a read never blocks for long (a
        # terminal is never passed in: it stays the approval prompt's).
        while chunk := await asyncio.to_thread(os.read, fd, 65536):
            await stream.write_in(chunk)
    else:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(os.dup(fd), "rb")
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            while chunk := await reader.read(65536):
                await stream.write_in(chunk)
        finally:
            transport.close()
    # aiodocker's Stream.close() would close both directions; EOF on the write
    # side alone is what StdinOnce waits for.
    response = getattr(stream, "_resp", None)
    transport = response.connection.transport if response is not None and response.connection else None
    if transport is not None and transport.can_write_eof():
        transport.write_eof()
