"""The sandbox-facing DNS server: every name points at egressd, and nothing goes upstream.

A sandbox's resolver is egressd (DESIGN.md "The two boundaries"), so a tool
that ignores proxy settings still connects to egressd's transparent
listeners, which read the real destination from the SNI or the Host header.
This server never asks anyone else: data hidden in a query's labels stops
here, and the only thing that leaves is an audit record on the host.

How one query is answered (``DnsServer.handle``), in order:

1. the client's source address is over its rate (a token bucket) → dropped
   unanswered and counted; the counts are written as summary records;
2. not a query at all (shorter than a header, or a response) → dropped;
   an opcode other than QUERY → NOTIMP; no single question, or a question
   that cannot be decoded (cut short, a compressed name, a label that is
   not UTF-8) → FORMERR (RFC 1035 §4.1.1);
3. the source address belongs to no run (``--require-auth``) → REFUSED,
   ``auth_required``; the audit log cannot be written → REFUSED,
   ``audit_unavailable``;
4. otherwise what ``egressd.proxy.core.dnsanswer.plan_answer`` says: FORMERR
   for a name that is no host, REFUSED for a class or type other than IN A
   and AAAA, NXDOMAIN in strict mode for a name the run could never reach
   (``unreachable_reason``; in learn mode one the allowlist alone made
   unreachable is answered, its record saying ``learned``), else the A answer (for a run on a network of its
   own, egressd's IPv4 address there, ``Run.address``) or the AAAA answer
   (NOERROR with no records when there is none). A refusal carries a reason,
   whose table row gives the response code (``Reason.rcode``).

Every query that passes step 1 is one ``egress`` record of kind ``dns``
(through the recorder, like every other attempt), with ``host`` the name,
``port`` null, ``qtype`` and ``answer`` (the address, or the response code
when no address was given: ``NOERROR``, ``NXDOMAIN``, ``REFUSED``,
``FORMERR``, ``NOTIMP``; null when dropped). ``decision`` is ``allow`` only
when egressd's address was given. Once a run has had ``max_names_per_run``
distinct names recorded, queries for further new names are answered as usual
but counted instead of recorded one by one; the counts, like the rate
limit's, are written every ``summary_interval_s`` as one record each (host
null, ``reason: limit_exceeded``, ``suppressed: N``, ``limit``: which one).

The pure parts live in the core: the DNS codec (``egressd.proxy.core.dns``)
reads the question and packs the reply; ``egressd.proxy.core.dnsanswer``
decides what to answer and prepares each outcome's reply once. Here: the
sockets, the rate limit (``RateLimiter``, pure: time is passed in), the
per-run name ledger and the records. The asyncio shell answers from
protocol callbacks: no task per query, and no waiting — a DNS query never
triggers an approval (DESIGN.md "Decision order").

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from egressd.audit.records import EgressDecided, new_request_id
from egressd.names.addresses import IPAddress
from egressd.proxy.core.dns import TCP_LENGTH_PREFIX, DnsQueryError, qtype_text, read_query
from egressd.proxy.core.dnsanswer import Answers, unreachable_reason
from egressd.proxy.core.memo import remember
from egressd.proxy.core.runs import Run, RunRegistry, source_address
from egressd.proxy.net.listener import twin
from egressd.proxy.net.recorder import Recorder
from egressd.vocabulary.egress import Decision, EgressKind
from egressd.vocabulary.reasons import Reason

log = logging.getLogger("egressd.dns")

# Every answer points at egressd and never changes while it runs, so caching
# would be harmless; 5 s still absorbs a tool's burst of lookups, and a cache
# in the sandbox forgets within seconds when egressd restarts with another
# answer address or a strict-mode verdict changes (a run denied a name).
DEFAULT_TTL_S = 5
# A stub resolver asks A and AAAA for each lookup: 100 queries/s is 50
# lookups/s sustained, and a burst of 200 covers a parallel package install
# starting; a flood beyond that is dropped before it costs a parse or a record.
DEFAULT_RATE_QPS = 100.0
DEFAULT_BURST = 200
# A build or an agent session touches tens of hosts, rarely hundreds; past
# 1000 distinct names a run is enumerating or exfiltrating, and the names
# (up to 253 bytes each) stop going to the log one by one.
DEFAULT_MAX_NAMES_PER_RUN = 1000
# Summaries of what was counted rather than recorded, at most once a minute.
DEFAULT_SUMMARY_INTERVAL_S = 60.0
# RFC 7766 §6.2.3: close idle TCP connections after some seconds.
TCP_IDLE_TIMEOUT_S = 10.0
# A sandbox needs a handful of TCP connections (truncation fallback, zone-
# transfer-happy tools); this bounds the file descriptors a flood can hold.
MAX_TCP_CONNECTIONS = 256
# Rate-limit state per source address; past this the least recent is
# forgotten (a forgotten client starts again with a full bucket).
MAX_TRACKED_CLIENTS = 4096
# Replies a TCP client has not read yet, before we stop reading its queries.
_TCP_WRITE_HIGH_WATER = 64 * 1024

_BIND_ATTEMPTS = 50
_LIMIT_EXCEEDED = Reason.LIMIT_EXCEEDED.value
_BAD_REQUEST = Reason.BAD_REQUEST.value
# The order _record builds an EgressDecided in (tuple.__new__, as read_query builds a Query).
_FACT_FIELDS = (
    "id", "ts", "run", "kind", "client", "host", "port", "address", "decision", "reason", "rule",
    "approval", "command", "bytes_up", "bytes_down", "duration_s", "extra",
)  # fmt: skip
if EgressDecided._fields != _FACT_FIELDS:
    raise ImportError("EgressDecided's fields moved: update DnsServer._record")
_new_fact = tuple.__new__


# --- the pure part ---------------------------------------------------------------


class RateLimiter:
    """A token bucket per key: ``rate`` tokens a second, at most ``burst`` saved.

    Pure: ``allow(key, now)`` takes the time. At most ``max_keys`` buckets are
    kept; the least recently used is forgotten first.
    """

    def __init__(self, rate: float, burst: int, max_keys: int = MAX_TRACKED_CLIENTS) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be positive and burst at least 1")
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self._buckets: OrderedDict[object, list[float]] = OrderedDict()

    def allow(self, key: object, now: float) -> bool:
        """Take one token for ``key`` if there is one."""
        buckets = self._buckets
        bucket = buckets.get(key)
        if bucket is None:
            if len(buckets) >= self.max_keys:
                buckets.popitem(last=False)
            tokens = self.burst
            bucket = buckets[key] = [tokens, now]
        else:
            buckets.move_to_end(key)
            tokens = bucket[0] + (now - bucket[1]) * self.rate
            if tokens > self.burst:
                tokens = self.burst
            bucket[1] = now
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            return True
        bucket[0] = tokens
        return False


# --- the asyncio shell -----------------------------------------------------------


class _RunLedger:
    """Which names of one run were recorded in full, and what was only counted."""

    __slots__ = ("names", "suppressed")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.suppressed = 0


@dataclass(slots=True)
class _Heard:
    """One query while the server answers it: what it has learnt so far, for the one record ``_record`` builds.

    Owned by ``DnsServer.handle`` and what it calls; set once each, in the
    order the server learns them, so a query that breaks the server is still
    recorded with what was known.
    """

    id: str
    ts: float
    started: float
    client: str
    transport: str
    host: str | None = None
    qtype: str | None = None
    run: Run | None = None
    command: str | None = None
    rule: str | None = None
    # Learn mode: the refusal strict mode would have answered instead (the record's ``learned``).
    learned: str | None = None
    detail: str | None = None
    answer: str | None = None
    recorded: bool = False


class DnsServer:
    """UDP and TCP on one address, answering from callbacks; see the module docstring."""

    def __init__(
        self,
        *,
        recorder: Recorder,
        runs: RunRegistry,
        answer4: IPv4Address,
        answer6: IPv6Address | None = None,
        strict: bool = False,
        ttl_s: int = DEFAULT_TTL_S,
        rate_qps: float = DEFAULT_RATE_QPS,
        burst: int = DEFAULT_BURST,
        max_names_per_run: int = DEFAULT_MAX_NAMES_PER_RUN,
        summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recorder = recorder
        self.runs = runs
        self._answer4 = answer4
        self.strict = strict
        self.max_names_per_run = max_names_per_run
        self.summary_interval_s = summary_interval_s
        self._monotonic = monotonic
        self._limiter = RateLimiter(rate_qps, burst)
        self._ledgers: weakref.WeakKeyDictionary[Run, _RunLedger] = weakref.WeakKeyDictionary()
        self._dropped: Counter[IPAddress | None] = Counter()
        # peer[0] → (its source address, the address's text): one string per
        # address whatever its spelling, the rate limiter's key and what the
        # run is found by (``RunRegistry.attribute_text``), so each hashes a
        # string (its hash kept) rather than an ip_address (hashed in Python).
        self._sources: dict[str, tuple[IPAddress | None, str | None]] = {}
        # The last run a query came from and its ledger: a sandbox's queries
        # come from one run, and a WeakKeyDictionary lookup builds a weakref.
        self._last_ledger: tuple[weakref.ref[Run], _RunLedger] | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tcp_connections: set[_TcpDns] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._address: tuple[str, int] | None = None
        self._answers = Answers(answer6, ttl_s, answer4)

    # Fixed at construction: the kept outcomes are worked out from them.
    @property
    def answer4(self) -> IPv4Address:
        return self._answer4

    @property
    def answer6(self) -> IPv6Address | None:
        return self._answers.answer6

    @property
    def ttl_s(self) -> int:
        return self._answers.ttl_s

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) serving both UDP and TCP."""
        if self._address is None:
            raise RuntimeError("the DNS server is not started")
        return self._address

    async def start(self, host: str, port: int, *, shared: bool = False) -> None:
        """Bind UDP, then TCP on the same port (port 0: any port free for both).

        ``shared``: other processes of this egressd answer on the port too
        (SO_REUSEPORT, ``group_sockets``); a port anyone else holds is still
        refused (it is first bound alone).
        """
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if shared and port != 0:
            for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                with socket.socket(family, kind) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, kind == socket.SOCK_STREAM)
                    probe.bind((host, port))
        for _ in range(_BIND_ATTEMPTS if port == 0 else 1):
            udp, _protocol = await loop.create_datagram_endpoint(
                lambda: _UdpDns(self), local_addr=(host, port), family=family, reuse_port=shared or None
            )
            bound = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await loop.create_server(
                    lambda: _TcpDns(self), host, bound, family=family, reuse_address=True, backlog=128,
                    reuse_port=shared or None,
                )  # fmt: skip
            except OSError as exc:
                udp.close()
                if port == 0 and exc.errno == errno.EADDRINUSE:
                    continue
                raise
            self._udp = udp
            self._address = (host, bound)
            self._timer = loop.call_later(self.summary_interval_s, self._tick)
            return
        raise OSError(errno.EADDRINUSE, "no port free for both UDP and TCP")

    def group_sockets(self) -> tuple[socket.socket, socket.socket]:
        """A UDP and a TCP socket in this server's SO_REUSEPORT groups, bound and listening (for a worker)."""
        assert self._udp is not None and self._tcp is not None, "not started"
        udp = twin(self._udp.get_extra_info("socket"))
        try:
            tcp = twin(self._tcp.sockets[0])
        except BaseException:
            udp.close()
            raise
        tcp.listen(128)
        return udp, tcp

    async def start_on(self, udp: socket.socket, tcp: socket.socket) -> None:
        """Answer on sockets made elsewhere (a worker's, made by the owner: ``group_sockets``)."""
        loop = asyncio.get_running_loop()
        self._udp, _protocol = await loop.create_datagram_endpoint(lambda: _UdpDns(self), sock=udp)
        self._tcp = await loop.create_server(lambda: _TcpDns(self), sock=tcp, backlog=128)
        host, port = udp.getsockname()[:2]
        self._address = (host, port)
        self._timer = loop.call_later(self.summary_interval_s, self._tick)

    async def close(self) -> None:
        """Stop answering, close every TCP connection, write the last summaries."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            for connection in list(self._tcp_connections):
                connection.close()
            await self._tcp.wait_closed()
            self._tcp = None
        self.flush_summaries()

    # -- one query ------------------------------------------------------------------

    def handle(self, packet: bytes, peer: tuple[str | int, ...], transport: str) -> bytes | None:
        """The reply to one query from ``peer`` (None: send nothing); records it."""
        host = peer[0]
        try:
            source, key = self._sources[host]  # type: ignore[index]
        except KeyError:
            source, key = self._source(str(host))
        if not self._limiter.allow(key, self._monotonic()):
            self._dropped[source] += 1
            self.recorder.metrics.decided("deny", _LIMIT_EXCEEDED, 0.0)
            return None
        recorder = self.recorder
        heard = _Heard(new_request_id(), recorder.clock(), recorder.monotonic(), f"{host}:{peer[1]}", transport)
        try:
            return self._answer(packet, key, heard)
        except Exception:
            # Fail closed: no answer, and the query is still recorded with what was learnt of it.
            log.exception("DNS query %s from %s failed", heard.id, heard.client)
            if not heard.recorded:
                self._record(heard, Decision.DENY, _BAD_REQUEST)
            return None

    def _source(self, text: str) -> tuple[IPAddress | None, str | None]:
        """``runs.source_address`` and the limiter's key, remembered: a sandbox asks from one address."""
        try:
            return self._sources[text]
        except KeyError:
            pass
        address = source_address(text)
        return remember(self._sources, text, (address, str(address) if address is not None else None),
                        MAX_TRACKED_CLIENTS)

    def _answer(self, packet: bytes, source: str | None, heard: _Heard) -> bytes | None:
        """Steps 2-4 of the module docstring; ``source``: the client's address as text (``_source``)."""
        try:
            query = read_query(packet)
        except DnsQueryError as exc:
            heard.detail = str(exc)
            heard.answer = exc.rcode.name if exc.rcode is not None else None
            self._record(heard, Decision.DENY, _BAD_REQUEST)
            return exc.reply
        name = query.name
        heard.host = host = name if name is not None else query.shown
        heard.qtype = qtype_text(query.qtype)
        run = self.runs.attribute_text(source)
        if run is None:
            outcome = self._answers.no_run
        else:
            heard.run, heard.command = run, run.command
            if not self.recorder.audit.healthy:
                outcome = self._answers.no_audit_log
            else:
                unreachable = None
                if self.strict and name is not None:
                    unreachable, heard.rule, learned = unreachable_reason(run, name)
                    if learned is not None:
                        heard.learned = learned.value
                        self.recorder.metrics.learned += 1
                # A run on a network of its own reaches egressd there, and only there (None: our answer4).
                own = run.address
                outcome = self._answers.outcome(query, unreachable, own if isinstance(own, IPv4Address) else None)
        heard.answer = outcome.answer
        if run is None or self._record_in_full(run, host):
            self._record(heard, outcome.decision, outcome.reason)
        else:
            self.recorder.metrics.decided(outcome.decision, outcome.reason, self.recorder.monotonic() - heard.started)
        # At most 12 + 259 + 28 = 299 octets (one question, one address
        # record), under RFC 1035 §4.2.1's 512: never truncated.
        return outcome.reply(query)

    def _record(self, heard: _Heard, decision: Decision, reason: str | None) -> None:
        """The query's ``egress`` record, built once from what was learnt of it (``Recorder.settle``)."""
        heard.recorded = True
        run = heard.run
        extra: dict[str, object] = {"qtype": heard.qtype, "answer": heard.answer, "transport": heard.transport}
        if heard.learned is not None:
            extra = {"learned": heard.learned, **extra}
        if heard.detail is not None:
            extra["detail"] = heard.detail
        duration_s = self.recorder.monotonic() - heard.started
        # EgressDecided(id=..., ..., extra=extra), its fields in _FACT_FIELDS' order, built from one
        # tuple: a named tuple's keyword __new__ costs four times as much, once per query.
        fact: EgressDecided = _new_fact(
            EgressDecided,
            (
                heard.id,
                heard.ts,
                run.id if run is not None else None,
                EgressKind.DNS,
                heard.client,
                heard.host,
                None,  # port
                None,  # address
                decision,
                reason,
                heard.rule,
                None,  # approval
                heard.command,
                0,  # bytes_up
                0,  # bytes_down
                duration_s,
                extra,
            ),
        )
        self.recorder.settle(fact, run)

    def _record_in_full(self, run: Run, name: str) -> bool:
        """Whether this query gets its own record: its name is one of the run's first N."""
        last = self._last_ledger
        if last is not None and last[0]() is run:
            ledger = last[1]
        else:
            found = self._ledgers.get(run)
            if found is None:
                found = self._ledgers[run] = _RunLedger()
            ledger = found
            self._last_ledger = (weakref.ref(run), ledger)
        if name in ledger.names:
            return True
        if len(ledger.names) < self.max_names_per_run:
            ledger.names.add(name)
            return True
        ledger.suppressed += 1
        return False

    # -- summaries ------------------------------------------------------------------

    def flush_summaries(self) -> None:
        """Write one record per client that was rate limited and per run over its name cap."""
        dropped, self._dropped = self._dropped, Counter()
        for source, count in dropped.items():
            run = self.runs.attribute(source, None)
            self._summary(run, str(source) if source is not None else None, count, "rate_per_client")
        for run, ledger in list(self._ledgers.items()):
            if ledger.suppressed:
                count, ledger.suppressed = ledger.suppressed, 0
                self._summary(run, None, count, "names_per_run")

    def _summary(self, run: Run | None, client: str | None, count: int, limit: str) -> None:
        recorder = self.recorder
        fact_id, ts, started = new_request_id(), recorder.clock(), recorder.monotonic()
        fact = EgressDecided(
            id=fact_id,
            ts=ts,
            run=run.id if run is not None else None,
            kind=EgressKind.DNS,
            client=client,
            host=None,
            port=None,
            address=None,
            decision=Decision.DENY,
            reason=_LIMIT_EXCEEDED,
            rule=None,
            approval=None,
            command=run.command if run is not None else None,
            bytes_up=0,
            bytes_down=0,
            duration_s=recorder.monotonic() - started,
            extra={"qtype": None, "answer": None, "suppressed": count, "limit": limit},
        )
        # Each query was counted in the metrics as it came; a count of others is written whatever the budget.
        recorder.settle(fact, run, counted=True, summary=True)

    def _tick(self) -> None:
        self.flush_summaries()
        self._timer = asyncio.get_running_loop().call_later(self.summary_interval_s, self._tick)


