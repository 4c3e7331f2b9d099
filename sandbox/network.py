"""A run's network: a namespace joined to the host by a veth pair, fenced by nftables.

Per run: a network namespace ``egd-<id>``, a veth pair ``egd<id>h`` (host)
and ``egd<id>s`` (sandbox) on a /30 of its own taken from the configured
range, and inside the namespace: loopback, the veth, no default route, IPv6
off, and an nftables table whose output chain drops everything except TCP to
egressd's proxy, TLS and HTTP ports and UDP/TCP to its DNS port on the
host-side address. The sandbox has no capabilities in the namespace's owning
user namespace, so it can change none of this, and raw sockets are out of
reach too.

The default range is link-local (169.254.0.0/16, RFC 3927): a point-to-point
veth link is exactly a link, the addresses are never routed anywhere, and
they do not collide with a LAN's private ranges. 169.254.169.0/24 (cloud
metadata) is never used. It lies outside the Docker backend's range
(169.254.64.0/18, ``sandbox.docker.config.DEFAULT_DOCKER_RANGE``): the host
end of a veth holds the /30's first address, which inside a Docker run's
internal network would be the gateway its sandbox routes through.

Everything created carries the ``egd`` prefix, so leftovers of a crashed run
are found by name (``leftovers``) and removed (``clean_leftovers``).
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PREFIX = "egd"
# Clear of the Docker backend's 169.254.64.0/18 and of 169.254.20.0/24 (Kubernetes' node-local DNS).
DEFAULT_RANGE = "169.254.40.0/22"
METADATA_NET = ipaddress.ip_network("169.254.169.0/24")
STATE_DIR = Path("/run/egressd")
LOCK_PATH = STATE_DIR / "network.lock"
# One file per live run, holding the pid of the egressd that owns it: a run
# whose owner is gone is a leftover.
OWNERS_DIR = STATE_DIR / "runs"


class NetworkError(Exception):
    """The run's network could not be created; the message says which step and why."""


@dataclass(frozen=True)
class EgressPorts:
    """The ports egressd listens on at the host-side address."""

    proxy: int = 3128
    dns: int = 53
    tls: int = 443
    http: int = 80
    socks: int = 1080  # SOCKS5 (``ALL_PROXY=socks5h://...`` in the sandbox)


@dataclass(frozen=True)
class NetworkPlan:
    """Names and addresses for one run (pure)."""

    run_key: str  # 8 hex characters
    subnet: ipaddress.IPv4Network

    @property
    def netns(self) -> str:
        return f"{PREFIX}-{self.run_key}"

    @property
    def host_if(self) -> str:
        return f"{PREFIX}{self.run_key}h"  # 12 characters: IFNAMSIZ allows 15

    @property
    def sandbox_if(self) -> str:
        return f"{PREFIX}{self.run_key}s"

    @property
    def host_ip(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 1

    @property
    def sandbox_ip(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 2

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"


def nft_ruleset(host_ip: ipaddress.IPv4Address, ports: EgressPorts) -> str:
    """The namespace's nftables table: only egressd's ports on the host address (pure)."""
    tcp = ", ".join(str(p) for p in sorted({ports.proxy, ports.tls, ports.http, ports.dns, ports.socks}))
    return (
        "table inet egressd {\n"
        "  chain output {\n"
        "    type filter hook output priority 0; policy drop;\n"
        '    oif "lo" accept\n'
        f"    ip daddr {host_ip} tcp dport {{ {tcp} }} accept\n"
        f"    ip daddr {host_ip} udp dport {ports.dns} accept\n"
        "  }\n"
        "  chain input {\n"
        "    type filter hook input priority 0; policy drop;\n"
        '    iif "lo" accept\n'
        "    ct state established,related accept\n"
        "  }\n"
        "}\n"
    )


def choose_subnet(
    pool: ipaddress.IPv4Network, taken: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network]
) -> ipaddress.IPv4Network:
    """The first /30 of ``pool`` that overlaps nothing taken (pure)."""
    taken = [t for t in taken if t.version == 4]
    for candidate in pool.subnets(new_prefix=30):
        if candidate.overlaps(METADATA_NET):
            continue
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise NetworkError(f"no free /30 left in {pool} (every one is in use or collides with a route)")


async def _run(*argv: str, stdin: bytes | None = None, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:4])}… failed: {err.decode(errors='replace').strip()}")
    return out.decode()


