"""The DNS codec and the answer planning, bytes only: packets dnslib builds as the reference, and hostile ones.

``egressd.proxy.core.dns`` reads a sandbox's queries and packs our replies,
and builds and reads the resolver's upstream messages;
``egressd.proxy.core.dnsanswer`` decides what a query is answered. No socket
here: every test hands over bytes and checks the bytes or values that come back.
"""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv6Address

import pytest
from dnslib import CNAME, QTYPE, RCODE, RR, SOA, A, DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.names.hosts import HostError
from egressd.proxy.core import dns
from egressd.proxy.core.dns import (
    MAX_CNAME_HOPS,
    MAX_NAME_OCTETS,
    UDP_REPLY_OCTETS,
    DnsQueryError,
    ReplyTemplate,
    ResolveError,
    accept_reply,
    build_query,
    header_reply,
    qtype_text,
    query_name,
    read_answer,
    read_query,
    same_name,
)
from egressd.proxy.core.dnsanswer import Answers, Plan, PreparedReply, pack_reply, plan_answer, refused
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Rcode

ANSWER4 = IPv4Address("10.0.0.1")
ANSWER6 = IPv6Address("fd00::53")


def dnslib_query(name: str, qtype: str = "A", qclass: str = "IN", ident: int = 0x1234, rd: int = 1) -> bytes:
    """The reference: a query as dnslib packs it."""
    record = DNSRecord.question(name, qtype, qclass)
    record.header.id = ident
    record.header.rd = rd
    return bytes(record.pack())


def header(ident: int = 0x1234, flags: int = 0x0100, counts: tuple[int, int, int, int] = (1, 0, 0, 0)) -> bytes:
    return struct.pack("!HHHHHH", ident, flags, *counts)


def wire_name(*labels: bytes) -> bytes:
    return b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"


def question(*labels: bytes, qtype: int = 1, qclass: int = 1) -> bytes:
    return wire_name(*labels) + struct.pack("!HH", qtype, qclass)


def refusal(packet: bytes) -> DnsQueryError:
    with pytest.raises(DnsQueryError) as caught:
        read_query(packet)
    return caught.value


# --- reading a sandbox's query --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "qtype", "qclass"),
    [
        ("origin.test", "A", "IN"),
        ("Mixed.CASE.Test", "AAAA", "IN"),
        ("_dmarc.example.test", "TXT", "IN"),
        ("x.test", "ANY", "IN"),
        ("x.test", "A", "CH"),
        ("a" * 63 + ".test", "HTTPS", "IN"),
    ],
)
def test_a_query_dnslib_packs_reads_as_dnslib_reads_it(name: str, qtype: str, qclass: str) -> None:
    packet = dnslib_query(name, qtype, qclass, ident=0xBEEF)
    reference = DNSRecord.parse(packet)
    q = read_query(packet)
    assert (q.ident, q.qtype, q.qclass) == (0xBEEF, reference.q.qtype, reference.q.qclass)
    assert q.labels == tuple(reference.q.qname.label)
    assert q.name == name.lower() and q.shown == name
    assert q.question == packet[12:] and q.qtype_text == qtype


def test_every_cut_of_a_query_is_dropped_or_formerr_never_anything_else() -> None:
    packet = dnslib_query("cut.example.test", "AAAA")
    for cut in range(len(packet)):
        exc = refusal(packet[:cut])
        if cut < 12:
            assert exc.reply is None and exc.rcode is None  # no header: nothing to answer
        else:
            assert exc.rcode is Rcode.FORMERR
            assert exc.reply == header_reply(packet[:cut], Rcode.FORMERR)
            assert DNSRecord.parse(exc.reply).header.id == 0x1234


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(b"\xc0\x0c", id="a pointer to itself: a loop"),
        pytest.param(b"\x01a\xc0\x0c", id="a label, then a pointer back to it: a loop"),
        pytest.param(b"\xc0\x00", id="a pointer into the header"),
        pytest.param(b"\x01a\xff\xff", id="a pointer out of the packet"),
    ],
)
def test_a_compressed_question_name_is_formerr_whatever_it_points_at(name: bytes) -> None:
    exc = refusal(header() + name + struct.pack("!HH", 1, 1))
    assert (str(exc), exc.rcode) == ("compressed question name", Rcode.FORMERR)


