"""The sandbox-facing DNS server: pure answers and limits, then real UDP/TCP queries from dnslib.

Every integration test ends by checking that the fake upstream DNS heard
nothing: whatever a sandbox puts in a name stops at egressd.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest
from dnslib import EDNS0, QTYPE, RCODE, DNSBuffer, DNSError, DNSLabel, DNSQuestion, DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest
from egressd.audit.log import MemoryAuditSink
from egressd.audit.views import EgressSeen
from egressd.cli.wiring.service import StartupError
from egressd.names.hosts import HostError, normalise_host
from egressd.names.shown import shown_name
from egressd.proxy.core.dns import DnsQueryError, header_reply, query_name, read_query
from egressd.proxy.core.dnsanswer import Plan, pack_reply, plan_answer, unreachable_reason
from egressd.proxy.core.policy import parse_entry
from egressd.proxy.core.runs import Run
from egressd.proxy.net.dnsserver import DnsServer, RateLimiter
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Rcode
from tests.fakes.dns import FakeDns
from tests.harness import egress

ANSWER = IPv4Address("127.0.0.1")
EXFIL = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 50]) + ".exfil.test"  # 253 characters: the most a name has


def query(name: str, qtype: str = "A", **kw: int) -> bytes:
    record = DNSRecord.question(name, qtype)
    for key, value in kw.items():
        setattr(record.header, key, value)
    packed: bytes = record.pack()
    return packed


def raw_query(
    labels: list[bytes], qtype: int = 1, ident: int = 0x1234, counts: tuple[int, int, int, int] = (1, 0, 0, 0)
) -> bytes:
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return struct.pack("!HHHHHH", ident, 0x0100, *counts) + name + struct.pack("!HH", qtype, 1)


# --- the pure part -----------------------------------------------------------------------


def test_a_query_is_read_with_its_normalised_name() -> None:
    q = read_query(query("WWW.Example.TEST."))
    assert q.name == "www.example.test" and q.qtype == QTYPE.A and q.shown == "WWW.Example.TEST"


@pytest.mark.parametrize(
    ("packet", "rcode"),
    [
        pytest.param(b"", None, id="empty"),
        pytest.param(b"\x12\x34\x01\x00\x00", None, id="shorter than a header"),
        pytest.param(query("a.test", qr=1), None, id="a response"),
        pytest.param(query("a.test", opcode=4), Rcode.NOTIMP, id="NOTIFY"),
        pytest.param(query("a.test", opcode=5), Rcode.NOTIMP, id="UPDATE"),
        pytest.param(raw_query([b"a", b"test"], counts=(2, 0, 0, 0)), Rcode.FORMERR, id="two questions announced"),
        pytest.param(struct.pack("!HHHHHH", 1, 0x100, 0, 0, 0, 0), Rcode.FORMERR, id="no question"),
        pytest.param(raw_query([b"a", b"test"], counts=(1, 1, 0, 0)), Rcode.FORMERR, id="an answer in a query"),
        pytest.param(raw_query([b"\xff\xfe", b"test"]), Rcode.FORMERR, id="a label that is not even UTF-8"),
        pytest.param(query("abcdef.test")[:20], Rcode.FORMERR, id="cut inside the name"),
        pytest.param(query("a.test")[:-2], Rcode.FORMERR, id="cut inside the class"),
        pytest.param(
            struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01", Rcode.FORMERR, id="pointer loop"
        ),
        pytest.param(
            b"\x01\x41\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x00\x00\x01\x00\x01",
            Rcode.FORMERR,
            id="question name compressed into the header",
        ),
    ],
)
def test_what_is_not_a_query_is_dropped_or_answered_with_an_error(packet: bytes, rcode: Rcode | None) -> None:
    with pytest.raises(DnsQueryError) as caught:
        read_query(packet)
    assert caught.value.rcode == rcode
    if rcode is None:
        assert caught.value.reply is None
    else:
        reply = DNSRecord.parse(caught.value.reply)
        assert reply.header.rcode == rcode and reply.header.qr == 1
        assert reply.header.id == struct.unpack_from("!H", packet)[0]


@pytest.mark.parametrize(
    "labels",
    [
        pytest.param([b"a b", b"test"], id="space"),
        pytest.param(["caf\u00e9".encode(), b"test"], id="not ASCII"),
        pytest.param([b"a.b", b"test"], id="dot inside a label"),
        pytest.param([b"-a", b"test"], id="leading hyphen"),
        pytest.param([b"x" * 64, b"test"], id="label over 63"),
        pytest.param([], id="the root"),
    ],
)
def test_names_that_are_no_host_have_no_name_and_are_shown_escaped(labels: list[bytes]) -> None:
    q = read_query(raw_query(labels))
    assert q.name is None
    assert q.shown.isprintable() and "/" not in q.shown and "?" not in q.shown


def test_shown_name_escapes_the_way_master_files_do() -> None:
    assert shown_name((b"a b", b"x/y", b"ok")) == "a\\032b.x\\047y.ok"
    assert shown_name(()) == "."


# --- the question parser: its edges, on real packets, and agreement with dnslib ---------------


def _header(ident: int = 0x1234, flags: int = 0x0100, counts: tuple[int, int, int, int] = (1, 0, 0, 0)) -> bytes:
    return struct.pack("!HHHHHH", ident, flags, *counts)


def _formerr_for(packet: bytes) -> DnsQueryError:
    with pytest.raises(DnsQueryError) as caught:
        read_query(packet)
    assert caught.value.rcode is Rcode.FORMERR
    reply = DNSRecord.parse(caught.value.reply)
    assert reply.header.rcode == RCODE.FORMERR and reply.header.id == struct.unpack_from("!H", packet)[0]
    return caught.value


def test_a_label_cut_short_is_formerr() -> None:
    packet = query("abcdef.test")
    for cut in range(13, len(packet)):  # every cut inside the name, the type or the class
        _formerr_for(packet[:cut])
    assert "name" in str(_formerr_for(packet[:15]))  # "\x06ab": the label says 6 octets, 2 follow


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(b"\xc0\x0c", id="the whole name a pointer to itself"),
        pytest.param(b"\x03www\xc0\x0c", id="a pointer after a label, back to the question"),
        pytest.param(b"\x03www\xc0\x40", id="a pointer forwards"),
        pytest.param(b"\x03www\xff\xff", id="a pointer out of the packet"),
    ],
)
def test_a_pointer_in_the_question_name_is_formerr(name: bytes) -> None:
    exc = _formerr_for(_header() + name + struct.pack("!HH", 1, 1) + b"\x00" * 64)
    assert str(exc) == "compressed question name"


def test_a_64_octet_label_reads_but_is_no_host() -> None:
    assert read_query(raw_query([b"x" * 63, b"test"])).name == "x" * 63 + ".test"
    q = read_query(raw_query([b"x" * 64, b"test"]))
    assert q.name is None and q.shown == "x" * 64 + ".test"
    assert plan_answer(q, answer4=ANSWER, answer6=None, unreachable=None).rcode is Rcode.FORMERR


def test_a_name_over_255_octets_reads_but_is_no_host() -> None:
    longest = [b"a" * 63, b"b" * 63, b"c" * 63, b"d" * 61]  # 255 octets on the wire, 253 characters
    assert read_query(raw_query(longest)).name == b".".join(longest).decode()
    q = read_query(raw_query([*longest[:3], b"d" * 62]))  # 256 octets
    assert q.name is None and len(q.question) == 256 + 4
    assert plan_answer(q, answer4=ANSWER, answer6=None, unreachable=None).rcode is Rcode.FORMERR


def _with_edns(packet: bytes) -> bytes:
    record = DNSRecord.parse(packet)
    record.add_ar(EDNS0(udp_len=1232, flags="do"))
    return bytes(record.pack())


def test_an_edns_opt_record_after_the_question_is_ignored() -> None:
    plain = query("origin.test")
    with_opt = _with_edns(plain)
    assert len(with_opt) > len(plain) and struct.unpack_from("!H", with_opt, 10)[0] == 1
    q = read_query(with_opt)
    assert q.question == plain[12:] and q.name == "origin.test"
    reply = DNSRecord.parse(pack_reply(q, Plan(Rcode.NOERROR, ANSWER), 5))
    assert reply.ar == [] and [str(rr.rdata) for rr in reply.rr] == ["127.0.0.1"]
    assert read_query(plain + os.urandom(40)).question == plain[12:]  # whatever follows, it is not read


def test_a_label_holding_a_zero_octet_reads_the_same_every_time() -> None:
    # Its first zero octet is inside a label, so the cached-name fast path cannot apply.
    packet = raw_query([b"a\x00b", b"test"])
    first, second = read_query(packet), read_query(packet)
    assert first == second and first.name is None and first.shown == "a\\000b.test"
    assert first.labels == (b"a\x00b", b"test")


def test_a_name_read_before_reads_the_same_with_another_id_type_and_case() -> None:
    read_query(query("cached.test"))
    q = read_query(raw_query([b"cached", b"test"], qtype=28, ident=7))
    assert (q.ident, q.qtype, q.name, q.question[-4:]) == (7, 28, "cached.test", b"\x00\x1c\x00\x01")
    assert read_query(query("CaChEd.test")).shown == "CaChEd.test"


def test_the_questions_kept_are_bounded_in_number_and_size(monkeypatch) -> None:
    from egressd.proxy.core import dns

    monkeypatch.setattr(dns, "_QUESTIONS", {})
    monkeypatch.setattr(dns, "_MAX_QUESTIONS_CACHED", 3)
    too_long = raw_query([b"a" * 63] * 5)  # 321 octets of name: read, never kept
    assert read_query(too_long).name is None and dns._QUESTIONS == {}
    for i in range(7):
        read_query(query(f"n{i}.test"))
        assert 1 <= len(dns._QUESTIONS) <= 3
    assert bytes(query("n6.test")[2:]) in dns._QUESTIONS  # the header but its id, and the question


def test_query_types_are_named_as_dnslib_names_them() -> None:
    assert [read_query(query("t.test", qtype)).qtype_text for qtype in ("A", "AAAA", "HTTPS", "ANY")] == [
        "A",
        "AAAA",
        "HTTPS",
        "ANY",
    ]
    assert read_query(raw_query([b"t"], qtype=65280)).qtype_text == "TYPE65280"


def _as_dnslib_read_it(packet: bytes) -> tuple:
    """What read_query answered when dnslib decoded the question (the reference)."""
    if len(packet) < 12:
        return ("error", None, None)
    ident, flags, qdcount, ancount, nscount, _ = struct.unpack_from("!HHHHHH", packet)
    if flags & 0x8000:
        return ("error", None, None)
    if flags & 0x7800:
        return ("error", Rcode.NOTIMP, header_reply(packet, Rcode.NOTIMP))
    formerr = ("error", Rcode.FORMERR, header_reply(packet, Rcode.FORMERR))
    if qdcount != 1 or ancount or nscount:
        return formerr
    buffer = DNSBuffer(packet)
    buffer.offset = 12
    try:
        question = DNSQuestion.parse(buffer)
    except (DNSError, ValueError, IndexError, struct.error):
        return formerr
    labels = tuple(question.qname.label)
    wire = b"".join(bytes((len(label),)) + label for label in labels) + b"\x00"
    if packet[12 : 12 + len(wire)] != wire:
        return formerr
    try:
        name = query_name(labels)
    except HostError:
        name = None
    query = (ident, flags, packet[12 : 12 + len(wire) + 4], name, labels, question.qtype, question.qclass)
    return ("query", *query, shown_name(labels), str(QTYPE[question.qtype]))


def _as_read_now(packet: bytes) -> tuple:
    try:
        q = read_query(packet)
    except DnsQueryError as exc:
        return ("error", exc.rcode, exc.reply)
    return ("query", q.ident, q.flags, q.question, q.name, q.labels, q.qtype, q.qclass, q.shown, q.qtype_text)


_length_octets = st.one_of(
    st.integers(1, 63), st.sampled_from([0, 64, 100, 191, 0x40, 0x80, 0xBF, 0xC0, 0xC1, 0xFF]), st.integers(0, 255)
)
_label_bodies = st.one_of(
    st.binary(max_size=70),
    st.text("abcXYZ09-_.", max_size=70).map(str.encode),
    st.text(max_size=20).map(str.encode),  # UTF-8, not ASCII
)


@st.composite
def _questions(draw: st.DrawFn) -> bytes:
    flags = draw(st.sampled_from([0x0100, 0x0000, 0x0110, 0x8100, 0x2100]))
    counts = draw(st.sampled_from([(1, 0, 0, 0), (1, 0, 0, 1), (1, 0, 0, 0), (2, 0, 0, 0), (1, 1, 0, 0)]))
    name = b""
    for length, body in draw(st.lists(st.tuples(_length_octets, _label_bodies), max_size=6)):
        name += bytes([length]) + (body * (length // max(len(body), 1) + 1))[:length]
    if draw(st.booleans()):
        name += b"\x00"
    packet = _header(draw(st.integers(0, 0xFFFF)), flags, counts) + name + draw(st.binary(max_size=8))
    return packet[: draw(st.integers(0, len(packet)))] if draw(st.booleans()) else packet


@settings(max_examples=1500, deadline=None)
@given(st.one_of(_questions(), st.binary(max_size=80), st.binary(max_size=600)))
def test_the_parser_reads_every_packet_as_dnslib_did(packet: bytes) -> None:
    assert _as_read_now(packet) == _as_dnslib_read_it(packet)
    assert _as_read_now(packet) == _as_dnslib_read_it(packet)  # again, now that the name may be cached


_UNSUPPORTED = Plan(Rcode.REFUSED, reason=Reason.UNSUPPORTED_QUERY)
PLANS = [
    ("A", None, None, Plan(Rcode.NOERROR, ANSWER)),
    ("AAAA", None, None, Plan(Rcode.NOERROR, reason=Reason.EMPTY_ANSWER)),
    ("AAAA", IPv6Address("fd00::1"), None, Plan(Rcode.NOERROR, IPv6Address("fd00::1"))),
    ("TXT", None, None, _UNSUPPORTED),
    ("MX", None, None, _UNSUPPORTED),
    ("ANY", None, None, _UNSUPPORTED),
    ("NULL", None, None, _UNSUPPORTED),
    ("A", None, Reason.DENYLISTED, Plan(Rcode.NXDOMAIN, reason=Reason.DENYLISTED)),
    ("AAAA", None, Reason.NOT_ALLOWLISTED, Plan(Rcode.NXDOMAIN, reason=Reason.NOT_ALLOWLISTED)),
    ("TXT", None, Reason.DENYLISTED, _UNSUPPORTED),
]


@pytest.mark.parametrize(("qtype", "answer6", "unreachable", "expected"), PLANS)
def test_the_answer_plan_for_each_type(qtype, answer6, unreachable, expected) -> None:
    plan = plan_answer(read_query(query("a.test", qtype)), answer4=ANSWER, answer6=answer6, unreachable=unreachable)
    assert plan == expected
    # Every deny names its reason; an empty AAAA answer (NODATA) refuses nothing.
    assert plan.decision == ("deny" if expected.reason else "allow")


def test_a_class_other_than_in_is_refused() -> None:
    record = DNSRecord.question("version.bind", "A", "CH")
    plan = plan_answer(read_query(record.pack()), answer4=ANSWER, answer6=None, unreachable=None)
    assert plan.rcode is Rcode.REFUSED


def test_a_malformed_name_is_formerr() -> None:
    plan = plan_answer(read_query(raw_query([b"a b"])), answer4=ANSWER, answer6=None, unreachable=None)
    assert plan == Plan(Rcode.FORMERR, reason=Reason.BAD_REQUEST)


def _run(allow=(), deny=(), ask=True) -> Run:
    return Run(
        id="r", token="t", task=None, allow=tuple(map(parse_entry, allow)), deny=tuple(map(parse_entry, deny)), ask=ask
    )


@pytest.mark.parametrize(
    ("run", "name", "reason"),
    [
        (_run(allow=["ok.test"]), "ok.test", None),
        (_run(allow=["ok.test:8443"], ask=False), "ok.test", None),  # allowed on another port
        (_run(), "new.test", None),  # a person may still be asked
        (_run(ask=False), "new.test", Reason.NOT_ALLOWLISTED),
        (_run(allow=["*.example.test"], deny=["bad.example.test"]), "bad.example.test", Reason.DENYLISTED),
        (_run(), "10.0.0.1", Reason.IP_LITERAL),
    ],
)
def test_strict_mode_unreachable_names(run: Run, name: str, reason: Reason | None) -> None:
    assert unreachable_reason(run, name)[0] == reason


def test_a_name_denied_earlier_is_unreachable_for_the_rest_of_the_run() -> None:
    run = _run()
    run.deny_host("gone.test")
    assert unreachable_reason(run, "gone.test")[0] is Reason.DENIED_EARLIER


def test_rate_limiter_allows_a_burst_then_the_rate() -> None:
    limiter = RateLimiter(rate=10, burst=5)
    assert [limiter.allow("a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert limiter.allow("b", 0.0)  # another client has its own bucket
    assert not limiter.allow("a", 0.05)  # half a token
    assert limiter.allow("a", 0.1)
    assert [limiter.allow("a", 100.0) for _ in range(6)] == [True] * 5 + [False]  # never more than the burst


def test_rate_limiter_forgets_the_least_recent_client_past_its_cap() -> None:
    limiter = RateLimiter(rate=1, burst=1, max_keys=2)
    assert limiter.allow("a", 0) and limiter.allow("b", 0) and limiter.allow("c", 0)
    assert limiter.allow("a", 0)  # forgotten, so a full bucket again
    assert not limiter.allow("c", 0)


_wire_labels = st.lists(st.binary(min_size=1, max_size=63), max_size=6)


@settings(max_examples=500, deadline=None)
@given(_wire_labels)
def test_any_labels_give_a_host_or_host_error(labels: list[bytes]) -> None:
    try:
        name = query_name(labels)
    except HostError:
        return
    assert normalise_host(name) == name  # already canonical
    assert query_name(name.encode().split(b".")) == name


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.from_regex(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,30}[A-Za-z0-9_])?", fullmatch=True), min_size=1, max_size=4)
)
def test_well_formed_names_survive_the_wire(labels: list[str]) -> None:
    name = ".".join([*labels, "Test"])  # a numeric last label would make an IP literal
    q = read_query(query(name))
    assert q.name == name.lower() and q.shown == name


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_any_packet_is_a_query_or_our_error(packet: bytes) -> None:
    try:
        q = read_query(packet)
    except DnsQueryError as exc:
        assert exc.reply is None or DNSRecord.parse(exc.reply).header.qr == 1
        return
    plan_answer(q, answer4=ANSWER, answer6=None, unreachable=None)


# --- real queries ----------------------------------------------------------------------------


def _exchange(server: tuple[str, int], packet: bytes, *, tcp: bool, source: str, timeout_s: float) -> bytes | None:
    kind = socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        try:
            if tcp:
                sock.connect(server)
                sock.sendall(len(packet).to_bytes(2, "big") + packet)
                length = int.from_bytes(_read_exactly(sock, 2), "big")
                return _read_exactly(sock, length)
            sock.sendto(packet, server)
            return sock.recv(65535)
        except (TimeoutError, ConnectionError, EOFError):
            return None


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


async def exchange(
    server, packet: bytes, *, tcp: bool = False, source: str = "127.0.0.1", timeout_s: float = 3.0
) -> DNSRecord | None:
    data = await asyncio.to_thread(_exchange, server, packet, tcp=tcp, source=source, timeout_s=timeout_s)
    return None if data is None else DNSRecord.parse(data)


async def ask(svc, name: str, qtype: str = "A", *, tcp: bool = False, source: str = "127.0.0.1") -> DNSRecord:
    reply = await exchange(svc.dns.address, query(name, qtype), tcp=tcp, source=source)
    assert reply is not None
    return reply


async def dnslib_ask(svc, name: str, qtype: str = "A", *, tcp: bool = False) -> DNSRecord:
    """Through dnslib's own client (a blocking socket, so in a thread)."""
    host, port = svc.dns.address
    data = await asyncio.to_thread(DNSRecord.question(name, qtype).send, host, port, tcp=tcp, timeout=3)
    return DNSRecord.parse(data)


