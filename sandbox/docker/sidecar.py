"""egressd's own container (the sidecar): started, waited for until healthy, read from."""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass

from aiodocker.exceptions import DockerError

from ..backend import (
    SandboxError,
)
from .config import API_TIMEOUT_S, CONTROL_PORT, EGRESSD_STATE, EgressdSpec, egressd_config, secrets_archive
from .engine import DockerEngine, DockerUnavailable, container_state, engine_errors
from .networks import DockerRunNetwork

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
            state = await container_state(engine, container_id)
            if not state.get("Running", False) or loop.time() > deadline:
                tail = await container_log_tail(engine, container_id)
                why = "exited" if not state.get("Running", False) else f"did not answer /health within {timeout_s:g}s"
                raise SandboxError(f"egressd's container {why}" + (f": {tail}" if tail else ""))
            await asyncio.sleep(0.1)



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
