"""egressd's own addresses: exactly its listening (address, port) pairs.

A destination that is egressd itself is refused even inside
``allow_private`` (reason ``private_address``, and a body that says it is
egressd itself), so a sandbox cannot make egressd dial its own proxy (a loop)
or its control API. "Own" is no wider than that: another service on
127.0.0.1 is an ordinary loopback destination, reachable with
``--allow-private 127.0.0.0/8``. A listener on 0.0.0.0 or :: stands for
every address of the host on its port.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from egressd.names.addresses import IPAddress
from egressd.proxy.core.addresses import OwnEndpoints, is_own
from egressd.proxy.core.policy import parse_entry
from egressd.proxy.core.responses import OWN_ENDPOINT_MESSAGE
from egressd.proxy.net.dialer import bound_locally
from tests.conftest import MakeEgressd
from tests.fakes.dns import FakeDns
from tests.harness import egress, read_response


def _never_local(address: IPAddress) -> bool:
    raise AssertionError(f"asked whether {address} is local")


def _own(*endpoints: tuple[str, int]) -> OwnEndpoints:
    return OwnEndpoints.of((ip_address(host), port) for host, port in endpoints)


# --- the pure rule ----------------------------------------------------------------------------

PROXY = _own(("127.0.0.1", 3128), ("127.0.0.1", 3129), ("fd00::2", 53))

OWN_CASES = [
    ("127.0.0.1", 3128, True),
    ("127.0.0.1", 3129, True),
    ("::ffff:127.0.0.1", 3128, True),  # a mapped address reaches the IPv4 one
    ("64:ff9b::7f00:1", 3128, True),  # and so does NAT64's
    ("fd00::2", 53, True),
    ("127.0.0.1", 8000, False),  # another service on the same address
    ("127.0.0.2", 3128, False),  # the same port on another address
    ("::1", 3128, False),
    ("fd00::2", 3128, False),
]


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    OWN_CASES,
    ids=[f"{h}:{p} is {'' if e else 'not '}egressd" for h, p, e in OWN_CASES],
)
def test_own_means_a_listening_address_and_port(host: str, port: int, expected: bool) -> None:
    assert is_own(ip_address(host), port, PROXY, _never_local) is expected


WILDCARD = _own(("0.0.0.0", 3128), ("::", 53))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "127.255.0.9", "0.0.0.0", "::1", "::", "::ffff:127.0.0.5"])
def test_a_wildcard_listener_covers_every_loopback_address_on_its_port(host: str) -> None:
    for port in (3128, 53):
        assert is_own(ip_address(host), port, WILDCARD, _never_local)
    assert not is_own(ip_address(host), 8000, WILDCARD, _never_local)


def test_a_wildcard_listener_covers_every_local_interface_address_on_its_port() -> None:
    local = {IPv4Address("10.9.8.7"), IPv6Address("fd00::7")}
    asked: list[IPAddress] = []

    def is_local(address: IPAddress) -> bool:
        asked.append(address)
        return address in local

    assert is_own(IPv4Address("10.9.8.7"), 3128, WILDCARD, is_local)
    assert is_own(IPv6Address("::ffff:10.9.8.7"), 53, WILDCARD, is_local)
    assert is_own(IPv6Address("fd00::7"), 53, WILDCARD, is_local)
    assert not is_own(IPv4Address("10.9.8.6"), 3128, WILDCARD, is_local)
    asked.clear()
    assert not is_own(IPv4Address("10.9.8.7"), 8000, WILDCARD, is_local)
    assert asked == []  # another port: nothing to ask


@given(st.integers(0, 2**32 - 1), st.integers(1, 65535), st.integers(1, 65535))
def test_a_listener_makes_only_its_own_port_of_its_address_own(value: int, port: int, other: int) -> None:
    address = IPv4Address(value)
    own = OwnEndpoints.of([(address, port)])
    assert is_own(address, port, own, _never_local)
    assert is_own(IPv6Address(f"::ffff:{address}"), port, own, _never_local)
    if other != port:
        assert not is_own(address, other, own, _never_local)


def test_the_local_probe_knows_loopback_and_refuses_what_is_not_here() -> None:
    assert bound_locally(IPv4Address("127.0.0.9"))
    assert not bound_locally(IPv4Address("192.0.2.1"))  # TEST-NET-1: bound nowhere (only bind() is tried)


# --- through the proxy ------------------------------------------------------------------------


@pytest.fixture
async def loopback_origin() -> AsyncIterator[int]:
    """An HTTP origin on 127.0.0.1 (the address egressd's listeners use too), on a port from the kernel."""

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello from 127.0.0.1")

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield runner.addresses[0][1]
    await runner.cleanup()


async def _get(host: str, port: int, target: str, creds: str | None = None) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    auth = f"Proxy-Authorization: Basic {creds}\r\n" if creds else ""
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
    await writer.drain()
    try:
        return await read_response(reader)
    finally:
        writer.close()


def _assert_egressd_itself(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 403, body
    assert headers["x-egress-decision"] == "deny" and headers["x-egress-reason"] == "private_address"
    assert b"egressd itself" in body and OWN_ENDPOINT_MESSAGE.encode() in body, body


async def test_an_origin_on_egressds_loopback_address_is_reached_when_allowed(
    make_egressd: MakeEgressd, dns: FakeDns, loopback_origin: int
) -> None:
    dns.set("beside.test", ["127.0.0.1"])
    svc = await make_egressd(allow=["127.0.0.1:*", "beside.test:*"], allow_private=["127.0.0.0/8"])
    host, port = svc.proxy_address
    for target in (f"http://127.0.0.1:{loopback_origin}/", f"http://beside.test:{loopback_origin}/"):
        status, headers, body = await _get(host, port, target)
        assert status == 200 and body == b"hello from 127.0.0.1", (headers, body)
    assert [r["decision"] for r in egress(svc)] == ["allow", "allow"]


async def test_dialling_the_proxys_own_port_through_it_is_refused_as_egressd_itself(make_egressd: MakeEgressd) -> None:
    svc = await make_egressd(allow=["127.0.0.1:*"], allow_private=["127.0.0.0/8"])
    host, port = svc.proxy_address
    status, headers, body = await _get(host, port, f"http://127.0.0.1:{port}/loop")
    _assert_egressd_itself(status, headers, body)
    [record] = egress(svc)  # one attempt: the proxy never received its own dial
    assert record["id"] == headers["x-egress-request-id"]
    assert (record["decision"], record["reason"], record["address"]) == ("deny", "private_address", "127.0.0.1")
    assert "egressd itself" in record["detail"]


async def test_the_control_api_is_not_reachable_through_the_proxy(make_egressd: MakeEgressd) -> None:
    svc = await make_egressd(control="127.0.0.3:0", allow=["127.0.0.3:*"], allow_private=["127.0.0.0/8"])
    control_port = int(svc.control_address.rsplit(":", 1)[1])
    host, port = svc.proxy_address
    for path in ("/health", "/runs"):
        status, headers, body = await _get(host, port, f"http://127.0.0.3:{control_port}{path}")
        _assert_egressd_itself(status, headers, body)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"CONNECT 127.0.0.3:{control_port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    status, headers, body = await read_response(reader)
    writer.close()
    _assert_egressd_itself(status, headers, body)
    assert [r["reason"] for r in egress(svc)] == ["private_address"] * 3


async def test_a_wildcard_listener_is_egressd_on_every_loopback_address(make_egressd: MakeEgressd) -> None:
    # Credentials only: a proxy on 0.0.0.0 serves nobody else for the moment it is up.
    svc = await make_egressd(listen="0.0.0.0:0", require_auth=True, allow_private=["127.0.0.0/8"])
    assert svc.runs is not None
    run = svc.runs.create(task="loop", allow=[parse_entry("127.0.0.1:*"), parse_entry("127.0.0.2:*")])
    creds = base64.b64encode(f"{run.id}:{run.token}".encode()).decode()
    port = svc.proxy_address[1]
    for target in (f"http://127.0.0.1:{port}/", f"http://127.0.0.2:{port}/", f"http://127.0.0.2:{port}/again"):
        status, headers, body = await _get("127.0.0.1", port, target, creds)
        _assert_egressd_itself(status, headers, body)
    # Three attempts, three records: had egressd dialled itself, the looped requests
    # (no credentials on them) would be records of their own.
    records = egress(svc)
    assert [(r["run"], r["reason"]) for r in records] == [(run.id, "private_address")] * 3
    assert {r["address"] for r in records} == {"127.0.0.1", "127.0.0.2"}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "::ffff:0.0.0.0"])