def dns_records(svc) -> list[dict]:
    return [r for r in egress(svc) if r["kind"] == "dns"]


@pytest.fixture
async def dns_egressd(make_egressd):
    async def make(**values):
        values.setdefault("dns_listen", "127.0.0.1:0")
        values.setdefault("transparent_tls", "127.0.0.1:0")
        return await make_egressd(**values)

    return make


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
async def test_an_a_query_is_answered_with_egressd_and_recorded(dns_egressd, dns: FakeDns, tcp: bool) -> None:
    svc = await dns_egressd(allow=["origin.test"])
    reply = await dnslib_ask(svc, "origin.test", "A", tcp=tcp)
    assert reply.header.rcode == RCODE.NOERROR and reply.header.ra == 1
    assert [(str(rr.rname), rr.rtype, str(rr.rdata), rr.ttl) for rr in reply.rr] == [
        ("origin.test.", QTYPE.A, "127.0.0.1", 5)
    ]
    [record] = dns_records(svc)
    assert record["host"] == "origin.test" and record["port"] is None and record["run"] == "default"
    assert record["decision"] == "allow" and record["reason"] is None
    assert record["qtype"] == "A" and record["answer"] == "127.0.0.1"
    assert record["transport"] == ("tcp" if tcp else "udp")
    assert record["client"].startswith("127.0.0.1:")
    assert dns.queries == []


