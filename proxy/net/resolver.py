"""Resolve a name the policy already allowed, to the addresses the decision screens and the dialer dials.

The runner calls ``Resolver.resolve`` only after ``policy.decide`` allowed the
name (DESIGN.md "Policy"): a denied or held name never leaves the machine. The
addresses returned are the ones the decision classifies and the dialer then dials directly, so
there is never a second lookup between the check and the connection.

Two implementations:

- ``SystemResolver`` asks the operating system (``getaddrinfo``): the default.
- ``DnsResolver`` (``--upstream-dns HOST:PORT``) speaks DNS itself over UDP,
  falling back to TCP on truncation, validates every reply against its query,
  follows CNAME chains only from the asked name, caches answers by TTL and
  coalesces concurrent lookups of one name into one upstream exchange.

The messages are built and read by the DNS codec, ``egressd.proxy.core.dns``
(``build_query``, ``accept_reply``, ``read_answer``); ``parse_server`` is pure
too; the asyncio code around them is the thin shell.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Protocol

from dnslib import DNSRecord

from egressd.names.addresses import IPAddress
from egressd.names.authority import AuthorityError, Fault, parse_authority
from egressd.proxy.core.dns import (
    TCP_LENGTH_PREFIX,
    TYPE_A,
    TYPE_AAAA,
    Resolution,
    ResolveError,
    accept_reply,
    build_query,
    qtype_text,
    read_answer,
    same_name,
)

# RFC 2308 §5: NXDOMAIN is cached for min(SOA TTL, SOA MINIMUM); without an SOA
# we still hold it briefly so a tool retrying in a loop does not hammer upstream.
_DEFAULT_NEGATIVE_TTL_S = 5
# A short cap: a name that appears soon after (new deployment) must not stay
# unreachable for the SOA's hours-long minimum.
_MAX_NEGATIVE_TTL_S = 60


class Resolver(Protocol):
    """Turns an allowed, normalised host name into the addresses to check and dial."""

    async def resolve(self, host: str) -> list[IPAddress]:
        """Return every A and AAAA address of ``host``, IPv4 first, deduplicated.

        ``host`` is a lowercase A-label without a trailing dot, never an IP
        literal. The list is never empty: no address raises ``ResolveError``.
        """
        ...


def _ordered(addresses: Iterable[IPAddress]) -> list[IPAddress]:
    """IPv4 before IPv6, each family in the order given, duplicates dropped."""
    unique = list(dict.fromkeys(addresses))
    return [a for a in unique if a.version == 4] + [a for a in unique if a.version == 6]


class SystemResolver:
    """Resolves through the operating system's ``getaddrinfo`` (hosts file, nsswitch, DNS).

    The lookup runs in the loop's default executor; on timeout the caller gets
    ``ResolveError`` at once while the thread finishes in the background, which
    ``getaddrinfo`` offers no way to interrupt.
    """

    def __init__(self, *, timeout_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._timeout_s = timeout_s

    async def resolve(self, host: str) -> list[IPAddress]:
        """Return the host's addresses, IPv4 first; ``ResolveError`` if there are none."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except TimeoutError as exc:
            raise ResolveError(f"{host}: timeout after {self._timeout_s:g} s") from exc
        except socket.gaierror as exc:
            raise ResolveError(f"{host}: {exc.strerror}") from exc
        except UnicodeError as exc:
            raise ResolveError(f"{host}: invalid name") from exc
        addresses = [
            ip_address(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)
        ]
        if not addresses:
            raise ResolveError(f"{host}: no addresses")
        return _ordered(addresses)

    async def close(self) -> None:
        """Nothing to release: present so the owner can close any resolver the same way."""


# ---------------------------------------------------------------------------
# Pure: the upstream server's address (the messages are egressd.proxy.core.dns')


