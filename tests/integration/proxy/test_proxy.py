"""The normal path through the proxy: tunnels, plain HTTP, runs, shutdown."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os

import aiohttp
import pytest

from egressd.proxy.core.policy import parse_entry
from tests.harness import ORIGIN, connect_via, egress, open_proxy, read_response, wait_until


async def test_connect_tunnel_relays_both_ways_and_is_audited(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    status, headers, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200 and "x-egress-decision" not in headers
    payload = os.urandom(3 * 1024 * 1024)

    async def send() -> None:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()

    sender = asyncio.create_task(send())
    echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    await sender
    assert echoed == payload
    assert await asyncio.wait_for(reader.read(), 5) == b""  # half-close passed on, then closed
    writer.close()
    await wait_until(lambda: egress(svc))
    record = egress(svc)[-1]
    assert record["decision"] == "allow" and record["kind"] == "connect"
    assert record["host"] == "origin.test" and record["port"] == echo_origin.port
    assert record["address"] == ORIGIN and record["rule"] == "origin.test:*"
    assert record["bytes_up"] == len(payload) and record["bytes_down"] == len(payload)
    assert record["run"] == "default" and record["duration_s"] >= 0


async def test_bytes_sent_right_after_connect_are_not_lost(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer = await open_proxy(svc)
    writer.write(f"CONNECT origin.test:{echo_origin.port} HTTP/1.1\r\n\r\nearly-bytes".encode())
    status, _, _ = await read_response(reader)
    assert status == 200
    assert await asyncio.wait_for(reader.readexactly(11), 5) == b"early-bytes"
    writer.close()


async def test_many_concurrent_tunnels_all_echo(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])

    async def one(i: int) -> bytes:
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
        assert status == 200
        message = f"tunnel-{i:04d}".encode()
        writer.write(message)
        data = await asyncio.wait_for(reader.readexactly(len(message)), 10)
        writer.close()
        return data

    results = await asyncio.gather(*(one(i) for i in range(200)))
    assert results == [f"tunnel-{i:04d}".encode() for i in range(200)]
    await wait_until(lambda: len(egress(svc)) == 200)


async def test_plain_http_keep_alive_requests_are_each_decided(make_egressd, http_origin, dns) -> None:
    svc = await make_egressd(allow=[f"origin.test:{http_origin.port}"], ask=False)
    reader, writer = await open_proxy(svc)
    writer.write(f"GET http://origin.test:{http_origin.port}/one HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, headers, body = await read_response(reader)
    assert status == 200 and body.endswith(b"GET /one 0")
    assert "x-egress-reason" not in headers and headers["x-origin"] == "yes"  # forged header stripped
    # same connection, a second allowed request, then a refused one
    writer.write(f"POST http://origin.test:{http_origin.port}/two HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello".encode())
    status, _, body = await read_response(reader)
    assert status == 200 and body.endswith(b"POST /two 5")
    writer.write(b"GET http://leak.test/ HTTP/1.1\r\n\r\n")
    status, headers, _ = await read_response(reader)
    assert status == 403 and headers["x-egress-reason"] == "not_allowlisted"
    writer.close()
    assert [r["decision"] for r in egress(svc)] == ["allow", "allow", "deny"]
    assert [r.get("status") for r in egress(svc)][:2] == [200, 200]
    assert not dns.asked("leak.test")


async def test_plain_http_pipelined_requests_are_answered_in_order(make_egressd, http_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer = await open_proxy(svc)
    writer.write(b"".join(
        f"GET http://origin.test:{http_origin.port}/p{i} HTTP/1.1\r\n\r\n".encode() for i in range(3)
    ))
    bodies = [(await read_response(reader))[2] for _ in range(3)]
    writer.close()
    assert [b.rsplit(b" ", 2)[1] for b in bodies] == [b"/p0", b"/p1", b"/p2"]


async def test_plain_http_chunked_response_and_hop_by_hop_headers(make_egressd, http_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    proxy = "http://{}:{}".format(*svc.proxy_address)
    async with aiohttp.ClientSession() as session:
        async with session.get(
            f"http://origin.test:{http_origin.port}/chunked",
            proxy=proxy,
            headers={"Connection": "keep-alive, X-Secret", "X-Secret": "hop", "Keep-Alive": "timeout=5"},
        ) as resp:
            body = await resp.read()
            assert resp.status == 200 and body == b"first,second,third"
            assert "X-Egress-Decision" not in resp.headers
    seen = http_origin.requests[0]["headers"]
    assert "X-Secret" not in seen and "Keep-Alive" not in seen and "Proxy-Authorization" not in seen


async def test_plain_http_large_response(make_egressd, http_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    proxy = "http://{}:{}".format(*svc.proxy_address)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://origin.test:{http_origin.port}/big", proxy=proxy) as resp:
            assert len(await resp.read()) == 1024 * 1024
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["bytes_down"] > 1024 * 1024


async def test_run_credentials_attribute_requests_and_proxy_authorization_is_not_forwarded(
    make_egressd, http_origin
) -> None:
    svc = await make_egressd(require_auth=True)
    run = svc.runs.create(
        task="fetch", allow=[parse_entry("origin.test:*")]
    )
    creds = base64.b64encode(f"{run.id}:{run.token}".encode()).decode()
    reader, writer = await open_proxy(svc)
    writer.write(
        f"GET http://origin.test:{http_origin.port}/r HTTP/1.1\r\nProxy-Authorization: Basic {creds}\r\n\r\n".encode()
    )
    status, _, _ = await read_response(reader)
    assert status == 200
    bad = base64.b64encode(f"{run.id}:wrong".encode()).decode()
    writer.write(
        f"GET http://origin.test:{http_origin.port}/r HTTP/1.1\r\nProxy-Authorization: Basic {bad}\r\n\r\n".encode()
    )
    status, headers, _ = await read_response(reader)
    writer.close()
    assert status == 407 and headers["x-egress-reason"] == "auth_required"
    assert "Proxy-Authorization" not in http_origin.requests[0]["headers"]
    assert egress(svc)[0]["run"] == run.id
    assert run.token not in repr(svc.audit_records)


@pytest.mark.parametrize(
    "header",
    [
        # Found by tests/fuzz (proxy_auth): non-ASCII base64 made b64decode
        # raise ValueError, which parse_proxy_authorization did not catch.
        b"Basic \xe9",
        # A token that is not ASCII, for a run id that does not exist:
        # hmac.compare_digest raised TypeError comparing non-ASCII str.
        b"Basic " + base64.b64encode("r-nobody:\u00e9".encode()),
    ],
)
async def test_malformed_proxy_credentials_are_a_407_not_a_dropped_connection(make_egressd, header: bytes) -> None:
    svc = await make_egressd(require_auth=True)
    reader, writer = await open_proxy(svc)
    writer.write(b"CONNECT origin.test:443 HTTP/1.1\r\nProxy-Authorization: " + header + b"\r\n\r\n")
    status, headers, _ = await read_response(reader)
    writer.close()
    assert status == 407 and headers["x-egress-reason"] == "auth_required"
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["reason"] == "auth_required"


@pytest.mark.parametrize(
    "value",
    [
        "Basic \xe9",  # ValueError from b64decode
        "Basic YWJj\xe9OmQ=",
        "\xa0Basic " + base64.b64encode(b"r-1:t").decode(),  # str.strip() took NBSP for whitespace
        "Basic " + base64.b64encode(b"r-1:t").decode() + "\x85",
        "Basic\x1f" + base64.b64encode(b"r-1:t").decode(),
    ],
)
def test_malformed_proxy_authorization_gives_no_credentials(value: str) -> None:
    from egressd.proxy.core.runs import parse_proxy_authorization

    assert parse_proxy_authorization(value) is None


def test_a_non_ascii_token_authenticates_nobody() -> None:
    from egressd.proxy.core.runs import RunRegistry

    registry = RunRegistry()
    run = registry.create(task=None, allow=())
    for run_id in ("r-nobody", run.id):
        header = "Basic " + base64.b64encode(f"{run_id}:\u00e9".encode()).decode()
        assert registry.authenticate(header) is None
    good = "Basic " + base64.b64encode(f"{run.id}:{run.token}".encode()).decode()
    assert registry.authenticate(good) is run


async def test_per_run_connection_cap_answers_429(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], max_connections_per_run=2)
    held = [await connect_via(svc, f"origin.test:{echo_origin.port}") for _ in range(2)]
    assert [h[0] for h in held] == [200, 200]
    status, headers, _, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert status == 429 and headers["x-egress-reason"] == "limit_exceeded" and headers["retry-after"]
    for h in held:
        h[4].close()


async def test_upstream_refusing_the_connection_is_a_502(make_egressd, dns) -> None:
    from tests.harness import refused_port

    svc = await make_egressd(allow=["origin.test:*"])
    with refused_port(ORIGIN) as port:
        status, headers, _, _, w = await connect_via(svc, f"origin.test:{port}")
    w.close()
    assert status == 502 and headers["x-egress-reason"] == "upstream_unreachable"


async def test_unknown_name_is_resolve_failed(make_egressd, dns) -> None:
    svc = await make_egressd(allow=["nowhere.test"])
    status, headers, _, _, w = await connect_via(svc, "nowhere.test:443")
    w.close()
    assert status == 502 and headers["x-egress-reason"] == "resolve_failed"


async def test_shutdown_lets_open_tunnels_finish_then_records_them(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200
    writer.write(b"before")
    assert await reader.readexactly(6) == b"before"
    closing = asyncio.create_task(svc.close(grace_s=5))
    await asyncio.sleep(0.2)
    # new connections are refused at once; the open tunnel still works
    with pytest.raises(OSError):
        await asyncio.open_connection(*svc.proxy_address)
    writer.write(b"during")
    assert await reader.readexactly(6) == b"during"
    writer.close()
    await asyncio.wait_for(closing, 5)
    record = egress(svc)[-1]
    assert record["bytes_up"] == 12 and record["decision"] == "allow"
    assert svc.audit_records[-1]["event"] == "run.end"


async def test_shutdown_grace_ends_tunnels_that_do_not_finish(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200
    await asyncio.wait_for(svc.close(grace_s=0.2), 5)
    assert await asyncio.wait_for(reader.read(), 2) == b""
    writer.close()
    assert egress(svc)[-1]["decision"] == "allow"


async def _counting_origin(close_after_first: bool) -> tuple[asyncio.AbstractServer, list[int]]:
    """An origin that counts connections; optionally drops each one after its first response."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                if close_after_first:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, ORIGIN, 0)
    return server, connections


