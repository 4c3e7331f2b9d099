"""Resolving allowed names: the pure reply checks, and DnsResolver against FakeDns on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from ipaddress import IPv6Address, ip_address

import pytest
from dnslib import AAAA, CNAME, QTYPE, RR, A, DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.names.addresses import IPAddress
from egressd.proxy.core.dns import ResolveError, accept_reply, build_query, read_answer
from egressd.proxy.net.resolver import DnsResolver, SystemResolver, parse_server
from tests.fakes.dns import FakeDns


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class DroppingUdp(asyncio.DatagramProtocol):
    """An upstream that reads every query and never answers."""

    def __init__(self) -> None:
        self.received = 0

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.received += 1


def ips(*texts: str) -> list[IPAddress]:
    return [ip_address(t) for t in texts]


@pytest.fixture
async def dns() -> AsyncIterator[FakeDns]:
    async with FakeDns(
        {
            "origin.test": ["127.0.0.2"],
            "dual.test": ["::1", "127.0.0.2", "127.0.0.3"],
            "v6.test": ["::1"],
            "dup.test": ["127.0.0.2", "127.0.0.2"],
            "alias.test": "CNAME:mid.test",
            "mid.test": "CNAME:origin.test",
            "loop1.test": "CNAME:loop2.test",
            "loop2.test": "CNAME:loop1.test",
        }
    ) as server:
        yield server


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def resolver(dns: FakeDns, clock: FakeClock) -> AsyncIterator[DnsResolver]:
    resolver = DnsResolver(dns.address, timeout_s=1.0, clock=clock)
    yield resolver
    await resolver.close()


# ---------------------------------------------------------------------------
# Pure: reply validation and answer reading


def _query() -> DNSRecord:
    return build_query("origin.test", QTYPE.A, 0x1234)


def _reply_to(query: DNSRecord) -> DNSRecord:
    reply = query.reply()
    reply.add_answer(RR("origin.test", QTYPE.A, ttl=60, rdata=A("127.0.0.2")))
    return reply


def test_reply_matching_id_name_and_type_is_accepted() -> None:
    query = _query()
    reply = accept_reply(query, _reply_to(query).pack())
    assert reply is not None
    assert reply.header.id == 0x1234


def test_reply_with_wrong_id_is_ignored() -> None:
    query = _query()
    forged = _reply_to(query)
    forged.header.id = 0x4321
    assert accept_reply(query, forged.pack()) is None


def test_reply_for_another_name_is_ignored() -> None:
    query = _query()
    other = build_query("other.test", QTYPE.A, 0x1234)
    assert accept_reply(query, _reply_to(other).pack()) is None


def test_reply_for_another_type_is_ignored() -> None:
    query = _query()
    other = build_query("origin.test", QTYPE.AAAA, 0x1234)
    assert accept_reply(query, other.reply().pack()) is None


def test_a_query_echoed_back_is_not_a_reply() -> None:
    query = _query()
    assert accept_reply(query, query.pack()) is None


def test_reply_with_two_questions_is_ignored() -> None:
    query = _query()
    reply = _reply_to(query)
    reply.add_question(build_query("other.test", QTYPE.A, 1).q)
    assert accept_reply(query, reply.pack()) is None


def test_reply_name_matches_case_insensitively() -> None:
    query = _query()
    reply = _reply_to(build_query("ORIGIN.Test", QTYPE.A, 0x1234))
    assert accept_reply(query, reply.pack()) is not None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_bytes_are_ignored_never_raised(data: bytes) -> None:
    reply = accept_reply(_query(), data)
    assert reply is None or isinstance(reply, DNSRecord)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_replies_are_accepted_or_ignored_never_raised(data: st.DataObject) -> None:
    query = _query()
    packet = bytearray(_reply_to(query).pack())
    for _ in range(data.draw(st.integers(1, 6))):
        index = data.draw(st.integers(0, len(packet) - 1))
        packet[index] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(packet)))
    reply = accept_reply(query, bytes(packet[:cut]))
    if reply is not None:
        read_answer(reply, "origin.test", QTYPE.A)


def test_answer_ignores_records_for_unrelated_names() -> None:
    reply = _reply_to(_query())
    reply.add_answer(RR("other.test", QTYPE.A, ttl=60, rdata=A("127.0.0.9")))
    reply.add_answer(RR("unrelated.test", QTYPE.CNAME, ttl=60, rdata=CNAME("evil.test")))
    reply.add_answer(RR("evil.test", QTYPE.A, ttl=60, rdata=A("127.0.0.10")))
    answer = read_answer(reply, "origin.test", QTYPE.A)
    assert list(answer.addresses) == ips("127.0.0.2")


def test_answer_ttl_is_the_smallest_along_the_cname_chain() -> None:
    query = build_query("alias.test", QTYPE.AAAA, 7)
    reply = query.reply()
    reply.add_answer(RR("alias.test", QTYPE.CNAME, ttl=40, rdata=CNAME("origin.test")))
    reply.add_answer(RR("origin.test", QTYPE.AAAA, ttl=90, rdata=AAAA("::1")))
    answer = read_answer(reply, "alias.test", QTYPE.AAAA)
    assert answer.addresses == (IPv6Address("::1"),)
    assert answer.ttl_s == 40


def test_answer_of_the_wrong_type_gives_no_addresses() -> None:
    query = build_query("origin.test", QTYPE.AAAA, 7)
    reply = query.reply()
    reply.add_answer(RR("origin.test", QTYPE.A, ttl=60, rdata=A("127.0.0.2")))
    assert read_answer(reply, "origin.test", QTYPE.AAAA).addresses == ()


def test_overlong_label_is_a_resolve_error() -> None:
    with pytest.raises(ResolveError, match="invalid name"):
        build_query("a" * 64 + ".test", QTYPE.A, 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("127.0.0.1:5353", ("127.0.0.1", 5353), id="ipv4 with port"),
        pytest.param("127.0.0.1", ("127.0.0.1", 53), id="bare ipv4 defaults to port 53"),
        pytest.param("[::1]:5353", ("::1", 5353), id="bracketed ipv6 with port"),
        pytest.param("[::1]", ("::1", 53), id="bracketed ipv6 defaults to port 53"),
        pytest.param("::1", ("::1", 53), id="bare ipv6 defaults to port 53"),
        pytest.param("Localhost:53", ("localhost", 53), id="host name is lowercased"),
        pytest.param(" dns.test ", ("dns.test", 53), id="surrounding space is ignored"),
    ],
)
def test_parse_server_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_server(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("", "empty", id="empty"),
        pytest.param("127.0.0.1:", "not a number", id="missing port"),
        pytest.param("127.0.0.1:0", "out of range", id="port zero"),
        pytest.param("127.0.0.1:65536", "out of range", id="port too large"),
        pytest.param("127.0.0.1:dns", "not a number", id="port not numeric"),
        pytest.param("[::1:53", "missing ']'", id="unclosed bracket"),
        pytest.param("[::1]53", "expected ':PORT'", id="junk after bracket"),
        pytest.param("[127.0.0.1]:53", "not an IPv6 address", id="ipv4 in brackets"),
        pytest.param("1.2.3:53", "not an IPv4 address", id="short ipv4"),
        pytest.param(":53", "missing host", id="missing host"),
        pytest.param("bad host:53", "not a valid host name", id="space in host"),
        pytest.param("fe80::1::2", "not an IPv6 address", id="bad bare ipv6"),
    ],
)
def test_parse_server_rejects_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_server(text)


# ---------------------------------------------------------------------------
# DnsResolver against FakeDns


async def test_returns_ipv4_before_ipv6(resolver: DnsResolver) -> None:
    assert await resolver.resolve("dual.test") == ips("127.0.0.2", "127.0.0.3", "::1")


async def test_ipv6_only_name_resolves(resolver: DnsResolver) -> None:
    assert await resolver.resolve("v6.test") == ips("::1")


async def test_duplicate_addresses_are_returned_once(resolver: DnsResolver) -> None:
    assert await resolver.resolve("dup.test") == ips("127.0.0.2")


async def test_cname_chain_is_followed_to_the_addresses(resolver: DnsResolver) -> None:
    assert await resolver.resolve("alias.test") == ips("127.0.0.2")


async def test_cname_loop_is_an_error_not_a_hang(resolver: DnsResolver) -> None:
    with pytest.raises(ResolveError, match="no addresses"):
        await resolver.resolve("loop1.test")


async def test_unrelated_answer_records_are_ignored_and_not_cached(
    dns: FakeDns, resolver: DnsResolver
) -> None:
    dns.extra_answers["origin.test"] = [
        ("other.test", "127.0.0.9"),
        ("unrelated.test", "CNAME:evil.test"),
        ("evil.test", "127.0.0.10"),
    ]
    assert await resolver.resolve("origin.test") == ips("127.0.0.2")
    with pytest.raises(ResolveError, match="NXDOMAIN"):
        await resolver.resolve("other.test")
    assert dns.asked("other.test")


async def test_truncated_udp_reply_is_repeated_over_tcp(
    dns: FakeDns, resolver: DnsResolver
) -> None:
    dns.truncate_udp = True
    assert await resolver.resolve("dual.test") == ips("127.0.0.2", "127.0.0.3", "::1")
    assert sorted(dns.tcp_queries) == [("dual.test", "A"), ("dual.test", "AAAA")]


async def test_answer_too_big_for_udp_arrives_over_tcp(dns: FakeDns, resolver: DnsResolver) -> None:
    many = [f"127.0.1.{n}" for n in range(1, 61)]
    dns.set("big.test", many)
    assert await resolver.resolve("big.test") == ips(*many)
    assert ("big.test", "A") in dns.tcp_queries


async def test_unknown_name_is_nxdomain(resolver: DnsResolver) -> None:
    with pytest.raises(ResolveError, match="NXDOMAIN"):
        await resolver.resolve("missing.test")


async def test_servfail_is_an_error(dns: FakeDns, resolver: DnsResolver) -> None:
    dns.servfail.add("origin.test")
    with pytest.raises(ResolveError, match="SERVFAIL"):
        await resolver.resolve("origin.test")


async def test_aaaa_failure_alone_still_returns_the_ipv4_addresses(
    dns: FakeDns, resolver: DnsResolver, clock: FakeClock
) -> None:
    dns.servfail_types.add(("dual.test", "AAAA"))
    assert await resolver.resolve("dual.test") == ips("127.0.0.2", "127.0.0.3")
    clock.advance(6)
    dns.servfail_types.clear()
    assert await resolver.resolve("dual.test") == ips("127.0.0.2", "127.0.0.3", "::1")


async def test_silent_upstream_times_out_quickly_after_retries() -> None:
    loop = asyncio.get_running_loop()
    transport, upstream = await loop.create_datagram_endpoint(
        DroppingUdp, local_addr=("127.0.0.1", 0)
    )
    resolver = DnsResolver(transport.get_extra_info("sockname"), timeout_s=0.05, attempts=2)
    try:
        started = time.monotonic()
        with pytest.raises(ResolveError, match="timeout"):
            await resolver.resolve("origin.test")
        assert time.monotonic() - started < 1.0
        assert upstream.received == 4  # A and AAAA, two attempts each
    finally:
        await resolver.close()
        transport.close()


async def test_upstream_with_nothing_listening_fails_fast() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    resolver = DnsResolver(("127.0.0.1", closed_port), timeout_s=2.0)
    try:
        started = time.monotonic()
        with pytest.raises(ResolveError, match="unreachable"):
            await resolver.resolve("origin.test")
        assert time.monotonic() - started < 1.0
    finally:
        await resolver.close()


async def test_positive_answer_is_cached_for_its_ttl(
    dns: FakeDns, resolver: DnsResolver, clock: FakeClock
) -> None:
    dns.set("origin.test", ["127.0.0.2"], ttl=30)
    assert await resolver.resolve("origin.test") == ips("127.0.0.2")
    asked = len(dns.queries)
    dns.set("origin.test", ["127.0.0.3"], ttl=30)
    clock.advance(29)
    assert await resolver.resolve("origin.test") == ips("127.0.0.2")
    assert len(dns.queries) == asked
    clock.advance(2)
    assert await resolver.resolve("origin.test") == ips("127.0.0.3")
    assert len(dns.queries) == asked + 2


async def test_cache_time_is_capped_by_max_ttl(dns: FakeDns, clock: FakeClock) -> None:
    dns.set("origin.test", ["127.0.0.2"], ttl=3600)
    resolver = DnsResolver(dns.address, timeout_s=1.0, clock=clock, max_ttl_s=300)
    try:
        await resolver.resolve("origin.test")
        asked = len(dns.queries)
        clock.advance(299)
        await resolver.resolve("origin.test")
        assert len(dns.queries) == asked
        clock.advance(2)
        await resolver.resolve("origin.test")
        assert len(dns.queries) == asked + 2
    finally:
        await resolver.close()


async def test_zero_ttl_is_not_cached_unless_a_minimum_is_set(
    dns: FakeDns, clock: FakeClock
) -> None:
    dns.set("origin.test", ["127.0.0.2"], ttl=0)
    plain = DnsResolver(dns.address, timeout_s=1.0, clock=clock)
    floored = DnsResolver(dns.address, timeout_s=1.0, clock=clock, min_ttl_s=10)
    try:
        await plain.resolve("origin.test")
        await plain.resolve("origin.test")
        assert len(dns.queries) == 4
        await floored.resolve("origin.test")
        await floored.resolve("origin.test")
        assert len(dns.queries) == 6
    finally:
        await plain.close()
        await floored.close()


async def test_nxdomain_is_cached_briefly_by_default(
    dns: FakeDns, resolver: DnsResolver, clock: FakeClock
) -> None:
    with pytest.raises(ResolveError, match="NXDOMAIN"):
        await resolver.resolve("new.test")
    asked = len(dns.queries)
    dns.set("new.test", ["127.0.0.2"])
    clock.advance(4)
    with pytest.raises(ResolveError, match="NXDOMAIN"):
        await resolver.resolve("new.test")
    assert len(dns.queries) == asked
    clock.advance(2)
    assert await resolver.resolve("new.test") == ips("127.0.0.2")


@pytest.mark.parametrize(
    ("soa_ttl", "cached_for"),
    [
        pytest.param(30, 30, id="soa minimum sets the negative ttl"),
        pytest.param(3600, 60, id="negative ttl is capped at 60 s"),
    ],
)
async def test_nxdomain_negative_ttl_comes_from_the_soa(
    dns: FakeDns, resolver: DnsResolver, clock: FakeClock, soa_ttl: int, cached_for: int
) -> None:
    dns.negative_ttl = soa_ttl
    with pytest.raises(ResolveError, match="NXDOMAIN"):
        await resolver.resolve("new.test")
    asked = len(dns.queries)
    clock.advance(cached_for - 1)
    with pytest.raises(ResolveError, match="NXDOMAIN"):
        await resolver.resolve("new.test")
    assert len(dns.queries) == asked
    clock.advance(2)
    with pytest.raises(ResolveError, match="NXDOMAIN"):
        await resolver.resolve("new.test")
    assert len(dns.queries) == asked + 2


async def test_full_cache_evicts_the_oldest_name(dns: FakeDns, clock: FakeClock) -> None:
    resolver = DnsResolver(dns.address, timeout_s=1.0, clock=clock, max_cache_entries=2)
    try:
        for name in ("origin.test", "dual.test", "v6.test"):
            await resolver.resolve(name)
        dns.queries.clear()
        await resolver.resolve("v6.test")
        await resolver.resolve("dual.test")
        assert dns.queries == []
        await resolver.resolve("origin.test")
        assert sorted(dns.queries) == [("origin.test", "A"), ("origin.test", "AAAA")]
    finally:
        await resolver.close()


async def test_concurrent_resolves_of_one_name_share_one_upstream_query(
    dns: FakeDns, resolver: DnsResolver
) -> None:
    dns.delay_s = 0.05
    results = await asyncio.gather(*(resolver.resolve("dual.test") for _ in range(50)))
    assert all(r == ips("127.0.0.2", "127.0.0.3", "::1") for r in results)
    assert sorted(dns.queries) == [("dual.test", "A"), ("dual.test", "AAAA")]


async def test_cancelling_one_waiter_does_not_break_the_others(
    dns: FakeDns, resolver: DnsResolver
) -> None:
    dns.delay_s = 0.1
    waiters = [asyncio.create_task(resolver.resolve("origin.test")) for _ in range(3)]
    await asyncio.sleep(0.02)
    waiters[0].cancel()
    assert await asyncio.gather(*waiters[1:]) == [ips("127.0.0.2"), ips("127.0.0.2")]
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]


async def test_lookup_finishes_and_caches_when_its_only_caller_is_cancelled(
    dns: FakeDns, resolver: DnsResolver
) -> None:
    dns.delay_s = 0.05
    waiter = asyncio.create_task(resolver.resolve("origin.test"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    (lookup,) = [t for t in asyncio.all_tasks() if t.get_name() == "resolve origin.test"]
    await lookup
    asked = len(dns.queries)
    assert await resolver.resolve("origin.test") == ips("127.0.0.2")
    assert len(dns.queries) == asked


async def test_close_fails_waiters_and_leaves_no_task_behind(
    dns: FakeDns, resolver: DnsResolver
) -> None:
    dns.delay_s = 0.5
    waiter = asyncio.create_task(resolver.resolve("origin.test"))
    await asyncio.sleep(0.02)
    await resolver.close()
    with pytest.raises(ResolveError, match="closed"):
        await waiter
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("resolve ")]
    with pytest.raises(ResolveError, match="closed"):
        await resolver.resolve("origin.test")


async def test_slow_upstream_is_a_timeout(dns: FakeDns) -> None:
    dns.delay_s = 0.3
    resolver = DnsResolver(dns.address, timeout_s=0.05, attempts=1)
    try:
        with pytest.raises(ResolveError, match="timeout"):
            await resolver.resolve("origin.test")
    finally:
        await resolver.close()


# ---------------------------------------------------------------------------
# SystemResolver


async def test_system_resolver_resolves_localhost_to_loopback() -> None:
    addresses = await SystemResolver(timeout_s=5.0).resolve("localhost")
    assert addresses
    assert all(a.is_loopback for a in addresses)
    versions = [a.version for a in addresses]
    assert versions == sorted(versions)