def test_the_unspecified_address_is_egressd_on_each_of_its_ports(host: str) -> None:
    # The kernel takes 0.0.0.0 (and ::) as a destination to mean this host: it reaches 127.0.0.1.
    assert is_own(ip_address(host), 3128, PROXY, _never_local)
    assert not is_own(ip_address(host), 8000, PROXY, _never_local)


async def test_a_name_resolving_to_the_unspecified_address_never_reaches_the_control_api(
    make_egressd: MakeEgressd, dns: FakeDns
) -> None:
    # Every range allowed: only the rule that egressd never dials itself stands between a name that
    # resolves to 0.0.0.0 and the control API on 127.0.0.1 (where the kernel takes 0.0.0.0). Refused
    # before the dial: had it been dialled, /health would have answered 200.
    svc = await make_egressd(allow=["zero.test:*"], allow_private=["0.0.0.0/0", "::/0"])
    control_port = int(svc.control_address.rsplit(":", 1)[1])
    dns.set("zero.test", ["0.0.0.0"])
    host, port = svc.proxy_address
    status, headers, body = await _get(host, port, f"http://zero.test:{control_port}/health")
    _assert_egressd_itself(status, headers, body)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"CONNECT zero.test:{control_port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    status, headers, body = await read_response(reader)
    writer.close()
    _assert_egressd_itself(status, headers, body)
    records = egress(svc)
    assert [(r["reason"], r["address"]) for r in records] == [("private_address", "0.0.0.0")] * 2