@pytest.mark.parametrize("stale", [False, True], ids=["kept", "kept-but-closed-by-the-origin"])
async def test_upstream_connection_is_kept_for_the_next_request(make_egressd, stale: bool) -> None:
    server, connections = await _counting_origin(close_after_first=stale)
    port = server.sockets[0].getsockname()[1]
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer = await open_proxy(svc)
    for i in range(3):
        writer.write(f"GET http://origin.test:{port}/{i} HTTP/1.1\r\n\r\n".encode())
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"ok")
        await asyncio.sleep(0.05)
    writer.close()
    server.close()
    assert len(connections) == (3 if stale else 1)
    assert [r["decision"] for r in egress(svc)] == ["allow"] * 3


async def test_a_large_response_to_a_client_that_stops_reading_holds_the_origin_back(make_egressd) -> None:
    """Backpressure through a Content-Length body: while the client reads nothing,
    egressd stops reading the origin (bounded memory), and once it reads, every
    byte arrives in order."""
    total_mib = 64
    chunk = bytes(range(256)) * 4096  # 1 MiB with a pattern, so order is checked too
    written: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {total_mib << 20}\r\n\r\n".encode())
            for _ in range(total_mib):
                writer.write(chunk)
                await writer.drain()
                written.append(1)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, ORIGIN, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        svc = await make_egressd(allow=["origin.test:*"])
        reader, writer = await open_proxy(svc)
        writer.transport.pause_reading()  # the client's own buffer stays small too
        writer.write(f"GET http://origin.test:{port}/big HTTP/1.1\r\n\r\n".encode())
        await asyncio.sleep(1.0)
        held_back = len(written)
        # Socket buffers on loopback take some MiB; far from the whole body.
        assert held_back < total_mib - 16, f"the origin wrote {held_back} of {total_mib} MiB to a silent client"
        writer.transport.resume_reading()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        body = await asyncio.wait_for(reader.readexactly(total_mib << 20), 30)
        assert body == chunk * total_mib
        writer.close()
        await wait_until(lambda: egress(svc))
        assert egress(svc)[-1]["bytes_down"] > total_mib << 20
    finally:
        server.close()


