"""The Docker backend's pure part: addresses, labels, container and network specifications, copy-out checks.

No I/O: each function turns values into the Engine API's JSON (or a verdict), so all of it is
tested without an engine. The constants are the backend's fixed choices.
"""

from __future__ import annotations

import fnmatch
import functools
import io
import ipaddress
import json
import re
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar

from ..backend import (
    SandboxError,
)
from ..bwrap import SANDBOX_GID, SANDBOX_HOSTNAME, SANDBOX_UID, SANDBOX_WORKDIR, SYSTEM_BUNDLE
from ..copyout import MAX_BYTES, MAX_FILES, CopyReport
from ..identity import refusal, run_as
from ..limits import Limits
from ..seccomp import SeccompUnsupported, docker_profile

DEFAULT_IMAGE = "egressd-sandbox:latest"  # docker/sandbox.Dockerfile, as docker/build.sh tags it
DEFAULT_EGRESSD_IMAGE = "egressd:latest"  # docker/Dockerfile
LABEL_RUN = "egressd.run"
LABEL_OWNER = "egressd.owner"
LABEL_ROLE = "egressd.role"
# /28s from the link-local range: 16 addresses are plenty for egressd and one
# sandbox, and 169.254.64.0/18 holds 1024 concurrent runs. Disjoint from the
# bubblewrap backend's range (``sandbox.network.DEFAULT_RANGE``): a veth of a
# bubblewrap run must never hold an address inside a Docker run's network.
DEFAULT_DOCKER_RANGE = "169.254.64.0/18"
FALLBACK_DOCKER_RANGE = "100.64.64.0/18"  # carrier-grade NAT, for engines that refuse link-local
SUBNET_PREFIX = 28
METADATA_NET = ipaddress.ip_network("169.254.169.0/24")
CONTROL_PORT = 3129
PROXY_PORT = 3128
SOCKS_PORT = 1080  # the sidecar's SOCKS5 listener (``ALL_PROXY=socks5h://...`` in the command's container)
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

WORKDIR_ROOT = SANDBOX_WORKDIR.strip("/")
# The internal network's bridge (``RunPlan.bridge``) and the nftables table that fences it
# off from the host (``fence_ruleset``): ``egressd-fence-<run key>-<pid>-<start time>``.
BRIDGE_PREFIX = "egdb"
FENCE_PREFIX = "egressd-fence-"  # the archive of /work names its members work/...

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

    @property
    def bridge(self) -> str:
        """The internal network's bridge on the engine's host, named by us so it is fenced by name."""
        return f"{BRIDGE_PREFIX}{self.run_key}"  # 12 characters: IFNAMSIZ allows 15


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
    skip: int = 0,
) -> list[ipaddress.IPv4Network]:
    """``count`` free /``prefix`` subnets of ``pool`` that overlap nothing taken (pure).

    The first free ones, or with ``skip``, the free ones from the ``skip``-th
    on (counting round: fewer than ``skip`` free wraps to the start), so runs
    starting together can spread out instead of all reaching for the first.
    Raises ValueError when the pool is not an IPv4 network, is in a range
    egressd never uses (private 10/8, 172.16/12, 192.168/16, or public
    space), or has no room left.
    """
    network = ipaddress.ip_network(pool, strict=True)
    if not isinstance(network, ipaddress.IPv4Network):
        raise ValueError(f"{pool} is not an IPv4 network")
    allowed = (ipaddress.IPv4Network("169.254.0.0/16"), ipaddress.IPv4Network("100.64.0.0/10"))
    if not any(network.subnet_of(a) for a in allowed):
        raise ValueError(f"{pool} is outside 169.254.0.0/16 (link-local) and 100.64.0.0/10 (carrier-grade NAT)")
    if network.prefixlen > prefix:
        raise ValueError(f"{pool} is smaller than one /{prefix}")
    taken = [t for t in taken if t.version == 4] + [METADATA_NET]
    free = [c for c in network.subnets(new_prefix=prefix) if not any(c.overlaps(t) for t in taken)]
    if len(free) < count:
        raise ValueError(f"no free /{prefix} left in {pool}")
    start = skip % (len(free) - count + 1)
    return free[start : start + count]


def resource_labels(run_key: str, role: str, owner: str, extra: Mapping[str, str]) -> dict[str, str]:
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
    trust_bundle: str | None = None  # host path of the CA bundle bound over the standard one (a run that inspects)


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
    if spec.trust_bundle is not None:
        host["Mounts"].append({"Type": "bind", "Source": spec.trust_bundle, "Target": SYSTEM_BUNDLE, "ReadOnly": True})
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


