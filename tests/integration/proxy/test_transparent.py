"""The transparent listeners and the CONNECT SNI check, with real TLS and real HTTP.

Origins listen where a sandboxed program would really go: ORIGIN:443 (a
TLS origin with a certificate from a throwaway CA) and ORIGIN:80 (HTTP).
The transparent listeners sit on ephemeral ports and decide with the
destination ports 443 and 80, as they do behind the sandbox's DNS. Leak
detectors listen on LEAK:443 and :80; nothing may ever reach them. The
ports are fixed, the addresses are this test session's own (tests/harness.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import AsyncIterator
from ipaddress import ip_address
from pathlib import Path

import pytest
from aiohttp import web
from dnslib import DNSRecord

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest
from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.modes import host_destination
from egressd.vocabulary.reasons import Answer
from tests.fakes import hellos
from tests.fakes.dns import FakeDns
from tests.fakes.tls import BIG, Pki, TlsOrigin, make_pki
from tests.harness import (
    LEAK,
    ORIGIN,
    ORIGIN_RANGE,
    SANDBOX_FACING,
    SANDBOX_FACING_CLI,
    connect_via,
    egress,
    have,
    read_response,
    require,
    wait_until,
)

NAMES = ["origin.test", "sub.example.test", "example.test", "other.test"]
ALERT_ACCESS_DENIED = b"\x15\x03\x03\x00\x02\x02\x31"



async def curl(*args: str) -> tuple[int, bytes, bytes]:
    """curl as a user runs it (silent but for errors, 10 s at most): (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "10", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out, err

@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), NAMES)


@pytest.fixture
async def tls_origin(pki: Pki) -> AsyncIterator[TlsOrigin]:
    origin = await TlsOrigin(pki, ORIGIN, 443).start()
    yield origin
    await origin.close()


class Counter:
    def __init__(self) -> None:
        self.connections = 0
        self.servers: list[asyncio.Server] = []


@pytest.fixture
async def leak_web() -> AsyncIterator[Counter]:
    """Listeners on LEAK:443 and LEAK:80 that count every connection."""
    counter = Counter()

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counter.connections += 1
        writer.close()

    for port in (443, 80):
        counter.servers.append(await asyncio.start_server(count, LEAK, port, reuse_address=True))
    yield counter
    for server in counter.servers:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def http80() -> AsyncIterator[list[dict]]:
    """An HTTP origin on ORIGIN:80 recording each request's method, path and headers."""
    requests: list[dict] = []

    async def any_path(request: web.Request) -> web.Response:
        requests.append({"method": request.method, "path": request.path_qs, "headers": dict(request.headers)})
        return web.Response(
            text=f"hello from port 80: {request.method} {request.path_qs}", headers={"X-Egress-Reason": "forged"}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ORIGIN, 80, reuse_address=True).start()
    yield requests
    await runner.cleanup()


@pytest.fixture
async def transparent(make_egressd):
    async def make(**values):
        values.setdefault("transparent_tls", "127.0.0.1:0")
        values.setdefault("transparent_http", "127.0.0.1:0")
        return await make_egressd(**values)

    return make


async def tls_get(svc, sni: str | None, ctx: ssl.SSLContext, path: str = "/", source: str = "127.0.0.1"):
    host, port = svc.transparent_tls.address
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ctx, server_hostname=sni, local_addr=(source, 0), ssl_handshake_timeout=5
    )
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {sni}\r\n\r\n".encode())
        return await read_response(reader)
    finally:
        writer.close()


async def tls_refused(svc, sni: str | None, ctx: ssl.SSLContext, source: str = "127.0.0.1") -> str:
    """Connect and expect the handshake to fail; the OpenSSL reason, or 'closed'."""
    with pytest.raises((ssl.SSLError, ConnectionError)) as caught:
        await tls_get(svc, sni, ctx, source=source)
    return getattr(caught.value, "reason", None) or "closed"


async def raw_tls(svc, data: bytes, *, split: int | None = None) -> bytes:
    """Send ``data`` to the SNI listener (``split``-byte writes) and read until close or 5 bytes."""
    reader, writer = await asyncio.open_connection(*svc.transparent_tls.address)
    try:
        step = split or len(data)
        for i in range(0, len(data), step):
            writer.write(data[i : i + step])
            await writer.drain()
            if split:
                await asyncio.sleep(0)
        return await asyncio.wait_for(reader.read(5), 5)
    finally:
        writer.close()


def last(svc, kind: str) -> dict:
    return [r for r in egress(svc) if r["kind"] == kind][-1]


