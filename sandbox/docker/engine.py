"""The Docker backend's engine calls: the API client, errors mapped once, owners and leftovers.

``DockerEngine`` is the only place an Engine API call is made; ``engine_errors`` turns what
aiodocker and aiohttp raise into ``DockerUnavailable``. Owners: every resource is labelled with
the boot id, pid and start time of the egressd that made it, so one whose egressd died is found
(``owner_alive``) and removed (``clean_leftovers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError

from ..backend import (
    SandboxError,
)
from .config import API_TIMEOUT_S, CLEAN_PASSES, CLEAN_RETRY_S, LABEL_OWNER, LABEL_RUN


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


def boot_id() -> str:
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
    return f"{boot_id()}:{pid}:{_start_time(pid)}"


def owner_alive(token: str, *, boot_id: str, start_time_of: Any = _start_time) -> bool:
    """True while the owner named by ``token`` still runs on this boot (pure given ``start_time_of``)."""
    boot, _, rest = token.partition(":")
    pid_text, _, start = rest.partition(":")
    if boot != boot_id or not pid_text.isdigit():
        return False
    return start_time_of(int(pid_text)) == start



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
    boot = boot_id()
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

async def container_state(engine: DockerEngine, container_id: str) -> dict[str, Any]:
    with engine_errors("cannot inspect a container"):
        async with asyncio.timeout(API_TIMEOUT_S):
            info = await engine.client.containers.container(container_id).show()
    return dict(info.get("State") or {})