# A file of the archive: a setting's name, or "declared." and a declared secret's variable name.
_FILE_NAME = re.compile(r"[a-z_]+|declared\.[A-Za-z_][A-Za-z0-9_]*")


def secrets_archive(secrets: Mapping[str, str], *, uid: int = SIDECAR_UID, gid: int = SIDECAR_GID) -> bytes:
    """A tar of ``secrets/NAME`` files (mode 0400 in a 0700 directory, ``uid``:``gid``'s) for ``EGRESSD_STATE`` (pure).

    egressd reads them as NAME_file settings, which refuse a file that
    anyone but its owner may read. A name is a setting's (lower case and
    underscores), or ``declared.`` and a declared secret's variable name:
    nothing that could climb out of the directory.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        directory = tarfile.TarInfo("secrets")
        directory.type, directory.mode, directory.uid, directory.gid = tarfile.DIRTYPE, 0o700, uid, gid
        tar.addfile(directory)
        for name, value in sorted(secrets.items()):
            if not _FILE_NAME.fullmatch(name):
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
    name: str, subnet: ipaddress.IPv4Network, *, internal: bool, labels: Mapping[str, str], bridge: str | None = None,
) -> dict[str, Any]:
    """A bridge network with an explicit subnet (pure); an internal one gets no host address.

    ``bridge`` names its bridge on the host (else the engine's ``br-<id>``).
    """
    options = {"com.docker.network.bridge.inhibit_ipv4": "true"} if internal else {}
    if bridge:
        options["com.docker.network.bridge.name"] = bridge
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


# -- the fence: the internal bridge, seen from the host (pure) ---------------------------------


def fence_table(run_key: str, pid: int, start: str) -> str:
    """The nftables table fencing a run's bridge, named after the run and its egressd (pure).

    nftables keeps nothing across a reboot, so pid and start time say whether
    the egressd that made it still runs (``fence_owner``).
    """
    return f"{FENCE_PREFIX}{run_key}-{pid}-{start}"


def fence_owner(table: str) -> tuple[int, str] | None:
    """(pid, start time) of the egressd a fence table names; None: not a fence table (pure)."""
    if not table.startswith(FENCE_PREFIX):
        return None
    parts = table.removeprefix(FENCE_PREFIX).split("-")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1]), parts[2]


def fence_ruleset(table: str, bridge: str) -> str:
    """The host's nftables table for one run's internal bridge (pure).

    Whatever arrives on the bridge is dropped before the host takes it in
    (input) or routes it anywhere (forward); only frames bridged from one
    port to another (the sandbox and egressd, each on a port of the bridge:
    with br_netfilter they pass the forward hook leaving by the bridge
    itself) go on. The bridge has no address, the sandbox's default route
    names a gateway nobody holds; if the host did hold that address
    somewhere (another tool's interface), the sandbox still reaches nothing
    of the host. A drop in any base chain is final, whatever Docker's or
    anyone's chains accept; priority -10 sees the packets first.
    """
    return (
        f"table inet {table} {{\n"
        "  chain input {\n"
        "    type filter hook input priority -10; policy accept;\n"
        f'    iifname "{bridge}" drop\n'
        "  }\n"
        "  chain forward {\n"
        "    type filter hook forward priority -10; policy accept;\n"
        f'    iifname "{bridge}" oifname != "{bridge}" drop\n'
        "  }\n"
        "}\n"
    )


# The bridge never answers ARP for the host's addresses (arp_ignore 8), nor names one in its own (arp_announce 2).
BRIDGE_SYSCTLS = (("arp_ignore", "8"), ("arp_announce", "2"))


def addresses_inside(
    links: Sequence[Mapping[str, Any]], subnet: ipaddress.IPv4Network, *, bridge: str
) -> list[str]:
    """``IFNAME ADDRESS/PREFIX`` of every host address inside ``subnet`` but on the run's own ``bridge`` (pure).

    ``links`` is ``ip -j addr``'s answer. An address of the host inside the
    run's network is one the sandbox could reach as a neighbour (the
    gateway .1 above all: the sandbox's default route).
    """
    found = []
    for link in links:
        name = str(link.get("ifname", ""))
        if name == bridge:
            continue
        for info in link.get("addr_info") or ():
            if info.get("family") not in (None, "inet"):
                continue
            try:
                interface = ipaddress.ip_interface(f"{info['local']}/{info.get('prefixlen', 32)}")
            except (KeyError, ValueError):
                continue
            if isinstance(interface, ipaddress.IPv4Interface) and interface.ip in subnet:
                found.append(f"{name} {interface}")
    return found


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