# --- the SNI listener ----------------------------------------------------------------------


async def test_python_tls_client_reaches_the_origin_end_to_end(
    transparent, tls_origin, pki, leak_web, dns: FakeDns
) -> None:
    svc = await transparent(allow=["origin.test"])
    status, _, body = await tls_get(svc, "origin.test", pki.client_context(), "/hello")
    assert status == 200 and body == b"hello from tls origin origin.test /hello"
    await wait_until(lambda: egress(svc))
    record = last(svc, "tls")
    assert (record["host"], record["port"], record["address"]) == ("origin.test", 443, ORIGIN)
    assert (record["decision"], record["rule"], record["run"]) == ("allow", "origin.test", "default")
    assert record["bytes_up"] > 200 and record["bytes_down"] > len(body)
    assert tls_origin.snis == ["origin.test"] and leak_web.connections == 0


@pytest.mark.parametrize("tls_max", ["1.2", "1.3"])
async def test_curl_through_the_sni_listener(
    transparent, tls_origin, pki, leak_web, dns: FakeDns, tls_max: str
) -> None:
    require(have("curl"), "curl is not installed")
    svc = await transparent(allow=["*.example.test"])
    host, port = svc.transparent_tls.address
    code, out, err = await curl(
        "--cacert", str(pki.ca_pem), "--tls-max", tls_max,
        "--connect-to", f"sub.example.test:443:{host}:{port}", "https://sub.example.test/via-curl?x=1",
    )
    assert code == 0, err
    assert out == b"hello from tls origin sub.example.test /via-curl?x=1"
    await wait_until(lambda: egress(svc))
    assert (last(svc, "tls")["host"], last(svc, "tls")["rule"]) == ("sub.example.test", "*.example.test")
    assert leak_web.connections == 0


async def test_a_large_download_is_spliced_whole(transparent, tls_origin, pki, dns: FakeDns) -> None:
    svc = await transparent(allow=["origin.test"])
    status, _, body = await tls_get(svc, "origin.test", pki.client_context(), "/big")
    assert status == 200 and body == b"x" * BIG
    await wait_until(lambda: egress(svc))
    assert last(svc, "tls")["bytes_down"] > BIG


async def test_a_name_not_allowed_gets_an_alert_and_is_never_resolved(
    transparent, tls_origin, pki, leak_web, dns: FakeDns
) -> None:
    svc = await transparent(ask=False)
    assert await tls_refused(svc, "leak.test", pki.client_context()) == "TLSV1_ALERT_ACCESS_DENIED"
    await wait_until(lambda: egress(svc))
    record = last(svc, "tls")
    assert (record["host"], record["port"], record["decision"], record["reason"]) == (
        "leak.test",
        443,
        "deny",
        "not_allowlisted",
    )
    assert not dns.asked("leak.test") and leak_web.connections == 0 and tls_origin.handshakes == 0


async def test_a_name_resolving_to_a_private_address_is_refused(transparent, pki, leak_web, dns: FakeDns) -> None:
    svc = await transparent(allow=["leak.test"])
    await tls_refused(svc, "leak.test", pki.client_context())
    await wait_until(lambda: egress(svc))
    assert last(svc, "tls")["reason"] == "private_address" and leak_web.connections == 0


async def test_a_hello_without_sni_is_closed_and_recorded(transparent, tls_origin, dns: FakeDns) -> None:
    svc = await transparent(allow=["origin.test"])
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    reason = await tls_refused(svc, None, ctx)
    assert reason in ("TLSV1_ALERT_MISSING_EXTENSION", "TLSV13_ALERT_MISSING_EXTENSION")
    await wait_until(lambda: egress(svc))
    record = last(svc, "tls")
    assert (record["host"], record["decision"], record["reason"]) == (None, "deny", "bad_request")
    assert "server_name" in record["detail"] and record["address"] is None and tls_origin.snis == []


async def test_a_hello_sent_byte_by_byte_is_decided(transparent, tls_origin, dns: FakeDns) -> None:
    svc = await transparent(allow=["origin.test"])
    answer = await raw_tls(svc, hellos.python_hello("origin.test"), split=1)
    assert answer[:3] == b"\x16\x03\x03"  # the origin's ServerHello came back
    await wait_until(lambda: egress(svc))
    assert tls_origin.snis == ["origin.test"] and last(svc, "tls")["decision"] == "allow"