def parse_server(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT``, ``[IPv6]:PORT``, a bare host or a bare IPv6 address (port 53).

    HOST is an IP address or a DNS name. Raises ``ValueError`` naming what is
    wrong; settings report it against ``--upstream-dns``.
    """
    value = text.strip()
    if not value:
        raise ValueError("DNS server address is empty; expected HOST, HOST:PORT or [IPv6]:PORT")
    try:
        return parse_authority(value, 53, port_digits=None, host=lambda host: _check_host(text, host))
    except AuthorityError as exc:
        if exc.fault is Fault.BRACKET:
            message = "missing ']' after the IPv6 address"
        elif exc.fault is Fault.AFTER_BRACKET:
            message = "expected ':PORT' after ']'"
        elif exc.fault is Fault.PORT:
            message = f"port {exc.part!r} is not a number"
        else:
            message = f"port {exc.part.lstrip('0') or '0'} is out of range 1-65535"
        raise ValueError(f"DNS server {text!r}: {message}") from exc


_DNS_NAME = re.compile(
    r"(?=.{1,253}\.?$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*"
    r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.?",
    re.IGNORECASE,
)


def _check_host(text: str, host: str) -> str:
    """A bracketed or bare IPv6 address, an IPv4 address (each normalised) or a syntactically valid DNS name."""
    if host.startswith("["):
        try:
            return str(IPv6Address(host[1:-1]))
        except ValueError as exc:
            raise ValueError(f"DNS server {text!r}: {host[1:-1]!r} is not an IPv6 address") from exc
    if ":" in host:
        try:
            return str(IPv6Address(host))
        except ValueError as exc:
            raise ValueError(
                f"DNS server {text!r}: not an IPv6 address; write [IPv6]:PORT to give a port"
            ) from exc
    if not host:
        raise ValueError(f"DNS server {text!r}: missing host")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return str(IPv4Address(host))
        except ValueError as exc:
            raise ValueError(f"DNS server {text!r}: {host!r} is not an IPv4 address") from exc
    if not _DNS_NAME.fullmatch(host):
        raise ValueError(f"DNS server {text!r}: {host!r} is not a valid host name")
    return host.lower()


# ---------------------------------------------------------------------------
# The asyncio shell


class _UdpExchange(asyncio.DatagramProtocol):
    """One query's connected UDP socket: the first acceptable reply wins, the rest are dropped."""

    def __init__(self, query: DNSRecord) -> None:
        self._query = query
        # The result is a value, never a future exception, so a reply that
        # arrives after the caller gave up leaves no "exception never retrieved".
        self.outcome: asyncio.Future[DNSRecord | OSError] = (
            asyncio.get_running_loop().create_future()
        )

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if self.outcome.done():
            return
        reply = accept_reply(self._query, data)
        if reply is not None:
            self.outcome.set_result(reply)

    def error_received(self, exc: Exception) -> None:
        # An ICMP port-unreachable on a connected socket surfaces here as
        # ConnectionRefusedError: nothing listens upstream, so fail fast.
        if not self.outcome.done() and isinstance(exc, OSError):
            self.outcome.set_result(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.outcome.done():
            self.outcome.set_result(
                exc if isinstance(exc, OSError) else ConnectionError("UDP socket closed")
            )


@dataclass(frozen=True, slots=True)
class _Entry:
    """A cached outcome: addresses, or the NXDOMAIN message to raise again."""

    expires_at: float
    addresses: tuple[IPAddress, ...]
    error: str | None


class DnsResolver:
    """Resolves by asking one upstream DNS server directly (``--upstream-dns``).

    For each name, A and AAAA are asked concurrently over UDP from a fresh
    socket (kernel-random source port) with a random id from ``secrets``; a
    reply is used only if ``accept_reply`` matches it to the query. A
    truncated reply is asked again over TCP. Each UDP query is tried
    ``attempts`` times, each bounded by ``timeout_s``; the TCP retry is bounded
    by ``timeout_s`` too.

    Results are cached per name: addresses for min(record TTL, ``max_ttl_s``)
    but at least ``min_ttl_s``; NXDOMAIN for the RFC 2308 negative TTL (5 s
    without an SOA, at most 60 s). When only one of A and AAAA fails, the other
    family's addresses are returned and cached no longer than 5 s. The cache
    holds at most ``max_cache_entries`` names, evicting the oldest insert.

    Concurrent resolves of one uncached name share one lookup, owned by the
    resolver: a cancelled caller does not cancel it for the others. ``close``
    cancels lookups in flight; their callers get ``ResolveError``.
    """

    def __init__(
        self,
        server: tuple[str, int],
        *,
        timeout_s: float = 3.0,
        attempts: int = 2,
        clock: Callable[[], float] = time.monotonic,
        max_cache_entries: int = 10_000,
        max_ttl_s: int = 300,
        min_ttl_s: int = 0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        if max_cache_entries < 0 or max_ttl_s < 0 or min_ttl_s < 0:
            raise ValueError("cache size and TTL bounds must not be negative")
        self._server = server
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._clock = clock
        self._max_cache_entries = max_cache_entries
        self._max_ttl_s = max_ttl_s
        self._min_ttl_s = min_ttl_s
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._lookups: dict[str, asyncio.Task[tuple[IPAddress, ...]]] = {}
        self._closed = False

    async def resolve(self, host: str) -> list[IPAddress]:
        """Return every A and AAAA address of ``host``, IPv4 first; ``ResolveError`` if none.

        Served from the cache while fresh; otherwise joins the lookup in flight
        for ``host`` or starts one.
        """
        if self._closed:
            raise ResolveError(f"{host}: resolver closed")
        entry = self._cached(host)
        if entry is not None:
            if entry.error is not None:
                raise ResolveError(entry.error)
            return list(entry.addresses)
        lookup = self._lookups.get(host)
        if lookup is None:
            lookup = asyncio.create_task(self._lookup(host), name=f"resolve {host}")
            self._lookups[host] = lookup
            lookup.add_done_callback(self._lookup_done(host))
        try:
            # shield: this caller's cancellation must not cancel the shared lookup.
            return list(await asyncio.shield(lookup))
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if lookup.cancelled() and (current is None or current.cancelling() == 0):
                raise ResolveError(f"{host}: resolver closed") from None
            raise

    async def close(self) -> None:
        """Cancel every lookup in flight and wait for them; later resolves fail."""
        self._closed = True
        lookups = list(self._lookups.values())
        for lookup in lookups:
            lookup.cancel()
        await asyncio.gather(*lookups, return_exceptions=True)
        self._cache.clear()

    def _lookup_done(self, host: str) -> Callable[[asyncio.Task[tuple[IPAddress, ...]]], None]:
        def done(lookup: asyncio.Task[tuple[IPAddress, ...]]) -> None:
            if self._lookups.get(host) is lookup:
                del self._lookups[host]
            # Mark the outcome retrieved: if every caller was cancelled, nobody
            # else will, and asyncio would log "exception never retrieved".
            if not lookup.cancelled():
                lookup.exception()

        return done

    def _cached(self, host: str) -> _Entry | None:
        entry = self._cache.get(host)
        if entry is None:
            return None
        if self._clock() >= entry.expires_at:
            del self._cache[host]
            return None
        return entry

    def _store(
        self, host: str, ttl_s: float, addresses: tuple[IPAddress, ...], error: str | None
    ) -> None:
        if ttl_s <= 0 or self._max_cache_entries == 0:
            return
        self._cache.pop(host, None)
        self._cache[host] = _Entry(self._clock() + ttl_s, addresses, error)
        while len(self._cache) > self._max_cache_entries:
            self._cache.popitem(last=False)

    async def _lookup(self, host: str) -> tuple[IPAddress, ...]:
        """Ask A and AAAA together, combine, cache, and return the addresses."""
        async with asyncio.TaskGroup() as group:
            ask_a = group.create_task(self._answer(host, TYPE_A))
            ask_aaaa = group.create_task(self._answer(host, TYPE_AAAA))
        outcomes = (ask_a.result(), ask_aaaa.result())
        answers = [o for o in outcomes if isinstance(o, Resolution)]
        addresses = tuple(_ordered(a for answer in answers for a in answer.addresses))
        failed = [
            o
            for o in outcomes
            if isinstance(o, ResolveError) or o.rcode not in ("NOERROR", "NXDOMAIN")
        ]

        if addresses:
            ttl = min(a.ttl_s for a in answers if a.addresses and a.ttl_s is not None)
            ttl = max(self._min_ttl_s, min(ttl, self._max_ttl_s))
            if failed:
                # One family failed (SERVFAIL, timeout): do not hide it for a long TTL.
                ttl = min(ttl, _DEFAULT_NEGATIVE_TTL_S)
            self._store(host, ttl, addresses, None)
            return addresses

        # No addresses. RFC 8020: NXDOMAIN means no name at all, whatever the
        # other type said, so it wins and is cached (RFC 2308 §5).
        for answer in answers:
            if answer.rcode == "NXDOMAIN":
                message = f"{host}: NXDOMAIN (no such name)"
                ttl_s = _DEFAULT_NEGATIVE_TTL_S if answer.ttl_s is None else answer.ttl_s
                self._store(host, min(ttl_s, _MAX_NEGATIVE_TTL_S), (), message)
                raise ResolveError(message)
        for outcome in failed:
            if isinstance(outcome, ResolveError):
                raise outcome
            raise ResolveError(f"{host}: upstream answered {outcome.rcode}")
        raise ResolveError(f"{host}: no addresses")

    async def _answer(self, host: str, qtype: int) -> Resolution | ResolveError:
        """One type's answer, or the error as a value so the sibling query carries on."""
        try:
            return read_answer(await self._exchange(host, qtype), host, qtype)
        except ResolveError as exc:
            return exc

    async def _exchange(self, host: str, qtype: int) -> DNSRecord:
        """Ask over UDP up to ``attempts`` times; repeat over TCP if the reply is truncated."""
        for _ in range(self._attempts):
            # A fresh id and socket per attempt (RFC 5452 §9.2: id and port randomness).
            query = build_query(host, qtype, secrets.randbelow(0x10000))
            reply = await self._ask_udp(query)
            if reply is None:
                continue
            if reply.header.tc:
                # RFC 1035 §4.2.1: a truncated UDP reply means "ask again over TCP".
                return await self._ask_tcp(query)
            return reply
        raise ResolveError(
            f"{host}: timeout ({qtype_text(qtype)} query, {self._attempts} x {self._timeout_s:g} s)"
        )

    async def _ask_udp(self, query: DNSRecord) -> DNSRecord | None:
        """One UDP exchange; None on timeout. Mismatching datagrams are ignored meanwhile."""
        loop = asyncio.get_running_loop()
        transport: asyncio.DatagramTransport | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                transport, exchange = await loop.create_datagram_endpoint(
                    lambda: _UdpExchange(query), remote_addr=self._server
                )
                transport.sendto(query.pack())
                outcome = await exchange.outcome
        except TimeoutError:
            return None
        except OSError as exc:
            raise ResolveError(f"upstream DNS {self._server_text()} unreachable: {exc}") from exc
        finally:
            if transport is not None:
                transport.close()
        if isinstance(outcome, OSError):
            raise ResolveError(
                f"upstream DNS {self._server_text()} unreachable: {outcome}"
            ) from outcome
        return outcome

    async def _ask_tcp(self, query: DNSRecord) -> DNSRecord:
        """One TCP exchange, RFC 1035 §4.2.2: each message prefixed by its 2-byte length."""
        payload = query.pack()
        try:
            async with asyncio.timeout(self._timeout_s):
                reader, writer = await asyncio.open_connection(*self._server)
                try:
                    writer.write(len(payload).to_bytes(TCP_LENGTH_PREFIX, "big") + payload)
                    await writer.drain()
                    length = int.from_bytes(await reader.readexactly(TCP_LENGTH_PREFIX), "big")
                    data = await reader.readexactly(length)
                finally:
                    writer.close()
                    try:
                        await writer.wait_closed()
                    except OSError:
                        pass
        except TimeoutError as exc:
            raise ResolveError(
                f"{same_name(query.q.qname)}: timeout over TCP ({self._timeout_s:g} s)"
            ) from exc
        except asyncio.IncompleteReadError as exc:
            raise ResolveError(
                f"{same_name(query.q.qname)}: malformed reply (TCP stream ended mid-message)"
            ) from exc
        except OSError as exc:
            raise ResolveError(
                f"upstream DNS {self._server_text()} unreachable over TCP: {exc}"
            ) from exc
        reply = accept_reply(query, data)
        if reply is None:
            # Over our own TCP connection there is no off-path spoofing to
            # wait out: a reply that does not match is simply broken.
            raise ResolveError(f"{same_name(query.q.qname)}: malformed reply over TCP")
        return reply

    def _server_text(self) -> str:
        host, port = self._server
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
