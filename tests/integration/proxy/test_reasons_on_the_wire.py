"""What each listener sends for a few reasons, byte for byte, as it did before the reason table.

The table itself (complete against DESIGN.md's list, one per code) is tested
in tests/unit/test_reasons.py; these run an egressd on loopback.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
from ipaddress import ip_address
from typing import Any

import pytest

from tests.conftest import Listener
from tests.fakes import hellos
from tests.harness import connect_via, egress, wait_until


async def _exchange(address: tuple[str, int], data: bytes, source: str = "127.0.0.1") -> bytes:
    """Send ``data`` and read until egressd closes."""
    reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def _record(svc: Any, count: int) -> dict[str, Any]:
    """The ``count``-th finished attempt's record (the last one)."""
    await wait_until(lambda: len(egress(svc)) >= count)
    return egress(svc)[count - 1]


def _http(status: str, code: str, body: str, *, auth: bool = False, retry: bool = False) -> bytes:
    """The refusal a listener sent before this table, its request id left as ``{id}``."""
    payload = body.encode() + b"\n"
    head = f"HTTP/1.1 {status}\r\nX-Egress-Decision: deny\r\nX-Egress-Reason: {code}\r\nX-Egress-Request-Id: {{id}}\r\n"
    if auth:
        head += 'Proxy-Authenticate: Basic realm="egressd"\r\n'
    if retry:
        head += "Retry-After: 1\r\n"
    head += f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    return head.encode() + payload


def _with_id(raw: bytes, record: dict[str, Any]) -> bytes:
    """``raw`` with the request id, which must be the record's, as ``{id}``."""
    found = re.search(rb"\r\nX-Egress-Request-Id: ([^\r]*)\r\n", raw)
    assert found is not None and found.group(1).decode() == record["id"], raw
    return raw.replace(found.group(1), b"{id}", 1)