@pytest.mark.parametrize(
    ("labels", "why"),
    [
        pytest.param((b"x" * 64, b"test"), "a 64-octet label", id="label over 63"),
        pytest.param((b"a" * 63, b"b" * 63, b"c" * 63, b"d" * 62), "256 octets", id="name over 255"),
        pytest.param((b"y" * 191,), "the longest length octet", id="label of 191"),
    ],
)
def test_an_oversized_name_reads_but_is_no_host(labels: tuple[bytes, ...], why: str) -> None:
    q = read_query(header() + question(*labels))
    assert q.name is None and q.labels == labels, why
    assert plan_answer(q, answer4=ANSWER4, answer6=None, unreachable=None) == refused(Reason.BAD_REQUEST)


def test_the_longest_name_is_a_host_and_one_octet_more_is_not() -> None:
    longest = (b"a" * 63, b"b" * 63, b"c" * 63, b"d" * 61)
    assert len(wire_name(*longest)) == MAX_NAME_OCTETS
    assert read_query(header() + question(*longest)).name == b".".join(longest).decode()
    assert read_query(header() + question(*longest[:3], b"d" * 62)).name is None


@pytest.mark.parametrize(
    "counts",
    [
        pytest.param((0, 0, 0, 0), id="no question"),
        pytest.param((2, 0, 0, 0), id="two questions"),
        pytest.param((65535, 0, 0, 0), id="65535 questions"),
        pytest.param((1, 1, 0, 0), id="an answer in a query"),
        pytest.param((1, 0, 1, 0), id="an authority record in a query"),
    ],
)
def test_wrong_counts_are_formerr(counts: tuple[int, int, int, int]) -> None:
    exc = refusal(header(counts=counts) + question(b"ok", b"test"))
    assert (str(exc), exc.rcode) == ("not exactly one question", Rcode.FORMERR)


def test_additional_records_announced_but_absent_are_not_read() -> None:
    # What follows the question is never decoded (an EDNS OPT record, say).
    q = read_query(header(counts=(1, 0, 0, 9)) + question(b"ok", b"test"))
    assert q.name == "ok.test"


def test_a_response_is_dropped_and_another_opcode_is_notimp() -> None:
    # An answer to an answer could loop between two servers.
    assert refusal(header(flags=0x8100) + question(b"a", b"test")).reply is None
    exc = refusal(header(flags=0x2100) + question(b"a", b"test"))  # opcode 4, NOTIFY
    assert exc.rcode is Rcode.NOTIMP
    reply = DNSRecord.parse(exc.reply)
    assert (reply.header.opcode, reply.header.rcode, reply.header.qr, reply.header.rd) == (4, RCODE.NOTIMP, 1, 1)


def test_a_label_that_is_not_utf8_is_formerr() -> None:
    exc = refusal(header() + question(b"\xff\xfe", b"test"))
    assert exc.rcode is Rcode.FORMERR and "UTF-8" in str(exc)


@pytest.mark.parametrize(
    "labels",
    [
        pytest.param((), id="the root"),
        pytest.param((b"a.b", b"test"), id="a dot inside a label"),
        pytest.param(("caf\u00e9".encode(), b"test"), id="not ASCII"),
        pytest.param((b"a b", b"test"), id="a space"),
    ],
)
def test_labels_that_spell_no_host_are_a_host_error(labels: tuple[bytes, ...]) -> None:
    with pytest.raises(HostError):
        query_name(labels)


def test_query_types_are_named_in_master_file_text() -> None:
    assert [qtype_text(n) for n in (1, 28, 65, 255, 65280)] == ["A", "AAAA", "HTTPS", "ANY", "TYPE65280"]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_are_a_query_or_our_error(packet: bytes) -> None:
    try:
        q = read_query(packet)
    except DnsQueryError as exc:
        assert exc.reply is None or DNSRecord.parse(exc.reply).header.qr == 1
        return
    assert q.question == packet[12 : 12 + len(q.question)]


def _read(packet: bytes) -> object:
    """What read_query makes of ``packet``: the query's fields, or the error's (detail, reply, rcode)."""
    try:
        return tuple(read_query(packet))
    except DnsQueryError as exc:
        return (str(exc), exc.reply, exc.rcode)