async def _taken_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every prefix the host routes or has on an interface: a run must collide with none."""
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for route in json.loads(await _run("ip", "-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst")
        if dst and dst != "default":
            try:
                nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
            except ValueError:
                continue
    for link in json.loads(await _run("ip", "-j", "-4", "addr") or "[]"):
        for info in link.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False))
    return nets


class _Lock:
    """Host-wide lock so two runs starting at once never pick the same /30."""

    def __init__(self) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    async def __aenter__(self) -> None:
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                await asyncio.sleep(0.02)

    async def __aexit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


class RunNetwork:
    """A created run network; ``destroy`` removes all of it (idempotent)."""

    def __init__(self, plan: NetworkPlan, ports: EgressPorts) -> None:
        self.plan = plan
        self.ports = ports
        self._destroyed = False

    @classmethod
    async def create(cls, *, pool: str = DEFAULT_RANGE, ports: EgressPorts = EgressPorts()) -> RunNetwork:
        """Allocate a /30, create namespace, veth, addresses and the nftables fence.

        On any failure everything made so far is removed before NetworkError is raised.
        """
        try:
            network = ipaddress.ip_network(pool)
        except ValueError as exc:
            raise NetworkError(f"bad sandbox address range {pool!r}: {exc}") from None
        if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 30:
            raise NetworkError(f"bad sandbox address range {pool!r}: needs an IPv4 network of /30 or larger")
        async with _Lock():
            subnet = choose_subnet(network, await _taken_networks())
            plan = NetworkPlan(secrets.token_hex(4), subnet)
            net = cls(plan, ports)
            OWNERS_DIR.mkdir(parents=True, exist_ok=True)
            (OWNERS_DIR / plan.run_key).write_text(f"{os.getpid()}\n")
            try:
                await net._build()
            except BaseException:
                await net.destroy()
                raise
        return net

    async def _build(self) -> None:
        p = self.plan
        host_cidr = f"{p.host_ip}/{p.subnet.prefixlen}"
        sandbox_cidr = f"{p.sandbox_ip}/{p.subnet.prefixlen}"
        await _run("ip", "netns", "add", p.netns)
        await _run("ip", "link", "add", p.host_if, "type", "veth", "peer", "name", p.sandbox_if)
        await _run("ip", "link", "set", p.sandbox_if, "netns", p.netns)
        await _run("ip", "addr", "add", host_cidr, "dev", p.host_if)
        await _run("ip", "link", "set", p.host_if, "up")
        # No IPv6 inside at all: no link-local address, no router solicitations.
        for key in ("all", "default", "lo"):
            await _run("ip", "netns", "exec", p.netns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1")
        await _run("ip", "-n", p.netns, "addr", "add", sandbox_cidr, "dev", p.sandbox_if)
        await _run("ip", "-n", p.netns, "link", "set", "lo", "up")
        await _run("ip", "-n", p.netns, "link", "set", p.sandbox_if, "up")
        await _run("ip", "netns", "exec", p.netns, "nft", "-f", "-", stdin=nft_ruleset(p.host_ip, self.ports).encode())

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        await remove(self.plan.netns, self.plan.host_if)
        (OWNERS_DIR / self.plan.run_key).unlink(missing_ok=True)


async def remove(netns: str, host_if: str | None) -> None:
    """Remove a namespace and its host-side veth (either may already be gone)."""
    # Deleting the namespace destroys the sandbox end, which takes the pair with it;
    # the explicit delete covers a veth left behind by a half-built run.
    await _run("ip", "netns", "del", netns, check=False)
    if host_if:
        await _run("ip", "link", "del", host_if, check=False)


async def leftovers() -> tuple[list[str], list[str]]:
    """Namespaces and host veths named like ours (from runs that died)."""
    names = [line.split()[0] for line in (await _run("ip", "netns", "list", check=False)).splitlines() if line.strip()]
    netns = [n for n in names if n.startswith(f"{PREFIX}-")]
    links = json.loads(await _run("ip", "-j", "link", "show", check=False) or "[]")
    veths = [
        link["ifname"]
        for link in links
        if link.get("ifname", "").startswith(PREFIX) and link["ifname"].endswith("h")
    ]
    return netns, veths


def owner_alive(run_key: str) -> bool:
    """True while the egressd that created this run is still running."""
    try:
        pid = int((OWNERS_DIR / run_key).read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def clean_leftovers() -> list[str]:
    """Remove every egd namespace/veth whose owning egressd is gone; returns what was removed."""
    netns, veths = await leftovers()
    removed = []
    for name in netns:
        key = name.removeprefix(f"{PREFIX}-")
        if owner_alive(key):
            continue
        await remove(name, f"{PREFIX}{key}h")
        (OWNERS_DIR / key).unlink(missing_ok=True)
        removed.append(name)
    for veth in veths:
        key = veth[len(PREFIX):-1]
        if owner_alive(key) or f"{PREFIX}-{key}" in netns:
            continue
        await _run("ip", "link", "del", veth, check=False)
        removed.append(veth)
    return removed
