"""A scriptable upstream DNS server on loopback, for every test that needs name resolution.

Usage::

    async with FakeDns({"origin.test": ["127.0.0.2", "::1"],
                        "alias.test": "CNAME:origin.test"}) as dns:
        resolver = DnsResolver(dns.address)
        ...
        assert dns.asked("origin.test")

It listens on 127.0.0.1 with UDP and TCP on the same ephemeral port, answers A
and AAAA from its mapping (IPv4 strings for A, IPv6 for AAAA), follows its own
CNAMEs like a recursive resolver would (the chain goes into the answer) and
answers unknown names NXDOMAIN. Knobs, all changeable while it runs:

- ``set(name, addresses, ttl=...)`` / ``remove(name)``: change the mapping
  (rebinding tests);
- ``truncate_udp``: answer every UDP query with TC set and no answer, so the
  client must repeat it over TCP (RFC 1035 §4.2.1); answers over 512 octets
  are truncated on UDP anyway;
- ``servfail`` (names) and ``servfail_types`` ((name, "AAAA") pairs): answer
  SERVFAIL;
- ``drop``: names whose queries are never answered (timeouts);
- ``delay_s``: delay every answer;
- ``extra_answers[name]``: extra (owner, value) records appended to the answer
  for ``name``, value an address or "CNAME:target" (cache-poisoning tests);
- ``negative_ttl``: when set, NXDOMAIN carries an SOA whose TTL and MINIMUM
  are this value (RFC 2308 §3).

``queries`` records every query received as (name, type), ``tcp_queries``
those that came over TCP. Nothing here starts a task: answers are sent from
protocol callbacks or ``call_later`` timers, all cancelled by ``close``.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import ip_address
from types import TracebackType
from typing import cast

from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, SOA, A, DNSError, DNSLabel, DNSRecord

from egressd.names.addresses import IPAddress

_HOST = "127.0.0.1"
_CNAME_PREFIX = "CNAME:"
# RFC 1035 §4.2.1: a UDP message without EDNS is at most 512 octets.
_MAX_UDP_BYTES = 512
# A recursive resolver gives up on long chains; so do we, and loops end here too.
_MAX_CNAME_HOPS = 16
_BIND_ATTEMPTS = 50


def _norm(name: DNSLabel | str) -> str:
    text = str(name).lower()
    return text[:-1] if text.endswith(".") else text


@dataclass(frozen=True, slots=True)
class _Entry:
    addresses: tuple[IPAddress, ...]
    cname: str | None
    ttl: int


def _entry(value: Sequence[str] | str, ttl: int) -> _Entry:
    if isinstance(value, str):
        if not value.startswith(_CNAME_PREFIX):
            raise ValueError(f"expected a list of addresses or 'CNAME:target', got {value!r}")
        return _Entry((), _norm(value[len(_CNAME_PREFIX) :]), ttl)
    return _Entry(tuple(ip_address(v) for v in value), None, ttl)


def _address_rr(owner: str, address: IPAddress, ttl: int) -> RR:
    if address.version == 4:
        return RR(owner, QTYPE.A, ttl=ttl, rdata=A(str(address)))
    return RR(owner, QTYPE.AAAA, ttl=ttl, rdata=AAAA(str(address)))


class _UdpServer(asyncio.DatagramProtocol):
    def __init__(self, dns: FakeDns) -> None:
        self._dns = dns

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self._dns._on_udp(data, addr)


class _TcpConnection(asyncio.Protocol):
    """RFC 1035 §4.2.2: messages framed by a 2-byte length; several may share a connection."""

    def __init__(self, dns: FakeDns) -> None:
        self._dns = dns
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's TCPTransport is not an asyncio.Transport subclass.
        self._transport = cast(asyncio.Transport, transport)
        self._dns._tcp_transports.add(self._transport)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._buffer += data
        while len(self._buffer) >= 2:
            length = int.from_bytes(self._buffer[:2], "big")
            if len(self._buffer) < 2 + length:
                break
            message = bytes(self._buffer[2 : 2 + length])
            del self._buffer[: 2 + length]
            self._dns._on_tcp(message, self._transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._dns._tcp_transports.discard(self._transport)


class FakeDns:
    """An asyncio UDP+TCP DNS server on 127.0.0.1 answering from an editable mapping.

    Values are lists of address strings or "CNAME:target". Use it as an async
    context manager, or call ``start`` and ``close``.
    """

    def __init__(
        self, records: Mapping[str, Sequence[str] | str] | None = None, *, ttl: int = 60
    ) -> None:
        self._ttl = ttl
        self._names: dict[str, _Entry] = {}
        for name, value in (records or {}).items():
            self.set(name, value, ttl=ttl)
        self.queries: list[tuple[str, str]] = []
        self.tcp_queries: list[tuple[str, str]] = []
        self.truncate_udp = False
        self.servfail: set[str] = set()
        self.servfail_types: set[tuple[str, str]] = set()
        self.drop: set[str] = set()
        self.delay_s = 0.0
        self.extra_answers: dict[str, list[tuple[str, str]]] = {}
        self.negative_ttl: int | None = None
        self._address: tuple[str, int] | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tcp_transports: set[asyncio.Transport] = set()
        self._timers: set[asyncio.TimerHandle] = set()

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) to send queries to; the same port serves UDP and TCP."""
        if self._address is None:
            raise RuntimeError("FakeDns is not started")
        return self._address

    def set(self, name: str, addresses: Sequence[str] | str, ttl: int | None = None) -> None:
        """Answer ``name`` with ``addresses`` (or "CNAME:target") from now on."""
        self._names[_norm(name)] = _entry(addresses, self._ttl if ttl is None else ttl)

    def remove(self, name: str) -> None:
        """Make ``name`` unknown again (NXDOMAIN)."""
        self._names.pop(_norm(name), None)

    def asked(self, name: str) -> bool:
        """Whether any query for ``name`` (any type, UDP or TCP) has arrived."""
        wanted = _norm(name)
        return any(asked == wanted for asked, _ in self.queries)

    async def start(self) -> None:
        """Bind UDP on an ephemeral port, then TCP on the same port (retrying if taken)."""
        loop = asyncio.get_running_loop()
        for _ in range(_BIND_ATTEMPTS):
            udp, _protocol = await loop.create_datagram_endpoint(
                lambda: _UdpServer(self), local_addr=(_HOST, 0)
            )
            port: int = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await loop.create_server(lambda: _TcpConnection(self), _HOST, port)
            except OSError as exc:
                udp.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            self._udp = udp
            self._address = (_HOST, port)
            return
        raise RuntimeError("FakeDns could not find a port free for both UDP and TCP")

    async def close(self) -> None:
        """Stop listening, drop pending delayed answers, close every connection."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
            self._tcp = None
        for transport in list(self._tcp_transports):
            transport.close()
        # Let connection_lost callbacks run so every socket is really closed.
        await asyncio.sleep(0)

    async def __aenter__(self) -> FakeDns:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def answer(self, request: DNSRecord, *, udp: bool) -> DNSRecord | None:
        """The reply to ``request`` under the current knobs; None means stay silent."""
        if len(request.questions) != 1:
            reply = request.reply()
            reply.header.rcode = RCODE.FORMERR
            return reply
        name = _norm(request.q.qname)
        qtype = QTYPE.get(request.q.qtype, str(request.q.qtype))
        self.queries.append((name, qtype))
        if not udp:
            self.tcp_queries.append((name, qtype))
        if name in self.drop:
            return None
        reply = request.reply()
        if udp and self.truncate_udp:
            reply.header.tc = 1
            return reply
        if name in self.servfail or (name, qtype) in self.servfail_types:
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        if name not in self._names:
            reply.header.rcode = RCODE.NXDOMAIN
            if self.negative_ttl is not None:
                zone = name.partition(".")[2] or name
                times = (1, 3600, 600, 86400, self.negative_ttl)
                soa = SOA(f"ns.{zone}", f"hostmaster.{zone}", times)
                reply.add_auth(RR(zone, QTYPE.SOA, ttl=self.negative_ttl, rdata=soa))
            return reply
        self._add_chain(reply, name, qtype)
        for owner, value in self.extra_answers.get(name, []):
            if value.startswith(_CNAME_PREFIX):
                target = value[len(_CNAME_PREFIX) :]
                reply.add_answer(RR(owner, QTYPE.CNAME, ttl=self._ttl, rdata=CNAME(target)))
            else:
                reply.add_answer(_address_rr(owner, ip_address(value), self._ttl))
        return reply

    def _add_chain(self, reply: DNSRecord, name: str, qtype: str) -> None:
        current = name
        for _ in range(_MAX_CNAME_HOPS):
            entry = self._names.get(current)
            if entry is None:
                return
            if entry.cname is not None:
                reply.add_answer(RR(current, QTYPE.CNAME, ttl=entry.ttl, rdata=CNAME(entry.cname)))
                current = entry.cname
                continue
            for address in entry.addresses:
                if (qtype, address.version) in (("A", 4), ("AAAA", 6)):
                    reply.add_answer(_address_rr(current, address, entry.ttl))
            return

    def _reply_bytes(self, data: bytes, *, udp: bool) -> bytes | None:
        try:
            request = DNSRecord.parse(data)
        except DNSError:
            return None
        if request.header.qr:
            return None
        reply = self.answer(request, udp=udp)
        if reply is None:
            return None
        payload: bytes = reply.pack()
        if udp and len(payload) > _MAX_UDP_BYTES:
            truncated = request.reply()
            truncated.header.tc = 1
            payload = truncated.pack()
        return payload

    def _later(self, send: Callable[..., None], *args: object) -> None:
        """Run ``send(*args)`` now, or after ``delay_s`` on a timer ``close`` can cancel."""
        if self.delay_s <= 0:
            send(*args)
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(timer)
            send(*args)

        timer = loop.call_later(self.delay_s, fire)
        self._timers.add(timer)

    def _on_udp(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        payload = self._reply_bytes(data, udp=True)
        if payload is not None:
            self._later(self._send_udp, payload, addr)

    def _send_udp(self, payload: bytes, addr: tuple[str | int, ...]) -> None:
        if self._udp is not None and not self._udp.is_closing():
            self._udp.sendto(payload, addr)

    def _on_tcp(self, data: bytes, transport: asyncio.Transport) -> None:
        payload = self._reply_bytes(data, udp=False)
        if payload is not None:
            self._later(self._send_tcp, len(payload).to_bytes(2, "big") + payload, transport)

    @staticmethod
    def _send_tcp(framed: bytes, transport: asyncio.Transport) -> None:
        if not transport.is_closing():
            transport.write(framed)