async def test_the_forward_proxy_refuses_as_before(make_egressd, echo_origin: Listener) -> None:
    svc = await make_egressd(allow=["origin.test:*"], ask=False, max_connections_per_run=1)
    address = svc.proxy_address
    raw = await _exchange(address, b"CONNECT leak.test:443 HTTP/1.1\r\nHost: leak.test:443\r\n\r\n")
    record = await _record(svc, 1)
    assert _with_id(raw, record) == _http(
        "403 Forbidden", "not_allowlisted", "egressd: blocked leak.test:443 (not on the allowlist) in run default"
    )
    assert (record["decision"], record["reason"], record.get("detail")) == ("deny", "not_allowlisted", None)

    raw = await _exchange(address, b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    record = await _record(svc, 2)
    assert _with_id(raw, record) == _http("400 Bad Request", "bad_request", "egressd: blocked - (malformed request)")
    assert (record["decision"], record["reason"]) == ("deny", "bad_request") and record["detail"]

    # The run's one connection is a tunnel; the next is over its cap.
    held = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert held[0] == 200
    raw = await _exchange(address, f"CONNECT origin.test:{echo_origin.port} HTTP/1.1\r\n\r\n".encode())
    held[4].close()
    record = await _record(svc, 3)
    body = f"egressd: blocked origin.test:{echo_origin.port} (a limit was exceeded) in run default"
    assert _with_id(raw, record) == _http("429 Too Many Requests", "limit_exceeded", body, retry=True)
    assert (record["decision"], record["reason"]) == ("deny", "limit_exceeded")


async def test_the_forward_proxy_asks_for_credentials_as_before(make_egressd) -> None:
    svc = await make_egressd(require_auth=True)
    raw = await _exchange(svc.proxy_address, b"GET http://origin.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    record = await _record(svc, 1)
    expected = _http(
        "407 Proxy Authentication Required",
        "auth_required",
        "egressd: blocked origin.test:80 (run credentials missing or wrong)",
        auth=True,
    )
    assert _with_id(raw, record) == expected
    assert (record["decision"], record["reason"], record["run"]) == ("deny", "auth_required", None)


async def test_the_host_listener_refuses_as_before(make_egressd) -> None:
    svc = await make_egressd(transparent_http="127.0.0.1:0", require_auth=True)
    svc.runs.create(task="t", allow=[], sources=[ip_address("127.0.0.5")])  # no approver to ask
    address = svc.transparent_http.address
    raw = await _exchange(address, b"GET / HTTP/1.1\r\nHost: leak.test\r\n\r\n", source="127.0.0.5")
    record = await _record(svc, 1)
    body = f"egressd: blocked leak.test:80 (no approver attached) in run {record['run']}"
    expected = _http("403 Forbidden", "no_approver", body)
    assert _with_id(raw, record) == expected
    # No proxy to authenticate to: an unbound source gets a plain 403, not a 407.
    raw = await _exchange(address, b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n", source="127.0.0.6")
    record = await _record(svc, 2)
    body = "egressd: blocked origin.test:80 (run credentials missing or wrong)"
    expected = _http("403 Forbidden", "auth_required", body)
    assert _with_id(raw, record) == expected
    assert (record["decision"], record["reason"], record["run"]) == ("deny", "auth_required", None)


MALFORMED_HELLO = hellos.record(hellos.handshake(hellos.body(session_id=bytes(40))))  # legacy_session_id too long


@pytest.mark.parametrize(
    ("data", "answer", "reason"),
    [
        (hellos.client_hello("leak.test"), b"\x15\x03\x03\x00\x02\x02\x31", "not_allowlisted"),  # access_denied
        (hellos.client_hello(None), b"\x15\x03\x03\x00\x02\x02\x6d", "bad_request"),  # missing_extension
        (MALFORMED_HELLO, b"\x15\x03\x03\x00\x02\x02\x32", "bad_request"),  # decode_error
        (b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n", b"", "bad_request"),  # not TLS: nothing
    ],
    ids=["policy", "no server_name", "malformed", "not TLS"],
)
async def test_the_sni_listener_refuses_as_before(make_egressd, data: bytes, answer: bytes, reason: str) -> None:
    svc = await make_egressd(transparent_tls="127.0.0.1:0", allow=["origin.test"], ask=False)
    assert await _exchange(svc.transparent_tls.address, data) == answer
    record = await _record(svc, 1)
    assert (record["kind"], record["decision"], record["reason"]) == ("tls", "deny", reason)


async def test_a_tunnel_with_another_name_is_refused_as_before(make_egressd, echo_origin: Listener) -> None:
    svc = await make_egressd(allow=["origin.test:*", "other.test:*"], ask=False)
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200
    writer.write(hellos.client_hello("other.test"))
    assert await asyncio.wait_for(reader.read(), 5) == b"\x15\x03\x03\x00\x02\x02\x31"  # access_denied
    writer.close()
    record = await _record(svc, 1)
    assert (record["decision"], record["reason"], record["sni"]) == ("deny", "sni_mismatch", "other.test")


def _dns_exchange(address: tuple[str, int], packet: bytes, source: str) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((source, 0))
        sock.settimeout(3)
        sock.sendto(packet, address)
        return sock.recv(65535)


def _dns_query(labels: list[bytes]) -> bytes:
    """Id 0x1234, RD set, one IN A question for ``labels``."""
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)


@pytest.mark.parametrize(
    ("labels", "source", "flags", "reason"),
    [
        ([b"10", b"1", b"2", b"3"], "127.0.0.5", 0x8183, "ip_literal"),  # NXDOMAIN
        ([b"a\x00b", b"test"], "127.0.0.5", 0x8181, "bad_request"),  # FORMERR
        ([b"origin", b"test"], "127.0.0.6", 0x8185, "auth_required"),  # REFUSED
    ],
    ids=["NXDOMAIN", "FORMERR", "REFUSED"],
)
async def test_the_dns_server_refuses_as_before(
    make_egressd, labels: list[bytes], source: str, flags: int, reason: str
) -> None:
    svc = await make_egressd(dns_listen="127.0.0.1:0", dns_strict=True, require_auth=True)
    svc.runs.create(task="t", allow=[], sources=[ip_address("127.0.0.5")])
    packet = _dns_query(labels)
    reply = await asyncio.to_thread(_dns_exchange, svc.dns.address, packet, source)
    # The id, QR|RD|RA and the rcode, one question and no records; the question as asked.
    assert reply == struct.pack("!HHHHHH", 0x1234, flags, 1, 0, 0, 0) + packet[12:]
    record = await _record(svc, 1)
    assert (record["kind"], record["decision"], record["reason"]) == ("dns", "deny", reason)