class _UdpDns(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self._server = server
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no DatagramTransport subclass

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        reply = self._server.handle(data, addr, "udp")
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        # An ICMP error for a reply whose client has gone: nothing to do.
        pass


class _TcpDns(asyncio.Protocol):
    """RFC 1035 §4.2.2 / RFC 7766: 2-byte length framing, several queries per connection."""

    def __init__(self, server: DnsServer) -> None:
        self._server = server
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._peer: tuple[str | int, ...] = ("", 0)
        self._idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio's: no isinstance check.
        stream: asyncio.Transport = transport  # type: ignore[assignment]
        self._transport = stream
        if len(self._server._tcp_connections) >= MAX_TCP_CONNECTIONS:
            stream.abort()
            return
        self._server._tcp_connections.add(self)
        self._peer = stream.get_extra_info("peername") or ("", 0)
        stream.set_write_buffer_limits(high=_TCP_WRITE_HIGH_WATER)
        self._arm()

    def _arm(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(TCP_IDLE_TIMEOUT_S, self.close)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        self._buffer += data
        prefix = TCP_LENGTH_PREFIX
        while len(self._buffer) >= prefix:
            length = int.from_bytes(self._buffer[:prefix], "big")
            if len(self._buffer) < prefix + length:
                break
            message = bytes(self._buffer[prefix : prefix + length])
            del self._buffer[: prefix + length]
            reply = self._server.handle(message, self._peer, "tcp")
            if self._transport.is_closing():
                return
            if reply is not None:
                self._transport.write(len(reply).to_bytes(prefix, "big") + reply)
        self._arm()

    def pause_writing(self) -> None:
        # The client is not reading its answers: stop reading its questions.
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._server._tcp_connections.discard(self)
