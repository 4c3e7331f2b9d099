"""Plain HTTP inside a tunnel: every request names the tunnel's host, or the tunnel is cut.

A CONNECT to an allowed ``host:80`` (or a SOCKS tunnel) that carries plain
HTTP/1 could otherwise send ``Host: evil.test`` to an origin that routes by
Host (a CDN's other tenant): domain fronting without TLS. Each attack is
checked three ways: the client's connection is cut, the origin received no
byte naming the other host (a recording origin counts the requests and keeps
every byte), and the audit log records ``sni_mismatch`` with the Host named.
The transparent Host listener decides every request on its own, which the
last tests here attack too.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.fakes import hellos
from tests.fakes.dns import FakeDns
from tests.harness import ORIGIN, connect_via, egress, read_response, wait_until

EVIL = b"evil.test"


@dataclass
class RecordingOrigin:
    """An HTTP/1.1 origin on ORIGIN that answers every request (keep-alive) and keeps what it received."""

    port: int = 0
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)  # (head, body)
    raw: list[bytes] = field(default_factory=list)  # every byte received, in order

    @property
    def hosts(self) -> list[bytes]:
        found = []
        for head, _ in self.requests:
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"host":
                    found.append(value.strip())
        return found

    def received(self) -> bytes:
        return b"".join(self.raw)


async def _serve(origin: RecordingOrigin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = await reader.read(65536)
                if not data:
                    return
                origin.raw.append(data)
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(buf) < length:
                data = await reader.read(65536)
                if not data:
                    return
                origin.raw.append(data)
                buf += data
            body, buf = buf[:length], buf[length:]
            origin.requests.append((head, body))
            answer = b"request %d" % len(origin.requests)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def origin() -> AsyncIterator[RecordingOrigin]:
    recording = RecordingOrigin()
    server = await asyncio.start_server(lambda r, w: _serve(recording, r, w), ORIGIN, 0)
    recording.port = server.sockets[0].getsockname()[1]
    yield recording
    server.close()
    await server.wait_closed()


def get(host: str | bytes, target: str = "/") -> bytes:
    name = host if isinstance(host, bytes) else host.encode()
    return b"GET " + target.encode() + b" HTTP/1.1\r\nHost: " + name + b"\r\n\r\n"


async def cut(reader: asyncio.StreamReader) -> bytes:
    """What the client read until egressd closed the tunnel (a reset counts as closed)."""
    try:
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        return b""


async def answer(reader: asyncio.StreamReader) -> bytes:
    status, _, body = await read_response(reader)
    assert status == 200, body
    return body


async def tunnel(svc, origin: RecordingOrigin) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # type: ignore[no-untyped-def]
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{origin.port}")
    assert status == 200
    return reader, writer


async def socks_tunnel(svc, origin: RecordingOrigin) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # type: ignore[no-untyped-def]
    reader, writer = await asyncio.open_connection(*svc.socks_address)
    writer.write(b"\x05\x01\x00")
    assert await asyncio.wait_for(reader.readexactly(2), 5) == b"\x05\x00"
    name = b"origin.test"
    writer.write(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", origin.port))
    assert (await asyncio.wait_for(reader.readexactly(10), 5))[:2] == b"\x05\x00"
    return reader, writer


OPENERS = {"connect": tunnel, "socks": socks_tunnel}


@pytest.fixture(params=sorted(OPENERS))
async def opened(request, make_egressd, origin: RecordingOrigin, dns: FakeDns):  # type: ignore[no-untyped-def]
    """A service and a tunnel to origin.test:ORIGIN_PORT through it, by CONNECT or by SOCKS5."""
    svc = await make_egressd(allow=["origin.test:*"], socks="127.0.0.1:0")
    reader, writer = await OPENERS[request.param](svc, origin)
    yield svc, reader, writer, request.param
    writer.close()


async def refused_record(svc, kind: str) -> dict:  # type: ignore[no-untyped-def]
    await wait_until(lambda: [r for r in egress(svc) if r["kind"] == kind])
    [record] = [r for r in egress(svc) if r["kind"] == kind]
    return record


def assert_mismatch(record: dict, named: str = "evil.test") -> None:
    assert (record["decision"], record["reason"], record["end"]) == ("deny", "sni_mismatch", "sni_mismatch"), record
    assert record["request_host"] == named


async def test_a_first_request_naming_another_host_is_cut_before_the_origin_sees_it(
    opened, origin: RecordingOrigin
) -> None:
    svc, reader, writer, kind = opened
    writer.write(get("evil.test"))
    await cut(reader)
    assert origin.requests == [] and EVIL not in origin.received()
    assert_mismatch(await refused_record(svc, kind))
    assert svc.path.recorder.metrics.decisions[("deny", "sni_mismatch")] == 1


async def test_a_second_request_naming_another_host_is_cut(opened, origin: RecordingOrigin) -> None:
    svc, reader, writer, kind = opened
    writer.write(get(f"origin.test:{origin.port}", "/one"))
    assert await answer(reader) == b"request 1"
    writer.write(get("evil.test", "/two"))
    await cut(reader)
    assert len(origin.requests) == 1 and EVIL not in origin.received()
    assert_mismatch(await refused_record(svc, kind))


async def test_a_pipelined_request_naming_another_host_is_cut(opened, origin: RecordingOrigin) -> None:
    svc, reader, writer, kind = opened
    writer.write(get("origin.test", "/one") + get("evil.test", "/two"))
    assert b"request 1" not in await cut(reader)  # all was held: the first request did not go alone
    assert origin.requests == [] and EVIL not in origin.received()
    assert_mismatch(await refused_record(svc, kind))


async def test_an_absolute_form_target_naming_another_host_is_cut(opened, origin: RecordingOrigin) -> None:
    svc, reader, writer, kind = opened
    writer.write(b"GET http://evil.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    await cut(reader)
    assert origin.requests == [] and EVIL not in origin.received()
    assert_mismatch(await refused_record(svc, kind))


async def test_a_request_head_sent_byte_by_byte_is_still_checked(opened, origin: RecordingOrigin) -> None:
    svc, reader, writer, kind = opened
    for byte in get("evil.test"):
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0)
    await cut(reader)
    assert origin.requests == [] and b"Host" not in origin.received()
    assert_mismatch(await refused_record(svc, kind))


async def test_an_unfinished_head_then_a_half_close_never_goes_on(opened, origin: RecordingOrigin) -> None:
    svc, reader, writer, kind = opened
    writer.write(get(f"origin.test:{origin.port}", "/one"))
    assert await answer(reader) == b"request 1"
    writer.write(b"GET /two HTTP/1.1\r\nHost: evil.test\r\n")  # no empty line yet: held
    writer.write_eof()  # a half-close ends a TLS check and relays what it held; not this one
    assert await cut(reader) == b""
    writer.close()
    await wait_until(lambda: egress(svc))
    assert len(origin.requests) == 1 and EVIL not in origin.received()


async def test_a_fake_head_inside_a_body_is_body(opened, origin: RecordingOrigin) -> None:
    svc, reader, writer, kind = opened
    inner = get("evil.test")
    writer.write(b"POST /up HTTP/1.1\r\nHost: origin.test\r\nContent-Length: %d\r\n\r\n%s" % (len(inner), inner))
    assert await answer(reader) == b"request 1"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
    writer.write(b"POST /up HTTP/1.1\r\nHost: ORIGIN.test.\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
    assert await answer(reader) == b"request 2"  # the origin read the whole chunked body as one request's
    writer.write(get(f"origin.test:{origin.port}", "/three"))
    assert await answer(reader) == b"request 3"
    assert [body for _, body in origin.requests][0] == inner
    writer.close()
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["decision"] == "allow"


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\nHost: origin.test:1\r\n\r\n",  # another port
        b"GET / HTTP/1.1\r\n\r\n",  # no Host at all: the origin would pick one
        b"GET / HTTP/1.1\r\nHost: origin.test\r\nHost: evil.test\r\n\r\n",
        b"GET / HTTP/1.1\nHost: evil.test\n\n",  # bare LF: lenient servers read it
        b"\r\n\r\nGET / HTTP/1.1\r\nHost: evil.test\r\n\r\n",  # empty lines first (RFC 9112 \u00a72.2)
        b"GET  / HTTP/1.1\r\nHost: evil.test\r\n\r\n",  # two spaces: not ours to guess how it is read
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 with prior knowledge: its authority cannot be read here
        b"GET / HTTP/1.1\r\nHost: origin.test\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
        b"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n",
    ],
    ids=["port", "no Host", "two Hosts", "bare LF", "empty lines", "two spaces", "h2 preface", "h2c", "CONNECT"],
)
async def test_requests_that_do_not_name_the_tunnels_host_plainly_are_cut(
    make_egressd, origin: RecordingOrigin, dns: FakeDns, raw: bytes
) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer = await tunnel(svc, origin)
    writer.write(raw)
    await cut(reader)
    writer.close()
    assert origin.requests == [] and origin.received() == b""
    record = await refused_record(svc, "connect")
    assert record["decision"] == "deny" and record["reason"] in ("sni_mismatch", "bad_request"), record


async def test_a_hello_answered_in_plain_http_leaves_the_requests_checked(make_egressd, dns: FakeDns) -> None:
    """A ClientHello naming the right host, sent to a plain-HTTP origin that answers it with a 400 and
    keeps the connection: the server's answer is not TLS, so what the client sends next is read afresh."""
    seen: list[bytes] = []

    async def lenient(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            seen.append(data)
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(lenient, ORIGIN, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        svc = await make_egressd(allow=["origin.test:*"])
        _, _, _, reader, writer = await connect_via(svc, f"origin.test:{port}")
        writer.write(hellos.client_hello("origin.test"))
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 400")
        writer.write(get("evil.test"))
        await cut(reader)
        writer.close()
        assert EVIL not in b"".join(seen)
        assert_mismatch(await refused_record(svc, "connect"))
    finally:
        server.close()
        await server.wait_closed()


async def test_other_protocols_still_pass_unchecked(make_egressd, echo_origin, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    _, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    line = b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n"  # text with spaces, but no HTTP version
    writer.write(line)
    assert await asyncio.wait_for(reader.readexactly(len(line)), 5) == line
    writer.write(get("evil.test"))  # after another protocol's first line, the stream is that protocol's
    assert await asyncio.wait_for(reader.readexactly(len(get("evil.test"))), 5) == get("evil.test")
    writer.close()


async def test_a_websocket_upgrade_is_followed_and_then_relayed(make_egressd, dns: FakeDns) -> None:
    seen: list[bytes] = []

    async def websocket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        while data := await reader.read(4096):
            seen.append(data)
            writer.write(data)
        writer.close()

    server = await asyncio.start_server(websocket, ORIGIN, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        svc = await make_egressd(allow=["origin.test:*"])
        _, _, _, reader, writer = await connect_via(svc, f"origin.test:{port}")
        writer.write(b"GET /ws HTTP/1.1\r\nHost: origin.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 101")
        frames = b"\x81\x05hello" + get("anything.test")  # after the switch: WebSocket's bytes, not HTTP
        writer.write(frames)
        assert await asyncio.wait_for(reader.readexactly(len(frames)), 5) == frames
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


# --- the transparent Host listener: each request is decided on its own Host ------------------


@pytest.fixture
async def origin80() -> AsyncIterator[list[dict]]:
    requests: list[dict] = []

    async def any_path(request: web.Request) -> web.Response:
        requests.append({"path": request.path_qs, "host": request.headers.get("Host")})
        return web.Response(text="port 80")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ORIGIN, 80, reuse_address=True).start()
    yield requests
    await runner.cleanup()


async def test_the_host_listener_decides_a_second_request_on_its_own_host(
    make_egressd, origin80: list[dict], dns: FakeDns
) -> None:
    dns.set("evil.test", [ORIGIN])  # the same address as the allowed name: only the Host differs
    svc = await make_egressd(allow=["origin.test"], transparent_http="127.0.0.1:0", ask=False)
    reader, writer = await asyncio.open_connection(*svc.transparent_http.address)
    writer.write(get("origin.test", "/one"))
    assert (await read_response(reader))[0] == 200
    writer.write(get("evil.test", "/two"))
    status, headers, _ = await read_response(reader)
    writer.close()  # a refusal closes the connection
    reader, writer = await asyncio.open_connection(*svc.transparent_http.address)
    writer.write(b"GET http://origin.test/three HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    assert (await read_response(reader))[0] == 200  # absolute-form decides, and is what the origin hears
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "not_allowlisted"
    assert [(r["path"], r["host"]) for r in origin80] == [("/one", "origin.test"), ("/three", "origin.test")]
    assert not dns.asked("evil.test")


# --- SOCKS: the success reply says nothing about egressd's upstream side ---------------------


async def test_the_socks_success_reply_binds_nothing_it_would_reveal(
    make_egressd, origin: RecordingOrigin, dns: FakeDns
) -> None:
    svc = await make_egressd(allow=["origin.test:*"], socks="127.0.0.1:0")
    reader, writer = await asyncio.open_connection(*svc.socks_address)
    writer.write(b"\x05\x01\x00")
    assert await asyncio.wait_for(reader.readexactly(2), 5) == b"\x05\x00"
    writer.write(b"\x05\x01\x00\x03\x0borigin.test" + struct.pack("!H", origin.port))
    # RFC 1928 §6: BND.ADDR and BND.PORT are egressd's upstream socket; 0.0.0.0:0 tells a client nothing.
    reply = await asyncio.wait_for(reader.readexactly(10), 5)
    writer.close()
    assert reply == b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"