async def test_the_question_is_echoed_as_asked(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd()
    reply = await ask(svc, "OrIgIn.TeSt")  # 0x20 randomisation survives
    assert str(reply.q.qname) == "OrIgIn.TeSt." and str(reply.rr[0].rname) == "OrIgIn.TeSt."
    assert dns_records(svc)[0]["host"] == "origin.test"


async def test_aaaa_is_empty_noerror_unless_an_ipv6_answer_is_set(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd()
    reply = await ask(svc, "origin.test", "AAAA")
    assert reply.header.rcode == RCODE.NOERROR and reply.rr == []
    record = dns_records(svc)[0]
    # DESIGN.md: not egressd's address, so deny, now with a reason (issue 16: the reason was null,
    # and ``egressd run`` printed it as a refusal; audit.views tells it explains no failure).
    assert (record["decision"], record["reason"], record["answer"], record["qtype"]) == (
        "deny",
        "empty_answer",
        "NOERROR",
        "AAAA",
    )
    assert not EgressSeen.of(record).is_refusal

    svc6 = await dns_egressd(dns_answer6="fd00::53")
    reply = await ask(svc6, "origin.test", "AAAA", tcp=True)
    assert [str(rr.rdata) for rr in reply.rr] == ["fd00::53"] and reply.rr[0].rtype == QTYPE.AAAA
    assert dns_records(svc6)[0]["decision"] == "allow"
    assert dns.queries == []


@pytest.mark.parametrize("qtype", ["TXT", "MX", "SRV", "ANY", "NULL", "PTR", "CNAME", "NS", "SOA", "HTTPS"])
async def test_every_other_type_is_refused(dns_egressd, dns: FakeDns, qtype: str) -> None:
    svc = await dns_egressd()
    reply = await ask(svc, "origin.test", qtype)
    assert reply.header.rcode == RCODE.REFUSED and reply.rr == []
    record = dns_records(svc)[0]
    assert (record["decision"], record["answer"], record["qtype"]) == ("deny", "REFUSED", qtype)
    assert record["reason"] == "unsupported_query"
    assert dns.queries == []


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
async def test_exfiltration_labels_never_reach_upstream(dns_egressd, dns: FakeDns, tcp: bool) -> None:
    svc = await dns_egressd()
    for qtype in ("A", "AAAA", "TXT", "NULL"):
        await ask(svc, EXFIL, qtype, tcp=tcp)
    secret = os.urandom(30).hex()
    await ask(svc, f"{secret}.leak.test", tcp=tcp)
    assert dns.queries == [] and not dns.asked("leak.test")
    hosts = {r["host"] for r in dns_records(svc)}
    assert hosts == {EXFIL, f"{secret}.leak.test"}


async def test_garbage_and_truncated_packets_get_formerr_or_nothing(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd()
    server = svc.dns.address
    packets = [b"", b"\x00" * 5, os.urandom(7), query("abcdef.test")[:20], query("a.test", qr=1), os.urandom(300)]
    for packet in packets:
        reply = await exchange(server, packet, timeout_s=0.3)
        assert reply is None or reply.header.rcode in (RCODE.FORMERR, RCODE.NOTIMP, RCODE.REFUSED)
    bad_name = await exchange(server, raw_query([b"bad name", b"test"]))
    assert bad_name is not None and bad_name.header.rcode == RCODE.FORMERR
    # ... and it still answers afterwards.
    assert (await ask(svc, "origin.test")).header.rcode == RCODE.NOERROR
    records = dns_records(svc)
    assert any(
        r["host"] == "bad\\032name.test" and r["reason"] == "bad_request" and r["answer"] == "FORMERR" for r in records
    )
    assert all(r["decision"] == "deny" for r in records[:-1])
    assert dns.queries == []


async def test_tcp_carries_several_queries_and_survives_bad_framing(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd()
    reader, writer = await asyncio.open_connection(*svc.dns.address)
    first, second = query("one.test"), query("two.test", "AAAA")
    writer.write(len(first).to_bytes(2, "big") + first + len(second).to_bytes(2, "big") + second)
    await writer.drain()
    answers = []
    for _ in range(2):
        length = int.from_bytes(await reader.readexactly(2), "big")
        answers.append(DNSRecord.parse(await reader.readexactly(length)))
    assert [str(a.q.qname) for a in answers] == ["one.test.", "two.test."]
    junk = os.urandom(3)
    writer.write(len(junk).to_bytes(2, "big") + junk)  # no header: dropped, connection stays
    writer.write(len(first).to_bytes(2, "big") + first)
    await writer.drain()
    length = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), 3), "big")
    assert str(DNSRecord.parse(await reader.readexactly(length)).q.qname) == "one.test."
    writer.close()
    assert dns.queries == []


async def test_strict_mode_answers_nxdomain_for_names_the_run_can_never_reach(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd(
        allow=["origin.test", "*.example.test"], deny=["bad.example.test"], dns_strict=True, ask=False
    )
    expected = {
        "origin.test": (RCODE.NOERROR, "allow", None),
        "sub.example.test": (RCODE.NOERROR, "allow", None),
        "bad.example.test": (RCODE.NXDOMAIN, "deny", "denylisted"),
        "elsewhere.test": (RCODE.NXDOMAIN, "deny", "not_allowlisted"),
        "10.1.2.3": (RCODE.NXDOMAIN, "deny", "ip_literal"),
    }
    for name, (rcode, decision, reason) in expected.items():
        reply = await ask(svc, name)
        assert reply.header.rcode == rcode, name
        record = dns_records(svc)[-1]
        assert (record["decision"], record["reason"]) == (decision, reason), name
    assert dns_records(svc)[0]["rule"] == "origin.test"
    assert dns.queries == []


async def test_strict_mode_still_answers_names_a_person_could_allow(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd(dns_strict=True)
    assert (await ask(svc, "unknown.test")).header.rcode == RCODE.NOERROR
    svc.default_run.deny_host("unknown.test")  # a person said no: it sticks
    assert (await ask(svc, "unknown.test")).header.rcode == RCODE.NXDOMAIN
    assert dns_records(svc)[-1]["reason"] == "denied_earlier"


class RecordingApprover:
    def __init__(self) -> None:
        self.asked: list[ApprovalRequest] = []

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        self.asked.append(request)
        raise AssertionError("a DNS query must never ask anyone")


async def test_a_query_never_triggers_an_approval(dns_egressd, dns: FakeDns) -> None:
    approver = RecordingApprover()
    svc = await dns_egressd(approver=approver, dns_strict=True)
    for qtype in ("A", "AAAA"):
        await ask(svc, "never-asked.test", qtype)
    assert approver.asked == [] and dns.queries == []


async def test_sources_are_attributed_to_their_run_and_unbound_ones_refused(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd(require_auth=True)
    run = svc.runs.create(task="t", allow=[], sources=[ip_address("127.0.0.5")])
    run.command = "make"
    bound = await ask(svc, "origin.test", source="127.0.0.5")
    assert bound.header.rcode == RCODE.NOERROR
    unbound = await ask(svc, "origin.test", source="127.0.0.6")
    assert unbound.header.rcode == RCODE.REFUSED and unbound.rr == []
    bound_record, unbound_record = dns_records(svc)
    assert (bound_record["run"], bound_record["command"], bound_record["decision"]) == (run.id, "make", "allow")
    assert (unbound_record["run"], unbound_record["reason"], unbound_record["answer"]) == (
        None,
        "auth_required",
        "REFUSED",
    )
    assert [e["host"] for e in run.events_after(0)[0]] == ["origin.test"]
    assert dns.queries == []


async def test_an_unwritable_audit_log_refuses_queries(dns_egressd, dns: FakeDns) -> None:
    sink = MemoryAuditSink(fail_after=1)  # run.start, then the disk is full
    svc = await dns_egressd(audit=sink)
    await ask(svc, "origin.test")  # its record cannot be written: the sink turns unhealthy
    assert not sink.healthy
    reply = await ask(svc, "origin.test")
    assert reply.header.rcode == RCODE.REFUSED and reply.rr == []


async def test_the_answer_defaults_to_the_transparent_listeners_host(make_egressd, dns: FakeDns) -> None:
    svc = await make_egressd(dns_listen="127.0.0.1:0", transparent_http="127.0.0.9:0")
    assert svc.dns.answer4 == IPv4Address("127.0.0.9")
    assert (IPv4Address("127.0.0.9"), svc.transparent_http.address[1]) in svc.path.screen.own.pairs
    svc2 = await make_egressd(dns_listen="127.0.0.1:0", dns_answer="127.0.0.10")
    assert svc2.dns.answer4 == IPv4Address("127.0.0.10")
    assert (IPv4Address("127.0.0.10"), 443) in svc2.path.screen.own.pairs


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dns_answer": "::1"}, "bad setting dns_answer: ::1 is not an IPv4 address"),
        ({"dns_answer6": "127.0.0.1"}, "bad setting dns_answer6"),
        ({"transparent_tls": "127.0.0.1:0", "transparent_http": "127.0.0.2:0"}, "different hosts"),
        ({"transparent_tls": "0.0.0.0:0"}, "set dns_answer"),
    ],
)
async def test_a_dns_answer_that_cannot_work_stops_start_up(make_egressd, values, message: str) -> None:
    with pytest.raises(StartupError, match=message):
        await make_egressd(dns_listen="127.0.0.1:0", **values)


# --- limits: the rate per client and the names recorded per run ---------------------------------


async def _small_server(svc, **kw) -> DnsServer:
    server = DnsServer(recorder=svc.path.recorder, runs=svc.runs, answer4=ANSWER, **kw)
    await server.start("127.0.0.1", 0)
    return server


async def test_the_question_is_echoed_byte_for_byte_with_0x20_case(make_egressd, dns: FakeDns) -> None:
    svc = await make_egressd()
    server = DnsServer(recorder=svc.path.recorder, runs=svc.runs, answer4=ANSWER, answer6=IPv6Address("fd00::53"))
    for qtype in ("A", "AAAA", "TXT"):
        packet = query("oRiGiN.ExAmPlE.tEsT", qtype, id=0xBEEF)
        reply = server.handle(packet, ("127.0.0.1", 5300), "udp")
        assert reply is not None and reply[:2] == b"\xbe\xef"
        assert reply[12 : len(packet)] == packet[12:]  # the question, exactly as asked
    assert {r["host"] for r in dns_records(svc)} == {"origin.example.test"}
    assert dns.queries == []


@pytest.mark.parametrize(
    "packet",
    [
        pytest.param(raw_query([b"x" * 64, b"test"]), id="a 64-octet label"),
        pytest.param(raw_query([b"a" * 63, b"b" * 63, b"c" * 63, b"d" * 62]), id="a 256-octet name"),
        pytest.param(raw_query([b"a\x00b", b"test"]), id="a zero octet in a label"),
    ],
)
async def test_names_dns_cannot_carry_are_formerr_and_recorded_as_shown(make_egressd, dns: FakeDns, packet) -> None:
    svc = await make_egressd()
    server = DnsServer(recorder=svc.path.recorder, runs=svc.runs, answer4=ANSWER)
    reply = DNSRecord.parse(server.handle(packet, ("127.0.0.1", 5300), "udp"))
    assert reply.header.rcode == RCODE.FORMERR and reply.rr == [] and reply.header.q == 1
    [record] = dns_records(svc)
    assert record["host"] == read_query(packet).shown and record["run"] == "default"
    assert (record["decision"], record["reason"], record["answer"], record["qtype"]) == (
        "deny",
        "bad_request",
        "FORMERR",
        "A",
    )


async def test_the_server_answers_and_records_as_the_pure_functions_say(make_egressd, dns: FakeDns) -> None:
    # Every record is checked: no refusal budget (``egressd.proxy.core.floods``) in the way.
    svc = await make_egressd(allow=["ok.test"], deny=["bad.test"], ask=False, max_refusal_records=1_000_000)
    plain = DnsServer(recorder=svc.path.recorder, runs=svc.runs, answer4=ANSWER, ttl_s=7)
    strict = DnsServer(
        recorder=svc.path.recorder, runs=svc.runs, answer4=ANSWER, answer6=IPv6Address("fd00::1"), strict=True
    )
    packets = [
        query(name, qtype, rd=rd)
        for name in ("ok.test", "OK.test", "bad.test", "other.test")
        for qtype in ("A", "AAAA", "TXT", "ANY")
        for rd in (0, 1)
    ] + [raw_query([b"bad name"]), DNSRecord.question("ok.test", "A", "CH").pack()]
    for server in (plain, strict, plain, strict):  # twice: the second time from the kept outcomes
        for packet in packets:
            reply = server.handle(packet, ("127.0.0.1", 5300), "udp")
            q = read_query(packet)
            unreachable = unreachable_reason(svc.default_run, q.name)[0] if server.strict and q.name else None
            plan = plan_answer(q, answer4=server.answer4, answer6=server.answer6, unreachable=unreachable)
            assert reply == pack_reply(q, plan, server.ttl_s)
            record = dns_records(svc)[-1]
            assert (record["decision"], record["answer"], record["qtype"]) == (
                plan.decision,
                plan.answer_text,
                q.qtype_text,
            )
            assert record["reason"] == (plan.reason.value if plan.reason else None)
            assert list(record)[-3:] == ["qtype", "answer", "transport"]
    assert dns.queries == []


async def test_a_query_that_breaks_the_server_is_unanswered_and_still_recorded(
    make_egressd, dns: FakeDns, monkeypatch, caplog
) -> None:
    svc = await make_egressd()
    server = DnsServer(recorder=svc.path.recorder, runs=svc.runs, answer4=ANSWER)

    def broken(*args: object) -> None:
        raise RuntimeError("attribution broke")

    monkeypatch.setattr(svc.runs, "attribute_text", broken)
    with caplog.at_level("ERROR", logger="egressd.dns"):
        assert server.handle(query("origin.test", "AAAA"), ("127.0.0.1", 5300), "tcp") is None  # fail closed
    [record] = dns_records(svc)
    assert (record["host"], record["run"], record["decision"], record["reason"]) == (
        "origin.test",
        None,
        "deny",
        "bad_request",
    )
    assert {k: record[k] for k in ("qtype", "answer", "transport")} == {
        "qtype": "AAAA",
        "answer": None,
        "transport": "tcp",
    }
    assert "attribution broke" in caplog.text


async def test_an_edns_query_is_answered_through_the_server(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd()
    reply = await exchange(svc.dns.address, _with_edns(query("origin.test")))
    assert reply is not None and reply.header.rcode == RCODE.NOERROR
    assert [str(rr.rdata) for rr in reply.rr] == ["127.0.0.1"] and reply.ar == []
    assert dns.queries == []


async def test_a_flood_from_one_client_is_dropped_and_summarised(make_egressd, dns: FakeDns) -> None:
    svc = await make_egressd()
    server = await _small_server(svc, rate_qps=0.001, burst=5)
    try:
        replies = [await exchange(server.address, query(f"n{i}.test"), timeout_s=0.3) for i in range(8)]
        assert [r is not None for r in replies] == [True] * 5 + [False] * 3
        other = await exchange(server.address, query("x.test"), source="127.0.0.7")
        assert other is not None  # another client has its own bucket
        assert len(dns_records(svc)) == 6
        server.flush_summaries()
        summary = dns_records(svc)[-1]
        assert summary["host"] is None and summary["client"] == "127.0.0.1" and summary["run"] == "default"
        assert (summary["decision"], summary["reason"]) == ("deny", "limit_exceeded")
        assert (summary["suppressed"], summary["limit"]) == (3, "rate_per_client")
        server.flush_summaries()
        assert len(dns_records(svc)) == 7  # nothing new to summarise
    finally:
        await server.close()
    assert dns.queries == []


async def test_names_past_the_per_run_cap_are_answered_but_only_counted(make_egressd, dns: FakeDns) -> None:
    svc = await make_egressd()
    server = await _small_server(svc, max_names_per_run=3)
    try:
        for i in range(6):
            reply = await exchange(server.address, query(f"{i}.{EXFIL[:200]}"))
            assert reply is not None and str(reply.rr[0].rdata) == "127.0.0.1"
        again = await exchange(server.address, query(f"0.{EXFIL[:200]}", "AAAA"))
        assert again is not None
        records = dns_records(svc)
        assert [r["host"][:2] for r in records] == ["0.", "1.", "2.", "0."]  # a name already recorded still is
    finally:
        await server.close()  # writes the summary
    summary = dns_records(svc)[-1]
    assert (summary["suppressed"], summary["limit"], summary["run"], summary["client"]) == (
        3,
        "names_per_run",
        "default",
        None,
    )
    assert dns.queries == []


async def test_the_name_cap_is_per_run_when_runs_take_turns(make_egressd, dns: FakeDns) -> None:
    svc = await make_egressd()
    other = svc.runs.create(task="t", allow=[], sources=[ip_address("127.0.0.5")])
    server = DnsServer(recorder=svc.path.recorder, runs=svc.runs, answer4=ANSWER, max_names_per_run=2)
    for i in range(4):
        for source in ("127.0.0.1", "127.0.0.5"):
            assert server.handle(query(f"n{i}.test"), (source, 5300), "udp") is not None
    assert [(r["run"], r["host"]) for r in dns_records(svc)] == [
        ("default", "n0.test"),
        (other.id, "n0.test"),
        ("default", "n1.test"),
        (other.id, "n1.test"),
    ]
    server.flush_summaries()
    assert sorted((r["run"], r["suppressed"]) for r in dns_records(svc) if r.get("limit")) == sorted(
        [("default", 2), (other.id, 2)]
    )


async def test_summaries_are_written_on_a_timer(make_egressd, dns: FakeDns) -> None:
    svc = await make_egressd()
    server = await _small_server(svc, rate_qps=0.001, burst=1, summary_interval_s=0.3)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(3):
                sock.sendto(query("t.test"), server.address)
        for _ in range(100):
            if any(r.get("limit") == "rate_per_client" for r in dns_records(svc)):
                break
            await asyncio.sleep(0.02)
        assert [r["suppressed"] for r in dns_records(svc) if r.get("limit")] == [2]
    finally:
        await server.close()


async def test_too_many_tcp_connections_are_closed(make_egressd, dns: FakeDns, monkeypatch) -> None:
    from egressd.proxy.net import dnsserver

    monkeypatch.setattr(dnsserver, "MAX_TCP_CONNECTIONS", 2)
    svc = await make_egressd()
    server = await _small_server(svc)
    try:
        conns = [await asyncio.open_connection(*server.address) for _ in range(3)]
        assert await asyncio.wait_for(conns[2][0].read(), 3) == b""  # the third is closed at once
        packet = query("ok.test")
        conns[0][1].write(len(packet).to_bytes(2, "big") + packet)
        assert len(await asyncio.wait_for(conns[0][0].readexactly(2), 3)) == 2
        for _, writer in conns:
            writer.close()
    finally:
        await server.close()


async def test_a_label_as_long_as_dns_allows_round_trips(dns_egressd, dns: FakeDns) -> None:
    svc = await dns_egressd()
    reply = await ask(svc, EXFIL, tcp=False)
    assert reply.header.rcode == RCODE.NOERROR and len(str(DNSLabel(reply.q.qname))) == 254