async def test_a_hello_cut_into_one_byte_records_is_decided(transparent, tls_origin, dns: FakeDns) -> None:
    svc = await transparent(allow=["origin.test"])
    first_flight = hellos.python_hello("origin.test")
    message = first_flight[5:]
    fragmented = hellos.records(message, [1] * 40 + [7] * 10)
    answer = await raw_tls(svc, fragmented, split=3)
    assert answer[:1] in (b"\x16", b"\x15")  # OpenSSL answers a fragmented hello (or alerts): it got it
    assert tls_origin.snis == ["origin.test"]


@pytest.mark.parametrize(
    ("data", "answer", "detail"),
    [
        (b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n", b"", "not a TLS ClientHello"),
        (
            hellos.record(hellos.handshake(hellos.body(session_id=bytes(40)))),
            b"\x15\x03\x03\x00\x02",
            "legacy_session_id",
        ),
        (hellos.client_hello("origin.test")[:30], b"", "closed inside"),
    ],
    ids=["plain HTTP", "malformed hello", "closed mid-hello"],
)
async def test_what_is_not_a_clienthello_is_closed_and_recorded(
    transparent, tls_origin, leak_web, dns: FakeDns, data, answer, detail
) -> None:
    svc = await transparent(allow=["origin.test"])
    reader, writer = await asyncio.open_connection(*svc.transparent_tls.address)
    writer.write(data)
    if detail == "closed inside":
        writer.write_eof()
    got = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert got[:5] == answer
    await wait_until(lambda: egress(svc))
    record = last(svc, "tls")
    assert (record["decision"], record["reason"]) == ("deny", "bad_request") and detail in record["detail"]
    assert record["address"] is None and tls_origin.snis == [] and leak_web.connections == 0


async def test_a_connection_closed_before_any_byte_is_not_an_attempt(transparent, dns: FakeDns) -> None:
    svc = await transparent()
    _, writer = await asyncio.open_connection(*svc.transparent_tls.address)
    writer.close()
    await asyncio.sleep(0.1)
    assert [r for r in egress(svc) if r["kind"] == "tls"] == []


async def test_a_slow_hello_is_cut_off(transparent, dns: FakeDns) -> None:
    svc = await transparent(head_timeout_s=0.2)
    reader, writer = await asyncio.open_connection(*svc.transparent_tls.address)
    writer.write(hellos.client_hello("origin.test")[:10])
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await wait_until(lambda: egress(svc))
    assert last(svc, "tls")["reason"] == "limit_exceeded"


class HeldApprover:
    """Holds every request until ``release`` is set, then allows it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.requests: list[ApprovalRequest] = []

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        self.requests.append(request)
        await self.release.wait()
        return ApprovalOutcome(Answer.ALLOW, approval_id="ap-1", channel="test", by="tester", waited_s=0.25)


async def test_a_transparent_connection_waits_for_its_approval(transparent, tls_origin, pki, dns: FakeDns) -> None:
    approver = HeldApprover()
    svc = await transparent(approver=approver)
    svc.default_run.command = "go build ./..."
    fetch = asyncio.create_task(tls_get(svc, "origin.test", pki.client_context(), "/held"))
    await wait_until(lambda: approver.requests)
    request = approver.requests[0]
    assert (request.host, request.port, request.command) == ("origin.test", 443, "go build ./...")
    await asyncio.sleep(0.2)
    assert not fetch.done() and tls_origin.handshakes == 0 and not dns.asked("origin.test")
    approver.release.set()
    status, _, body = await asyncio.wait_for(fetch, 10)
    assert status == 200 and body == b"hello from tls origin origin.test /held"
    await wait_until(lambda: egress(svc))
    record = last(svc, "tls")
    assert (record["decision"], record["rule"], record["command"]) == ("allow", "approved", "go build ./...")
    assert record["approval"] == {"id": "ap-1", "channel": "test", "by": "tester", "waited_s": 0.25}
    # The approval holds for the rest of the run: the next connection is not asked about.
    await tls_get(svc, "origin.test", pki.client_context())
    assert len(approver.requests) == 1


async def test_sources_bound_to_a_run_are_attributed_and_others_refused(
    transparent, tls_origin, pki, http80, dns: FakeDns
) -> None:
    svc = await transparent(require_auth=True)
    run = svc.runs.create(task="t", allow=[], sources=[ip_address("127.0.0.5")])
    run.approve("origin.test", 443)
    status, _, _ = await tls_get(svc, "origin.test", pki.client_context(), source="127.0.0.5")
    assert status == 200
    assert (
        await tls_refused(svc, "origin.test", pki.client_context(), source="127.0.0.6") == "TLSV1_ALERT_ACCESS_DENIED"
    )
    await wait_until(lambda: len(egress(svc)) == 2)
    bound, unbound = sorted(egress(svc), key=lambda r: r["decision"])
    assert (bound["run"], bound["decision"]) == (run.id, "allow")
    assert (unbound["run"], unbound["host"], unbound["reason"]) == (None, "origin.test", "auth_required")
    # The Host listener refuses the unbound source too, with a plain 403 (no proxy to authenticate to).
    reader, writer = await asyncio.open_connection(*svc.transparent_http.address, local_addr=("127.0.0.6", 0))
    writer.write(b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    status, headers, _ = await read_response(reader)
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "auth_required" and http80 == []


async def test_the_whole_way_a_sandboxed_tool_goes(make_egressd, tls_origin, pki, dns: FakeDns) -> None:
    """Resolve through egressd's DNS, connect to the answer on port 443, get the origin."""
    svc = await make_egressd(
        allow=["origin.test"], transparent_tls=f"{SANDBOX_FACING}:443", dns_listen=f"{SANDBOX_FACING}:0"
    )
    data = await asyncio.to_thread(DNSRecord.question("origin.test").send, *svc.dns.address, timeout=3)
    [answer] = [str(rr.rdata) for rr in DNSRecord.parse(data).rr]
    assert answer == SANDBOX_FACING
    reader, writer = await asyncio.open_connection(answer, 443, ssl=pki.client_context(), server_hostname="origin.test")
    writer.write(b"GET /resolved HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    status, _, body = await read_response(reader)
    writer.close()
    assert body == b"hello from tls origin origin.test /resolved"
    await wait_until(lambda: len(egress(svc)) == 2)
    assert [r["kind"] for r in egress(svc)] == ["dns", "tls"]


async def test_shutdown_ends_open_transparent_tunnels_and_records_them(
    transparent, tls_origin, pki, dns: FakeDns
) -> None:
    svc = await transparent(allow=["origin.test"])
    host, port = svc.transparent_tls.address
    reader, writer = await asyncio.open_connection(host, port, ssl=pki.client_context(), server_hostname="origin.test")
    writer.write(b"GET /open HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    await read_response(reader)  # the tunnel is up and stays open (keep-alive)
    await svc.close(grace_s=0.1)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    record = last(svc, "tls")
    assert record["decision"] == "allow" and record["bytes_down"] > 0


# --- the Host listener ------------------------------------------------------------------------


async def http_exchange(svc, raw: bytes, source: str = "127.0.0.1"):
    reader, writer = await asyncio.open_connection(*svc.transparent_http.address, local_addr=(source, 0))
    writer.write(raw)
    try:
        return await read_response(reader)
    finally:
        writer.close()


async def test_curl_through_the_host_listener(transparent, http80, leak_web, dns: FakeDns) -> None:
    require(have("curl"), "curl is not installed")
    svc = await transparent(allow=["origin.test"])
    host, port = svc.transparent_http.address
    code, out, err = await curl("-i", "--connect-to", f"origin.test:80:{host}:{port}", "http://origin.test/path?q=1")
    assert code == 0, err
    assert out.endswith(b"hello from port 80: GET /path?q=1") and b"X-Egress-Reason" not in out
    assert http80[0]["headers"]["Host"] == "origin.test"
    await wait_until(lambda: egress(svc))
    record = last(svc, "http")
    assert (record["host"], record["port"], record["address"], record["status"]) == ("origin.test", 80, ORIGIN, 200)
    assert leak_web.connections == 0


async def test_every_request_on_a_connection_is_decided(transparent, http80, leak_web, dns: FakeDns) -> None:
    svc = await transparent(allow=["origin.test"], ask=False)
    reader, writer = await asyncio.open_connection(*svc.transparent_http.address)
    writer.write(b"GET /one HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    writer.write(b"GET /two HTTP/1.1\r\nHost: leak.test\r\n\r\n")
    status, headers, body = await read_response(reader)
    writer.close()
    assert status == 403 and headers["x-egress-reason"] == "not_allowlisted"
    assert body == b"egressd: blocked leak.test:80 (not on the allowlist) in run default\n"
    assert [r["path"] for r in http80] == ["/one"] and leak_web.connections == 0 and not dns.asked("leak.test")


async def test_a_plain_http_request_waits_for_its_approval(transparent, http80, dns: FakeDns) -> None:
    approver = HeldApprover()
    svc = await transparent(approver=approver)
    fetch = asyncio.create_task(http_exchange(svc, b"GET /held HTTP/1.1\r\nHost: origin.test\r\n\r\n"))
    await wait_until(lambda: approver.requests)
    assert (approver.requests[0].host, approver.requests[0].port) == ("origin.test", 80)
    await asyncio.sleep(0.1)
    assert not fetch.done() and http80 == []
    approver.release.set()
    status, _, body = await asyncio.wait_for(fetch, 10)
    assert status == 200 and body == b"hello from port 80: GET /held"
    await wait_until(lambda: egress(svc))
    assert last(svc, "http")["approval"]["by"] == "tester"


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: origin.test:8080\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: origin.test\r\nHost: leak.test\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: origin.test@leak.test\r\n\r\n", 400),
        (b"CONNECT origin.test:443 HTTP/1.1\r\nHost: origin.test:443\r\n\r\n", 400),
        (b"OPTIONS * HTTP/1.1\r\nHost: origin.test\r\n\r\n", 400),
    ],
    ids=["another port", "no Host", "two Hosts", "userinfo", "CONNECT", "asterisk-form"],
)
async def test_requests_that_name_no_port_80_destination_are_refused(
    transparent, http80, leak_web, dns: FakeDns, raw, status
) -> None:
    svc = await transparent(allow=["origin.test:*"])
    got, headers, _ = await http_exchange(svc, raw)
    assert got == status and headers["x-egress-reason"] == "bad_request"
    assert http80 == [] and leak_web.connections == 0


async def test_absolute_form_is_decided_by_its_uri_not_its_host(transparent, http80, leak_web, dns: FakeDns) -> None:
    svc = await transparent(allow=["origin.test"], ask=False)
    status, _, _ = await http_exchange(svc, b"GET http://origin.test/abs HTTP/1.1\r\nHost: leak.test\r\n\r\n")
    assert status == 200 and http80[0]["headers"]["Host"] == "origin.test" and leak_web.connections == 0


def _head(target: str, *hosts: str, method: str = "GET") -> RequestHead:
    return RequestHead(method, target, "HTTP/1.1", [("Host", h) for h in hosts])


def test_host_destination_takes_the_host_header_and_the_listener_port() -> None:
    dest = host_destination(_head("/a?b=c", "Example.TEST"), 80)
    assert (dest.scheme, dest.host, dest.port, dest.path) == ("http", "Example.TEST", 80, "/a?b=c")
    assert host_destination(_head("/", "example.test:80"), 80).port == 80
    assert host_destination(_head("/", "[2001:db8::1]"), 80).host == "2001:db8::1"


@pytest.mark.parametrize("host", ["a.test:81", "a.test/x", "a.test?x", "a.test#x", "a b", "", "a.test:", "a.test:http"])
def test_host_destination_refuses_hosts_that_are_not_a_port_80_authority(host: str) -> None:
    with pytest.raises(HttpError):
        host_destination(_head("/", host), 80)


# --- the CONNECT tunnel's SNI check -------------------------------------------------------


async def test_connect_with_the_same_sni_is_relayed(make_egressd, tls_origin, pki, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test"])
    status, _, _, reader, writer = await connect_via(svc, "origin.test:443")
    assert status == 200
    await writer.start_tls(pki.client_context(), server_hostname="ORIGIN.test")  # case does not matter
    writer.write(b"GET /tunnelled HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    _, _, body = await read_response(reader)
    writer.close()
    assert body == b"hello from tls origin ORIGIN.test /tunnelled"
    await wait_until(lambda: egress(svc))
    assert last(svc, "connect")["decision"] == "allow"


async def test_curl_through_the_proxy_passes_the_sni_check(make_egressd, tls_origin, pki, dns: FakeDns) -> None:
    require(have("curl"), "curl is not installed")
    svc = await make_egressd(allow=["origin.test"])
    host, port = svc.proxy_address
    code, out, err = await curl("--cacert", str(pki.ca_pem), "-x", f"http://{host}:{port}", "https://origin.test/proxied")
    assert code == 0, err
    assert out == b"hello from tls origin origin.test /proxied"


async def test_connect_carrying_another_sni_is_closed_as_sni_mismatch(
    make_egressd, tls_origin, pki, dns: FakeDns
) -> None:
    svc = await make_egressd(allow=["origin.test"])
    status, _, _, reader, writer = await connect_via(svc, "origin.test:443")
    assert status == 200
    with pytest.raises((ssl.SSLError, ConnectionError)) as caught:
        await writer.start_tls(pki.client_context(), server_hostname="other.test", ssl_handshake_timeout=5)
    assert getattr(caught.value, "reason", "") == "TLSV1_ALERT_ACCESS_DENIED"
    writer.close()
    await wait_until(lambda: egress(svc))
    record = last(svc, "connect")
    assert (record["host"], record["decision"], record["reason"], record["sni"]) == (
        "origin.test",
        "deny",
        "sni_mismatch",
        "other.test",
    )
    assert tls_origin.snis == [] and tls_origin.handshakes == 0  # the origin never saw a byte of it
    assert svc.path.recorder.metrics.decisions[("deny", "sni_mismatch")] == 1
    assert svc.path.recorder.metrics.decisions[("allow", "")] == 0


async def test_a_mismatched_hello_sent_byte_by_byte_is_caught(make_egressd, tls_origin, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test"])
    status, _, _, reader, writer = await connect_via(svc, "origin.test:443")
    assert status == 200
    hello = hellos.records(hellos.handshake(hellos.body("other.test", padding=300)), [1] * 64)
    for i in range(len(hello)):
        writer.write(hello[i : i + 1])
        await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == ALERT_ACCESS_DENIED
    writer.close()
    await wait_until(lambda: egress(svc))
    assert last(svc, "connect")["reason"] == "sni_mismatch" and tls_origin.snis == []


async def test_a_hello_sent_with_the_connect_request_is_checked_too(make_egressd, tls_origin, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test"])
    reader, writer = await asyncio.open_connection(*svc.proxy_address)
    writer.write(b"CONNECT origin.test:443 HTTP/1.1\r\n\r\n" + hellos.client_hello("evil.test"))
    assert (await read_response(reader))[0] == 200
    assert await asyncio.wait_for(reader.read(), 5) == ALERT_ACCESS_DENIED
    writer.close()
    await wait_until(lambda: egress(svc))
    assert last(svc, "connect")["sni"] == "evil.test"


async def test_connect_without_sni_is_relayed(make_egressd, tls_origin, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test"])
    _, _, _, reader, writer = await connect_via(svc, "origin.test:443")
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    await writer.start_tls(ctx, server_hostname=None)
    writer.write(b"GET /nosni HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    _, _, body = await read_response(reader)
    writer.close()
    assert body == b"hello from tls origin None /nosni"


async def test_a_server_that_speaks_first_is_not_held_up(make_egressd, dns: FakeDns) -> None:
    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        line = await reader.readline()
        writer.write(b"echo " + line)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(banner, ORIGIN, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        svc = await make_egressd(allow=[f"origin.test:{port}"])
        status, _, _, reader, writer = await connect_via(svc, f"origin.test:{port}")
        assert status == 200
        assert await asyncio.wait_for(reader.readline(), 2) == b"SSH-2.0-OpenSSH_9.2\r\n"
        # Client bytes that look like TLS after the server spoke are not inspected.
        writer.write(b"\x16\x03\x01 not a hello\n")
        assert await asyncio.wait_for(reader.readline(), 2) == b"echo \x16\x03\x01 not a hello\n"
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _banner_then_echo_origin(delay_s: float) -> AsyncIterator[tuple[int, list[bytes]]]:
    """An origin that speaks first after ``delay_s``, then echoes what it reads; yields (port, what it read)."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay_s)
        writer.write(b"BANNER\r\n")
        await writer.drain()
        while data := await reader.read(4096):
            seen.append(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, ORIGIN, 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


async def _send_a_partial_hello(make_egressd, port: int):  # type: ignore[no-untyped-def]
    """A CONNECT tunnel whose client sent the start of a ClientHello: (service, reader, writer, the bytes)."""
    svc = await make_egressd(allow=[f"origin.test:{port}"])
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{port}")
    assert status == 200
    partial = hellos.client_hello("origin.test")[:20]  # a TLS record header and a little: incomplete
    writer.write(partial)
    return svc, reader, writer, partial


async def test_a_partial_hello_is_relayed_once_the_server_speaks(make_egressd, dns: FakeDns) -> None:
    """Held client bytes are not lost: the upstream speaking ends the check and they go through."""
    async with _banner_then_echo_origin(0.3) as (port, seen):
        svc, reader, writer, partial = await _send_a_partial_hello(make_egressd, port)
        assert await asyncio.wait_for(reader.readline(), 2) == b"BANNER\r\n"
        assert await asyncio.wait_for(reader.readexactly(len(partial)), 2) == partial
        assert b"".join(seen) == partial
        writer.close()
        await wait_until(lambda: egress(svc))
        assert egress(svc)[-1]["decision"] == "allow"


async def test_a_partial_hello_then_a_half_close_is_relayed(make_egressd, dns: FakeDns) -> None:
    async with _banner_then_echo_origin(0.5) as (port, seen):
        _, reader, writer, partial = await _send_a_partial_hello(make_egressd, port)
        writer.write_eof()  # the client is done: what it sent goes on, and so does the EOF
        assert await asyncio.wait_for(reader.read(), 3) == b"BANNER\r\n" + partial
        assert b"".join(seen) == partial
        writer.close()


async def test_a_client_that_speaks_another_protocol_is_relayed(make_egressd, echo_origin, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    _, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    payload = b"\x17not tls at all" + os.urandom(1000)
    writer.write(payload)
    assert await asyncio.wait_for(reader.readexactly(len(payload)), 5) == payload
    writer.close()


async def test_a_malformed_hello_in_a_tunnel_is_closed_as_bad_request(make_egressd, echo_origin, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    _, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    writer.write(hellos.record(hellos.handshake(hellos.body(extra=[hellos.sni_extension(b"x.test")]))))
    assert await asyncio.wait_for(reader.read(), 5) == b"\x15\x03\x03\x00\x02\x02\x32"
    writer.close()
    await wait_until(lambda: egress(svc))
    record = last(svc, "connect")
    assert record["reason"] == "bad_request" and "twice" in record["detail"]


# --- the command line, end to end ----------------------------------------------------------------


async def test_egressd_serve_with_dns_and_transparent_listeners(
    tmp_path, tls_origin, pki, http80, dns: FakeDns
) -> None:
    """dig asks egressd's DNS, curl connects where it answered; the audit log has both."""
    require(have("curl") and have("dig"), "curl and dig are needed")
    import json
    import signal
    import sys

    from tests.harness import aserve_ports

    egressd = str(Path(sys.executable).with_name("egressd"))
    sandbox_facing = SANDBOX_FACING_CLI
    audit = tmp_path / "audit.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(tmp_path)}
    proc = await asyncio.create_subprocess_exec(
        egressd,
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--control",
        "127.0.0.1:0",
        "--upstream-dns",
        f"127.0.0.1:{dns.address[1]}",
        "--allow-private",
        ORIGIN_RANGE,
        "--audit-log",
        str(audit),
        "--allow",
        "origin.test",
        "--no-ask",
        "--dns-listen",
        f"{sandbox_facing}:0",
        "--transparent-tls",
        f"{sandbox_facing}:443",
        "--transparent-http",
        f"{sandbox_facing}:80",
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        dns_port = (await aserve_ports(proc.stderr))["dns"]  # the port it bound, read from its report

        async def run(*cmd: str) -> str:
            child = await asyncio.create_subprocess_exec(
                *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            out, err = await child.communicate()
            assert child.returncode == 0, err
            return out.decode()

        answer = (
            await run("dig", f"@{sandbox_facing}", "-p", str(dns_port), "+short", "+tries=1", "origin.test")
        ).strip()
        assert answer == sandbox_facing
        assert (
            await run("dig", f"@{sandbox_facing}", "-p", str(dns_port), "+short", "+tcp", "TXT", "origin.test")
        ).strip() == ""
        body = await run(
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            str(pki.ca_pem),
            "--resolve",
            f"origin.test:443:{answer}",
            "https://origin.test/cli",
        )
        assert body == "hello from tls origin origin.test /cli"
        body = await run(
            "curl", "-sS", "--max-time", "10", "--resolve", f"origin.test:80:{answer}", "http://origin.test/plain"
        )
        assert body == "hello from port 80: GET /plain"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
    records = [json.loads(x) for x in audit.read_text().splitlines()]
    seen = [(r["kind"], r["host"], r.get("qtype"), r["decision"]) for r in records if r["event"] == "egress"]
    assert seen == [
        ("dns", "origin.test", "A", "allow"),
        ("dns", "origin.test", "TXT", "deny"),
        ("tls", "origin.test", None, "allow"),
        ("http", "origin.test", None, "allow"),
    ]


async def test_a_tool_that_ignores_proxy_settings_in_a_sandbox_still_meets_the_policy(
    tmp_path, workdir, tls_origin, pki, http80, leak_web, dns: FakeDns
) -> None:
    """`egressd run`: curl --noproxy resolves through egressd's DNS and lands on the transparent listeners."""
    require(os.geteuid() == 0, "egressd run needs root")
    for tool in ("bwrap", "nft", "ip", "nsenter", "curl", "getent"):
        require(have(tool), f"{tool} is not installed")
    import json
    import shutil
    import sys

    shutil.copy(pki.ca_pem, workdir / "ca.pem")
    os.chmod(workdir / "ca.pem", 0o644)
    script = (
        "getent ahostsv4 origin.test | head -1; "
        "curl --noproxy '*' -sS -m 10 --cacert ca.pem https://origin.test/sandboxed; echo; "
        "curl --noproxy '*' -sS -m 10 http://origin.test/plain; echo; "
        "curl --noproxy '*' -sS -m 10 --cacert ca.pem https://leak.test/ || echo tls-refused; "
        "curl --noproxy '*' -sS -m 10 -o /dev/null -w '%{http_code}\\n' http://leak.test/"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSD_")} | {"XDG_STATE_HOME": str(tmp_path)}
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("egressd")),
        "run",
        "--upstream-dns",
        f"127.0.0.1:{dns.address[1]}",
        "--allow-private",
        ORIGIN_RANGE,
        "--audit-log",
        str(tmp_path / "audit.jsonl"),
        "--allow",
        "origin.test",
        "--no-ask",
        "--workdir",
        str(workdir),
        "--",
        "sh",
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err
    lines = out.decode().splitlines()
    resolved = lines[0].split()[0]
    assert lines[1:] == [
        "hello from tls origin origin.test /sandboxed",
        "hello from port 80: GET /plain",
        "tls-refused",
        "403",
    ]
    records = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    egress_records = [r for r in records if r["event"] == "egress"]
    run_ids = {r["run"] for r in egress_records}
    assert len(run_ids) == 1 and None not in run_ids  # all attributed to the sandbox's run by source address
    seen = {(r["kind"], r["host"], r["decision"], r["reason"]) for r in egress_records if r["kind"] != "dns"}
    assert seen == {
        ("tls", "origin.test", "allow", None),
        ("http", "origin.test", "allow", None),
        ("tls", "leak.test", "deny", "not_allowlisted"),
        ("http", "leak.test", "deny", "not_allowlisted"),
    }
    dns_answers = {r["answer"] for r in egress_records if r["kind"] == "dns" and r["qtype"] == "A"}
    assert dns_answers == {resolved}
    assert leak_web.connections == 0 and not dns.asked("leak.test")


# --- learn mode (--learn) on the transparent listeners ----------------------------------------


async def test_learn_mode_lets_an_unlisted_name_through_the_sni_listener_and_records_it(
    transparent, tls_origin, pki, leak_web, dns: FakeDns
) -> None:
    svc = await transparent(learn=True, ask=False, deny=["other.test"])
    status, _, body = await tls_get(svc, "origin.test", pki.client_context(), "/learnt")
    assert status == 200 and body == b"hello from tls origin origin.test /learnt"
    await wait_until(lambda: egress(svc))
    record = last(svc, "tls")
    assert (record["decision"], record["rule"], record["learned"]) == ("allow", None, "not_allowlisted")
    # A deny entry and a private address are still refused, and nothing reaches LEAK.
    assert await tls_refused(svc, "other.test", pki.client_context()) == "TLSV1_ALERT_ACCESS_DENIED"
    await tls_refused(svc, "leak.test", pki.client_context())
    await wait_until(lambda: len([r for r in egress(svc) if r["kind"] == "tls"]) == 3)
    refused = [(r["host"], r["reason"]) for r in egress(svc) if r["kind"] == "tls"][1:]
    assert refused == [("other.test", "denylisted"), ("leak.test", "private_address")]
    assert leak_web.connections == 0 and tls_origin.snis == ["origin.test"] and not dns.asked("other.test")


async def test_learn_mode_lets_an_unlisted_host_through_the_host_listener_and_still_refuses_a_private_one(
    transparent, http80, leak_web, dns: FakeDns
) -> None:
    svc = await transparent(learn=True, ask=False)
    reader, writer = await asyncio.open_connection(*svc.transparent_http.address)
    writer.write(b"GET /one HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    writer.write(b"GET /two HTTP/1.1\r\nHost: leak.test\r\n\r\n")
    status, headers, _ = await read_response(reader)
    writer.close()
    assert (status, headers["x-egress-reason"]) == (403, "private_address")
    assert [r["path"] for r in http80] == ["/one"] and leak_web.connections == 0
    await wait_until(lambda: len(egress(svc)) == 2)
    assert [(r["decision"], r["learned"]) for r in egress(svc)] == [
        ("allow", "not_allowlisted"),
        ("deny", "not_allowlisted"),
    ]