@pytest.mark.parametrize(
    ("flags", "counts"),
    [
        (0x0100, (1, 0, 0, 0)),  # the query as first read, with another id
        (0x8100, (1, 0, 0, 0)),  # a response: dropped
        (0x2100, (1, 0, 0, 0)),  # opcode UPDATE: NOTIMP
        (0x0000, (1, 0, 0, 0)),  # RD clear: the reply says so
        (0x0100, (2, 0, 0, 0)),
        (0x0100, (1, 1, 0, 0)),
        (0x0100, (1, 0, 1, 0)),
        (0x0100, (1, 0, 0, 1)),  # an additional record announced (EDNS): read the same
    ],
)
def test_a_question_read_before_reads_as_a_fresh_one_whatever_header_comes_with_it(
    monkeypatch: pytest.MonkeyPatch, flags: int, counts: tuple[int, int, int, int]
) -> None:
    monkeypatch.setattr(dns, "_QUESTIONS", {})
    body = question(b"kept", b"test")
    read_query(header(ident=1) + body)  # now kept: the next packet's header is all that differs
    packet = header(ident=0xBEEF, flags=flags, counts=counts) + body
    remembered = _read(packet)
    dns._QUESTIONS.clear()
    assert remembered == _read(packet)
    if not isinstance(remembered[-1], Rcode | None):
        assert remembered[0] == 0xBEEF


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=12, max_size=40), st.binary(min_size=12, max_size=40))
def test_a_packet_reads_the_same_after_any_other_was_read(first: bytes, second: bytes) -> None:
    dns._QUESTIONS.clear()
    fresh = _read(second)
    dns._QUESTIONS.clear()
    _read(first)
    _read(second)
    assert _read(second) == fresh


# --- our replies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "address"),
    [("A", ANSWER4), ("AAAA", ANSWER6), ("A", None)],
)
def test_a_reply_is_what_dnslib_reads_as_the_answer_to_the_query(qtype: str, address: object) -> None:
    packet = dnslib_query("0x20.ExAmPlE.test", qtype, ident=0x5150, rd=0)
    q = read_query(packet)
    packed = ReplyTemplate(Rcode.NOERROR, address, 7).pack(q)  # type: ignore[arg-type]
    reply = DNSRecord.parse(packed)
    assert (reply.header.id, reply.header.qr, reply.header.ra, reply.header.rd) == (0x5150, 1, 1, 0)
    assert packed[12 : len(packet)] == packet[12:]  # the question byte for byte, its case kept
    if address is None:
        assert reply.rr == []
    else:
        [record] = reply.rr
        assert (str(record.rname), record.rtype, record.ttl, str(record.rdata)) == (
            "0x20.ExAmPlE.test.",
            getattr(QTYPE, qtype),
            7,
            str(address),
        )
    assert len(packed) <= UDP_REPLY_OCTETS


def test_the_longest_question_with_an_answer_fits_in_a_udp_reply() -> None:
    q = read_query(header() + question(b"a" * 63, b"b" * 63, b"c" * 63, b"d" * 61, qtype=28))
    assert len(ReplyTemplate(Rcode.NOERROR, ANSWER6, 5).pack(q)) <= UDP_REPLY_OCTETS


def test_a_header_reply_keeps_id_opcode_and_rd_and_says_the_rcode() -> None:
    reply = header_reply(header(ident=0xABCD, flags=0x0100 | 0x0010) + b"junk", Rcode.FORMERR)
    assert reply == struct.pack("!HHHHHH", 0xABCD, 0x8000 | 0x0100 | 1, 0, 0, 0, 0)


# --- the resolver's messages -----------------------------------------------------------------------


def test_a_built_query_is_the_one_dnslib_builds() -> None:
    query = build_query("origin.test", 28, 0x4242)
    reference = DNSRecord.question("origin.test", "AAAA")
    reference.header.id = 0x4242
    assert bytes(query.pack()) == bytes(reference.pack())
    assert query.header.rd == 1


@pytest.mark.parametrize("host", ["", "trailing.dot.", "a" * 64 + ".test", "a..b"])
def test_a_name_no_query_can_carry_is_a_resolve_error(host: str) -> None:
    with pytest.raises(ResolveError, match="invalid name"):
        build_query(host, 1, 1)


def _reply(name: str = "origin.test", ident: int = 0x1234) -> DNSRecord:
    return build_query(name, 1, ident).reply()


