"""Shared test bed: origins, leak detectors, a fake upstream DNS and egressd itself.

Addresses (all loopback; Linux routes the whole of 127.0.0.0/8 to lo):

- 127.0.0.1        egressd's listeners and the fake DNS server, on ports the kernel picks
- ORIGIN           an echo server and an HTTP origin (and, for the transparent tests, the origins
                   on ports 443 and 80); the tests' ``--allow-private`` names exactly ORIGIN/32
- LEAK             listeners that count every connection that arrives; outside every allowed
                   range, so a correct egressd never connects there

ORIGIN and LEAK are .2 and .66 of a /24 in 127.0.0.0/8 that each test session picks at random
(tests/harness.py), so that two sessions on one machine never want the same fixed port.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from egressd.approvals.interface import Approver
from egressd.audit.log import AuditSink, MemoryAuditSink
from egressd.cli.wiring.service import EgressService
from egressd.config.settings import load_settings
from tests.fakes.dns import FakeDns
from tests.fakes.tls import make_pki
from tests.harness import LEAK, NET, ORIGIN, ORIGIN_RANGE
from tests.postgres import database, postgres  # noqa: F401 (one PostgreSQL server per session, for every test)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """With EGRESSD_TEST_LOOP=uvloop the async tests run on uvloop, the loop ``egressd serve``
    runs on (scripts/test.sh runs the proxy's tests both ways); else on asyncio's own."""
    if os.environ.get("EGRESSD_TEST_LOOP") == "uvloop":
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


def pytest_report_header(config: pytest.Config) -> str:
    net = ".".join(str(NET.network_address).split(".")[:3])
    return f"egressd test addresses: ORIGIN {ORIGIN}, LEAK {LEAK} (rerun on them: EGRESSD_TEST_NET={net})"


@dataclass
class Listener:
    """A TCP server on one loopback address (on a port the kernel picks, unless given) that counts connections."""

    host: str
    port: int = 0
    connections: int = 0
    server: asyncio.AbstractServer | None = None
    received: list[bytes] = field(default_factory=list)
    bytes_in: int = 0  # a sink's: every byte it read, on every connection


async def _start(
    listener: Listener, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
) -> Listener:
    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener.connections += 1
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    listener.server = await asyncio.start_server(counted, listener.host, listener.port)
    listener.port = listener.server.sockets[0].getsockname()[1]
    return listener


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


async def _record(listener: Listener) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read(65536)
        listener.received.append(data)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nLEAKED")
        await writer.drain()

    return handler


@pytest.fixture
async def echo_origin() -> AsyncIterator[Listener]:
    listener = await _start(Listener(ORIGIN), _echo)
    yield listener
    assert listener.server is not None
    listener.server.close()
    await listener.server.wait_closed()


@pytest.fixture
async def sink_origin() -> AsyncIterator[Listener]:
    """An origin on ORIGIN that reads and counts every byte (``bytes_in``), answering nothing."""
    listener = Listener(ORIGIN)

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            listener.bytes_in += len(data)

    await _start(listener, take)
    yield listener
    assert listener.server is not None
    listener.server.close()
    await listener.server.wait_closed()


@pytest.fixture
async def leak() -> AsyncIterator[Listener]:
    """A listener on LEAK that must never see a connection (it answers like an origin)."""
    listener = Listener(LEAK)
    await _start(listener, await _record(listener))
    yield listener
    assert listener.server is not None
    listener.server.close()
    await listener.server.wait_closed()


@dataclass
class HttpOrigin:
    port: int
    requests: list[dict[str, Any]]


@pytest.fixture
async def http_origin() -> AsyncIterator[HttpOrigin]:
    """An HTTP origin on ORIGIN that records each request's method, path and headers."""
    requests: list[dict[str, Any]] = []

    async def any_path(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        requests.append(
            {"method": request.method, "path": request.path_qs, "headers": dict(request.headers), "body": body}
        )
        if request.path == "/chunked":
            resp = web.StreamResponse(headers={"X-Egress-Decision": "allow", "X-Origin": "yes"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for part in (b"first,", b"second,", b"third"):
                await resp.write(part)
            await resp.write_eof()
            return resp
        if request.path == "/big":
            return web.Response(body=b"x" * (1024 * 1024))
        return web.Response(
            text=f"hello from origin: {request.method} {request.path_qs} {len(body)}",
            headers={"X-Egress-Reason": "forged", "X-Origin": "yes"},
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, ORIGIN, 0)
    await site.start()
    port = runner.addresses[0][1]
    yield HttpOrigin(port, requests)
    await runner.cleanup()


@pytest.fixture
async def dns() -> AsyncIterator[FakeDns]:
    async with FakeDns(
        {
            "origin.test": [ORIGIN],
            "leak.test": [LEAK],
            "sub.example.test": [ORIGIN],
            "example.test": [ORIGIN],
            "evilexample.test": [LEAK],
            "mixed.test": [LEAK, ORIGIN],
        }
    ) as server:
        yield server


MakeEgressd = Callable[..., Awaitable[EgressService]]


@pytest.fixture
async def make_egressd(tmp_path: Path, dns: FakeDns) -> AsyncIterator[MakeEgressd]:
    """Start an egressd in this event loop: ``await make_egressd(allow=[...], ...)``.

    Defaults: ephemeral loopback ports, the fake DNS upstream, ORIGIN's range
    allowed as private, an in-memory audit sink (``svc.audit_records``).
    """
    started: list[EgressService] = []

    async def make(*, approver: Approver | None = None, audit: AuditSink | None = None, **values: Any) -> EgressService:
        values.setdefault("listen", "127.0.0.1:0")
        values.setdefault("control", "127.0.0.1:0")
        values.setdefault("control_token", "test-token")
        values.setdefault("upstream_dns", f"{dns.address[0]}:{dns.address[1]}")
        values.setdefault("allow_private", [ORIGIN_RANGE])
        values.setdefault("audit_log", str(tmp_path / "audit.jsonl"))
        values.setdefault("log_level", "warning")
        settings = load_settings(values)
        sink = audit if audit is not None else MemoryAuditSink()
        service = EgressService(settings, approver=approver, audit=sink)
        await service.start()
        # A file sink's records are in its file; a memory sink's are here.
        service.audit_records = getattr(sink, "records", None)  # type: ignore[attr-defined]
        started.append(service)
        return service

    yield make
    for service in started:
        await service.close(grace_s=0)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A working directory as a real project's: an ordinary user's (uid 1000), where that user can reach it.

    The sandbox runs as the directory's owner, so a root-owned one (like tmp_path) is refused.
    """
    path = Path(tempfile.mkdtemp(prefix="egressd-test-work-"))
    os.chown(path, 1000, 1000)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class HttpsOrigin:
    port: int
    ca_file: Path
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)


@pytest.fixture
async def https_origin(tmp_path: Path) -> AsyncIterator[HttpsOrigin]:
    """An HTTPS origin for origin.test on ORIGIN that records each request (method, path with query, headers)."""
    pki = make_pki(tmp_path, ["origin.test"])
    context = pki.server_context()
    seen: list[tuple[str, str, dict[str, str]]] = []

    async def any_path(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.method, request.raw_path, dict(request.headers)))
        return web.Response(text=f"origin: {request.method} {request.raw_path} {len(body)}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, ORIGIN, 0, ssl_context=context)
    await site.start()
    origin = HttpsOrigin(runner.addresses[0][1], pki.ca_pem, seen)
    yield origin
    await runner.cleanup()