async def test_a_large_upload_arrives_whole(make_egressd, http_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer = await open_proxy(svc)
    body = os.urandom(900 * 1024)  # under the test origin's 1 MiB request limit, many reads all the same
    writer.write(
        f"POST http://origin.test:{http_origin.port}/upload HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    for i in range(0, len(body), 1 << 16):
        writer.write(body[i : i + (1 << 16)])
        await writer.drain()
    status, _, _ = await read_response(reader)
    writer.close()
    assert status == 200
    assert http_origin.requests[-1]["body"] == body


async def test_large_tunnel_transfers_to_slow_readers_arrive_whole(make_egressd) -> None:
    """Four tunnels at once, both ways, each reader stalling now and then, so egressd's writes
    often cannot all go out at once while other tunnels keep reading: every byte arrives, in
    order (sha256 compared), and each record counts them all."""
    total, tunnels = 16 << 20, 4
    block = hashlib.sha256(b"egressd").digest() * 32768  # 1 MiB, not a repeating short pattern
    payloads = [bytes([i]) * 64 + block[64:] for i in range(tunnels)]  # each tunnel its own bytes
    expected = [hashlib.sha256(p * (total // len(p))).digest() for p in payloads]
    uploaded: dict[int, bytes] = {}

    async def send(writer: asyncio.StreamWriter, payload: bytes) -> None:
        for _ in range(total // len(payload)):
            writer.write(payload)
            await writer.drain()

    async def receive(reader: asyncio.StreamReader) -> bytes:
        digest, got = hashlib.sha256(), 0
        while got < total:
            data = await asyncio.wait_for(reader.read(1 << 18), 10)
            assert data, f"the tunnel ended after {got} of {total} bytes"
            digest.update(data)
            got += len(data)
            if got % (4 << 20) < len(data):
                await asyncio.sleep(0.05)  # a stall: egressd's writes to us back up
        return digest.digest()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        which = (await reader.readexactly(1))[0]
        sending = asyncio.ensure_future(send(writer, payloads[which]))
        uploaded[which] = await receive(reader)
        await sending
        writer.close()

    async def one(svc, port: int, which: int) -> bytes:  # type: ignore[no-untyped-def]
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{port}")
        assert status == 200
        writer.write(bytes([which]))
        sending = asyncio.ensure_future(send(writer, payloads[which]))
        downloaded = await receive(reader)
        await asyncio.wait_for(sending, 30)
        writer.close()
        return downloaded

    server = await asyncio.start_server(handle, ORIGIN, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        svc = await make_egressd(allow=[f"origin.test:{port}"])
        downloaded = await asyncio.gather(*(one(svc, port, i) for i in range(tunnels)))
        assert downloaded == expected
        await wait_until(lambda: len(egress(svc)) == tunnels, 10)
        assert uploaded == dict(enumerate(expected))
        assert sorted((r["bytes_up"], r["bytes_down"]) for r in egress(svc)) == [(total + 1, total)] * tunnels
    finally:
        server.close()