def test_a_reply_with_a_compression_loop_is_ignored() -> None:
    query = build_query("origin.test", 1, 0x1234)
    questioned = bytes(query.pack())[12:]
    owner_at = 12 + len(questioned)
    loop = struct.pack("!H", 0xC000 | owner_at) + struct.pack("!HHIH", 1, 1, 60, 4) + bytes([127, 0, 0, 2])
    assert accept_reply(query, header(flags=0x8180, counts=(1, 1, 0, 0)) + questioned + loop) is None
    assert accept_reply(query, header(flags=0x8180) + b"\xc0\x0c" + questioned[-4:]) is None


def test_a_reply_announcing_more_records_than_it_holds_is_ignored() -> None:
    query = build_query("origin.test", 1, 0x1234)
    reply = _reply()
    reply.add_answer(RR("origin.test", QTYPE.A, ttl=60, rdata=A("127.0.0.2")))
    packed = bytearray(reply.pack())
    packed[6:8] = (2).to_bytes(2, "big")  # ANCOUNT 2, one record present
    assert accept_reply(query, bytes(packed)) is None
    packed[6:8] = (1).to_bytes(2, "big")
    assert accept_reply(query, bytes(packed)) is not None


def test_every_cut_of_a_reply_is_ignored_or_accepted_never_raised() -> None:
    query = build_query("origin.test", 1, 0x1234)
    reply = _reply()
    reply.add_answer(RR("origin.test", QTYPE.A, ttl=60, rdata=A("127.0.0.2")))
    packed = bytes(reply.pack())
    for cut in range(len(packed)):
        accepted = accept_reply(query, packed[:cut])
        if accepted is not None:
            read_answer(accepted, "origin.test", 1)
    assert accept_reply(query, packed) is not None


def test_a_cname_chain_is_followed_at_most_max_cname_hops() -> None:
    reply = _reply("c0.test")
    hops = MAX_CNAME_HOPS + 2
    for i in range(hops):
        reply.add_answer(RR(f"c{i}.test", QTYPE.CNAME, ttl=60, rdata=CNAME(f"c{i + 1}.test")))
    reply.add_answer(RR(f"c{MAX_CNAME_HOPS}.test", QTYPE.A, ttl=60, rdata=A("127.0.0.2")))
    reply.add_answer(RR(f"c{MAX_CNAME_HOPS + 1}.test", QTYPE.A, ttl=60, rdata=A("127.0.0.3")))  # one hop too far
    assert [str(a) for a in read_answer(reply, "c0.test", 1).addresses] == ["127.0.0.2"]


def test_a_cname_loop_ends_and_gives_no_address() -> None:
    reply = _reply("loop1.test")
    reply.add_answer(RR("loop1.test", QTYPE.CNAME, ttl=60, rdata=CNAME("loop2.test")))
    reply.add_answer(RR("loop2.test", QTYPE.CNAME, ttl=60, rdata=CNAME("LOOP1.test.")))
    assert read_answer(reply, "loop1.test", 1).addresses == ()


def test_nxdomain_takes_its_negative_ttl_from_the_soa() -> None:
    reply = _reply()
    reply.header.rcode = RCODE.NXDOMAIN
    reply.add_auth(RR("test", QTYPE.SOA, ttl=100, rdata=SOA("ns.test", "h.test", (1, 2, 3, 4, 30))))
    answer = read_answer(DNSRecord.parse(reply.pack()), "origin.test", 1)
    assert (answer.rcode, answer.addresses, answer.ttl_s) == ("NXDOMAIN", (), 30)


def test_names_compare_the_dns_way() -> None:
    assert same_name("Origin.TEST.") == same_name("origin.test") == "origin.test"


# --- the answer plan ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("packet", "unreachable", "rcode", "answer"),
    [
        pytest.param(dnslib_query("ok.test", "A"), None, RCODE.NOERROR, str(ANSWER4), id="A"),
        pytest.param(dnslib_query("ok.test", "AAAA"), None, RCODE.NOERROR, str(ANSWER6), id="AAAA"),
        pytest.param(dnslib_query("ok.test", "TXT"), None, RCODE.REFUSED, None, id="another type"),
        pytest.param(dnslib_query("ok.test", "A", "CH"), None, RCODE.REFUSED, None, id="another class"),
        pytest.param(dnslib_query("ok.test", "A"), Reason.DENYLISTED, RCODE.NXDOMAIN, None, id="unreachable"),
        pytest.param(header() + question(b"no host"), None, RCODE.FORMERR, None, id="no host"),
    ],
)
def test_the_plan_as_dnslib_reads_the_reply(
    packet: bytes, unreachable: Reason | None, rcode: int, answer: str | None
) -> None:
    q = read_query(packet)
    plan = plan_answer(q, answer4=ANSWER4, answer6=ANSWER6, unreachable=unreachable)
    reply = DNSRecord.parse(pack_reply(q, plan, 5))
    assert reply.header.rcode == rcode and reply.header.id == 0x1234
    assert [str(rr.rdata) for rr in reply.rr] == ([answer] if answer else [])
    assert plan.answer_text == (answer if answer else RCODE.get(rcode))
    assert plan.decision == ("allow" if answer else "deny")


