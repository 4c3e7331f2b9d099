"""``tlslayer.ServerTls``: TLS in memory under a ``Peer`` whose first TLS bytes were already read.

Real sockets and Python's ssl on the client side: the server reads some of
the ClientHello first (as the transparent TLS listener does), then hands
those bytes to the layer.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from egressd.proxy.net.stream import Peer
from egressd.proxy.net.tlslayer import ServerTls
from tests.fakes.tls import Pki, make_pki

pytestmark = pytest.mark.timeout(30)

Serve = Callable[[Peer, ServerTls], Awaitable[None]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), ["origin.test"])


@pytest.fixture
async def server(pki: Pki) -> AsyncIterator[Callable[[Serve, int], Awaitable[tuple[int, list[BaseException]]]]]:
    """Start a server whose connections read ``first`` bytes in clear, then go on in TLS through ``ServerTls``."""
    servers: list[asyncio.Server] = []
    tasks: list[asyncio.Task[None]] = []

    async def start(serve: Serve, first: int) -> tuple[int, list[BaseException]]:
        loop = asyncio.get_running_loop()
        failures: list[BaseException] = []

        async def run(peer: Peer) -> None:
            try:
                while len(peer.buf) < first:
                    assert await peer.fill(loop.time() + 5)
                assert peer.transport is not None
                layer = ServerTls(peer.transport, peer, pki.server_context())
                await layer.handshake(peer.take(), loop.time() + 2)
                peer.transport = layer  # type: ignore[assignment]
                peer.half_open = False
                await serve(peer, layer)
            except BaseException as exc:  # noqa: BLE001 - the test reads them
                failures.append(exc)
            finally:
                peer.close()

        def accepted(peer: Peer) -> None:
            tasks.append(loop.create_task(run(peer)))

        made = await loop.create_server(lambda: Peer(accepted, loop), "127.0.0.1", 0)
        servers.append(made)
        return made.sockets[0].getsockname()[1], failures

    yield start
    for made in servers:
        made.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _echo_until_eof(peer: Peer, layer: ServerTls) -> None:
    """Echo what comes, in clear, until the client's close_notify or FIN."""
    while await peer.fill(peer.loop.time() + 5):
        await peer.send(peer.take())


@pytest.mark.parametrize("first", [1, 5, 60])
async def test_the_handshake_goes_on_from_bytes_already_read_and_data_flows_both_ways(
    server: Callable[..., Awaitable[tuple[int, list[BaseException]]]], pki: Pki, first: int
) -> None:
    port, failures = await server(_echo_until_eof, first)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=pki.client_context(), server_hostname="origin.test"
    )
    big = bytes(range(256)) * 4096  # 1 MiB: many records, and the socket's flow control
    writer.write(big)
    got = await asyncio.wait_for(reader.readexactly(len(big)), 10)
    assert got == big
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.1)
    assert failures == []


async def test_a_client_that_stops_inside_its_hello_times_out(
    server: Callable[..., Awaitable[tuple[int, list[BaseException]]]], pki: Pki
) -> None:
    async def never(peer: Peer, layer: ServerTls) -> None:
        raise AssertionError("the handshake cannot have finished")

    port, failures = await server(never, 5)
    # The first 40 bytes of a real ClientHello, then nothing.
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = pki.client_context().wrap_bio(incoming, outgoing, server_hostname="origin.test")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(hello[:40])
    await asyncio.wait_for(reader.read(), 5)  # closed by the server once its deadline passed
    writer.close()
    assert len(failures) == 1 and isinstance(failures[0], TimeoutError), failures


async def test_a_client_that_rejects_the_certificate_fails_the_handshake(
    server: Callable[..., Awaitable[tuple[int, list[BaseException]]]], pki: Pki, tmp_path: Path
) -> None:
    async def never(peer: Peer, layer: ServerTls) -> None:
        raise AssertionError("the handshake cannot have finished")

    port, failures = await server(never, 5)
    other = make_pki(tmp_path, ["origin.test"])  # trusts another CA only: a pinned client
    with pytest.raises(ssl.SSLError):
        await asyncio.open_connection("127.0.0.1", port, ssl=other.client_context(), server_hostname="origin.test")
    for _ in range(50):
        if failures:
            break
        await asyncio.sleep(0.02)
    # Its alert, or (Python's asyncio client) a reset without one.
    assert len(failures) == 1 and isinstance(failures[0], ssl.SSLError | ConnectionError), failures