def test_aaaa_without_an_ipv6_answer_is_nodata() -> None:
    plan = plan_answer(read_query(dnslib_query("ok.test", "AAAA")), answer4=ANSWER4, answer6=None, unreachable=None)
    # NODATA. DESIGN.md: not egressd's address, so the record says deny; every deny names a reason.
    assert plan == Plan(Rcode.NOERROR, reason=Reason.EMPTY_ANSWER) and plan.decision == "deny"


@pytest.mark.parametrize(
    "packet",
    [dnslib_query("ok.test", "TXT"), dnslib_query("ok.test", "A", "CH"), dnslib_query("ok.test", "HTTPS")],
    ids=["TXT", "class CH", "HTTPS"],
)
def test_a_query_type_egressd_does_not_answer_is_refused_with_a_reason(packet: bytes) -> None:
    plan = plan_answer(read_query(packet), answer4=ANSWER4, answer6=ANSWER6, unreachable=None)
    assert plan == Plan(Rcode.REFUSED, reason=Reason.UNSUPPORTED_QUERY) and plan.decision == "deny"


def test_a_refusal_answers_with_its_reasons_rcode() -> None:
    assert refused(Reason.DENIED_EARLIER) == Plan(Rcode.NXDOMAIN, reason=Reason.DENIED_EARLIER)
    with pytest.raises(ValueError, match="no DNS answer"):
        refused(Reason.UPSTREAM_TIMEOUT)


def test_a_prepared_reply_carries_what_the_record_says() -> None:
    prepared = PreparedReply(refused(Reason.AUTH_REQUIRED), 5)
    assert (prepared.decision.value, prepared.reason, prepared.answer) == ("deny", "auth_required", "REFUSED")
    q = read_query(dnslib_query("ok.test"))
    assert prepared.reply(q) == pack_reply(q, refused(Reason.AUTH_REQUIRED), 5)


def test_answers_prepare_each_outcome_once_and_refuse_with_reasons() -> None:
    answers = Answers(ANSWER6, 9)
    first = answers.outcome(read_query(dnslib_query("one.test")), None, ANSWER4)
    again = answers.outcome(read_query(dnslib_query("two.test", ident=7)), None, ANSWER4)
    assert again is first and first.answer == str(ANSWER4)
    other = answers.outcome(read_query(dnslib_query("one.test")), None, IPv4Address("10.9.9.9"))
    assert other is not first and other.answer == "10.9.9.9"
    assert DNSRecord.parse(first.reply(read_query(dnslib_query("one.test")))).rr[0].ttl == 9
    assert (answers.no_run.reason, answers.no_audit_log.reason) == ("auth_required", "audit_unavailable")
    assert answers.no_run.plan.rcode is answers.no_audit_log.plan.rcode is Rcode.REFUSED


def test_answers_given_no_a_answer_give_their_own() -> None:
    answers = Answers(ANSWER6, 9, ANSWER4)
    q = read_query(dnslib_query("one.test"))
    own = answers.outcome(q, None)
    assert (own.answer, own.plan) == (str(ANSWER4), answers.outcome(q, None, ANSWER4).plan)
    assert answers.outcome(q, None, IPv4Address("10.9.9.9")).answer == "10.9.9.9"
    assert answers.outcome(q, Reason.DENYLISTED).plan == refused(Reason.DENYLISTED)
    with pytest.raises(ValueError, match="no A answer"):
        Answers(ANSWER6, 9).outcome(q, None)


def test_the_codec_module_keeps_its_question_memo_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dns, "_QUESTIONS", {})
    monkeypatch.setattr(dns, "_MAX_QUESTIONS_CACHED", 2)
    for i in range(5):
        read_query(dnslib_query(f"n{i}.test"))
        assert 1 <= len(dns._QUESTIONS) <= 2
