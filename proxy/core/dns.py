"""The DNS codec: every DNS message egressd reads or writes, as bytes in and values out.

Two directions, one home (RFC 1035 §4):

- **queries a sandbox sends, and our replies** (``egressd.proxy.net.dnsserver``):
  ``read_query`` decodes the header and the one question by hand (the layout
  is fixed, and it is the hot path), ``read_name`` the question's name,
  ``query_name`` turns its labels into a host (``egressd.names.hosts``) or
  refuses it; ``header_reply`` is a header-only error reply,
  ``ReplyTemplate`` a reply with its response code and at most one address
  record worked out once;
- **queries egressd sends upstream, and the replies it reads**
  (``egressd.proxy.net.resolver``): ``build_query`` and ``accept_reply``
  (is this datagram the answer to that query?) and ``read_answer`` (which
  addresses it gives for the name, along its CNAME chain) use dnslib's
  ``DNSRecord`` as the codec (it reads compressed names, which an upstream
  reply uses and a sandbox's question must not).

Pure: no socket, no clock. The limits and the wire constants both sides use
are defined here once, each beside the RFC that sets it.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from typing import NamedTuple

from dnslib import CLASS, QTYPE, RCODE, DNSError, DNSLabel, DNSRecord

from egressd.names.addresses import IPAddress
from egressd.names.hosts import HostError, normalise_host
from egressd.names.shown import shown_name
from egressd.proxy.core.memo import remember
from egressd.vocabulary.wire import Rcode

__all__ = [
    "CLASS_IN",
    "MAX_CNAME_HOPS",
    "MAX_NAME_OCTETS",
    "TCP_LENGTH_PREFIX",
    "TYPE_A",
    "TYPE_AAAA",
    "UDP_REPLY_OCTETS",
    "DnsQueryError",
    "Query",
    "ReplyTemplate",
    "ResolveError",
    "Resolution",
    "accept_reply",
    "build_query",
    "header_reply",
    "qtype_text",
    "query_name",
    "read_answer",
    "read_name",
    "read_query",
    "same_name",
]

# --- the limits --------------------------------------------------------------------

# RFC 1035 §3.1: a name on the wire is at most 255 octets (labels and their lengths).
MAX_NAME_OCTETS = 255
# RFC 1035 §4.2.1: a UDP reply without EDNS is at most 512 octets; ours fit
# (one question, at most one address record: see ReplyTemplate), so they are
# never truncated.
UDP_REPLY_OCTETS = 512
# RFC 1035 §4.2.2: over TCP each message is prefixed by its 2-octet length
# (so a message is at most 65535 octets).
TCP_LENGTH_PREFIX = 2
# A CNAME chain longer than a handful of hops is a misconfiguration or an
# attack, and each hop is a loop risk.
MAX_CNAME_HOPS = 8

# --- the wire constants (RFC 1035 §4.1.1) ------------------------------------------

_HEADER = struct.Struct("!HHHHHH")
# An answer record: owner (a compression pointer), type, class, TTL, RDLENGTH.
_ANSWER = struct.Struct("!HHHIH")
_TYPE_CLASS = struct.Struct("!HH")
_POINTER_TO_QUESTION = 0xC000 | 12  # RFC 1035 §4.1.4: the name right after the header
_QR = 0x8000
_OPCODE_MASK = 0x7800
_RD = 0x0100
_RA = 0x0080
TYPE_A: int = QTYPE.A
TYPE_AAAA: int = QTYPE.AAAA
CLASS_IN: int = CLASS.IN


# --- queries a sandbox sends ---------------------------------------------------------


class DnsQueryError(Exception):
    """A packet that is not a query we answer; ``reply`` is what to send (None: drop)."""

    def __init__(self, detail: str, reply: bytes | None, rcode: Rcode | None) -> None:
        super().__init__(detail)
        self.reply = reply
        self.rcode = rcode


class Query(NamedTuple):
    """One decoded question. ``name`` is the normalised host, None when the
    name is not a well-formed host name; ``shown`` is the name as received,
    escaped (RFC 1035 §5.1 ``\\DDD``) for the audit log; ``question`` is the
    question section's bytes as received, which the reply repeats. (read_query
    builds it from a tuple in this field order.)

    A named tuple rather than a frozen dataclass: one is built per query,
    and a tuple is the cheapest immutable record to build."""

    ident: int
    flags: int
    question: bytes
    name: str | None
    labels: tuple[bytes, ...]
    qtype: int
    qclass: int
    shown: str

    @property
    def qtype_text(self) -> str:
        return qtype_text(self.qtype)


def header_reply(packet: bytes, rcode: Rcode) -> bytes:
    """A header-only reply to ``packet`` (at least 12 bytes): its id, opcode and RD, and ``rcode``."""
    ident, flags = struct.unpack_from("!HH", packet)
    flags = _QR | (flags & (_OPCODE_MASK | _RD)) | int(rcode)
    return _HEADER.pack(ident, flags, 0, 0, 0, 0)


def _formerr(packet: bytes, detail: str) -> DnsQueryError:
    return DnsQueryError(detail, header_reply(packet, Rcode.FORMERR), Rcode.FORMERR)


def read_query(packet: bytes) -> Query:
    """Decode a query; DnsQueryError says what to answer when it is not one.

    1. shorter than a header, or a response (QR set) → drop: an answer to an
       answer could loop between two servers;
    2. an opcode other than QUERY → NOTIMP;
    3. not exactly one question, or answer/authority records → FORMERR
       (RFC 9619: QDCOUNT is one; a query carries no answers);
    4. the question cannot be decoded (``read_name``: cut short, a label
       that is not UTF-8, or a compressed name — a pointer there could only
       point into the header), or the packet ends inside its type or class
       → FORMERR.

    What follows the question (an EDNS OPT record, say) is not decoded: the
    answer never depends on it, and nothing of it is kept or sent anywhere.
    """
    if packet.__class__ is not bytes:
        packet = bytes(packet)  # a bytearray (dnslib packs into one) is no cache key
    # The name ends at its root label, a zero octet. A name whose labels hold
    # no zero octet ends at the first one after the header: the header but
    # its id, and the question there (name, type, class), are looked up among
    # the queries read before. A hit is a query read before, whose header
    # passed the checks below and whose question reads the same again (only
    # questions whose name ends at its first zero octet are kept; a packet cut
    # short gives a shorter key, which matches none): only its id is new. A
    # miss, or a name with a zero octet inside a label, is read in full.
    end = packet.find(0, 12) + 5
    if end > 4:
        known = _QUESTIONS.get(packet[2:end])
        if known is not None:
            return _new_query(Query, (packet[0] << 8 | packet[1], *known))
    if len(packet) < 12:
        raise DnsQueryError("shorter than a DNS header", None, None)
    ident, flags, qdcount, ancount, nscount, _arcount = _HEADER.unpack_from(packet)
    if flags & _QR:
        raise DnsQueryError("a response, not a query", None, None)
    if flags & _OPCODE_MASK:
        raise DnsQueryError("opcode is not QUERY", header_reply(packet, Rcode.NOTIMP), Rcode.NOTIMP)
    if qdcount != 1 or ancount or nscount:
        raise _formerr(packet, "not exactly one question")
    question = _read_question(packet)
    known = (flags, *question)
    # Kept when the lookup above can find it (its name ends at the first zero
    # octet) and no longer than a name can be, so the memo holds at most
    # _MAX_QUESTIONS_CACHED × (10 + MAX_NAME_OCTETS + 4) octets of keys.
    if end == 12 + len(question[0]) and end - 16 <= MAX_NAME_OCTETS:
        remember(_QUESTIONS, packet[2:end], known, _MAX_QUESTIONS_CACHED)
    return _new_query(Query, (ident, *known))


def _read_question(packet: bytes) -> tuple[bytes, str | None, tuple[bytes, ...], int, int, str]:
    """(question, host or None, labels, type, class, shown) of the question at offset 12."""
    labels, end = read_name(packet, 12)
    tail = end + 4
    if len(packet) < tail:
        raise _formerr(packet, "undecodable: the packet ends inside the question's type or class")
    qtype, qclass = _TYPE_CLASS.unpack_from(packet, end)
    try:
        host: str | None = query_name(labels)
    except HostError:
        host = None
    return packet[12:tail], host, labels, qtype, qclass, shown_name(labels)


def read_name(packet: bytes, offset: int) -> tuple[tuple[bytes, ...], int]:
    """The labels of the uncompressed name at ``offset``, and the offset after it.

    RFC 1035 §4.1.2 / §3.1: length-prefixed labels up to a zero octet. A
    length octet with both top bits set is a compression pointer (§4.1.4),
    which is FORMERR in a question: the only name before it is the header.
    Other length octets are read as lengths, up to 191 (as dnslib did: a
    label over 63 octets, or a name over 255, reads, and is no host name, so
    it is answered FORMERR all the same, with the name in the record); a
    label must be UTF-8. Raises DnsQueryError (FORMERR) when the packet ends
    first. Needs ``packet`` to hold a header (its id goes into the error reply).
    """
    labels: list[bytes] = []
    size = len(packet)
    while True:
        if offset >= size:
            raise _formerr(packet, "undecodable: the packet ends inside the question's name")
        length = packet[offset]
        if length == 0:
            return tuple(labels), offset + 1
        if length >= 0xC0:
            raise _formerr(packet, "compressed question name")
        start = offset + 1
        offset = start + length
        if offset > size:
            raise _formerr(packet, "undecodable: the packet ends inside a label of the question's name")
        label = packet[start:offset]
        if not label.isascii():
            try:
                label.decode()
            except UnicodeDecodeError:
                raise _formerr(packet, "undecodable: a label of the question's name is not UTF-8") from None
        labels.append(label)


# A query's header but its id (flags and counts), and its question section
# (name, type, class) → what read_query makes of them but the id: a pure
# function of the bytes, and a sandbox asks the same few names again and
# again. Bounded like the screen's caches: cleared when full.
_QUESTIONS: dict[bytes, tuple[int, bytes, str | None, tuple[bytes, ...], int, int, str]] = {}
_MAX_QUESTIONS_CACHED = 4096
# Builds a Query from one tuple without NamedTuple's Python-level __new__.
_new_query = tuple.__new__


# The text of the types a sandbox asks for, and dnslib's table for the rest
# (``TYPEnnn`` for a number it does not know, RFC 3597 §5).
_QTYPE_TEXT: dict[int, str] = {code: str(text) for code, text in QTYPE.forward.items()}


def qtype_text(qtype: int) -> str:
    """A query type as master-file text: ``A``, ``AAAA``, ``TYPE65280``."""
    text = _QTYPE_TEXT.get(qtype)
    return text if text is not None else str(QTYPE[qtype])


def query_name(labels: Sequence[bytes]) -> str:
    """The normalised host a query's labels spell; HostError when they spell none.

    Labels must be ASCII (names on the wire are A-labels) and form a host
    ``egressd.names.hosts.normalise_host`` accepts: letters, digits, hyphen and
    underscore, 63 octets a label, 253 characters in all. The root name is
    not a host.
    """
    if not labels:
        raise HostError("the root name is not a host")
    parts = []
    for label in labels:
        if not label.isascii() or b"." in label:
            raise HostError("label is not an ASCII host label")
        parts.append(label.decode("ascii"))
    return normalise_host(".".join(parts))


# --- our replies -------------------------------------------------------------------


class ReplyTemplate:
    """A reply's response code and answer worked out once; ``pack`` fills in one query.

    The header keeps the query's id, opcode and RD, sets QR and RA (we act as
    the sandbox's recursive resolver) and the response code; the question is
    repeated byte for byte (so 0x20 case randomisation survives); the answer,
    if any, is one record whose owner is a pointer to the question's name
    (§4.1.4), class IN, ``ttl_s``, and the address. With a name of at most
    ``MAX_NAME_OCTETS``, at most 12 + 259 + 28 = 299 octets, under
    ``UDP_REPLY_OCTETS``; a longer name is no host, so its reply (FORMERR)
    carries no record and is no longer than the query. Immutable by convention.
    """

    __slots__ = ("_flags", "_ancount", "_record")

    def __init__(self, rcode: Rcode, address: IPAddress | None, ttl_s: int) -> None:
        self._flags = _QR | _RA | int(rcode)
        if address is None:
            self._ancount, self._record = 0, b""
        else:
            rdata = address.packed
            rtype = TYPE_A if address.version == 4 else TYPE_AAAA
            self._ancount = 1
            self._record = _ANSWER.pack(_POINTER_TO_QUESTION, rtype, CLASS_IN, ttl_s, len(rdata)) + rdata

    def pack(self, query: Query) -> bytes:
        """The reply to ``query``."""
        flags = self._flags | (query.flags & (_OPCODE_MASK | _RD))
        return _HEADER.pack(query.ident, flags, 1, self._ancount, 0, 0) + query.question + self._record


# --- queries egressd sends upstream, and their replies --------------------------------


class ResolveError(Exception):
    """The name could not be resolved; the message says why (NXDOMAIN, timeout, ...).

    The one error of resolving (``egressd.proxy.net.resolver.Resolver``):
    raised here for a name no query can carry, by the resolvers for the rest.
    """


def same_name(label: DNSLabel | str) -> str:
    """A name as DNS compares it: case-insensitive (RFC 4343), one trailing dot ignored."""
    text = str(label).lower()
    return text[:-1] if text.endswith(".") else text


def build_query(host: str, qtype: int, query_id: int) -> DNSRecord:
    """A recursive (RD) query for ``host``/``qtype`` with the given 16-bit id.

    Raises ``ResolveError`` when the name cannot be encoded (a label over 63
    octets, RFC 1035 §2.3.4).
    """
    if not host or host.endswith("."):
        raise ResolveError(f"{host!r}: invalid name")
    try:
        query = DNSRecord.question(host, QTYPE.get(qtype))
        query.pack()
    except (DNSError, UnicodeError, ValueError) as exc:
        raise ResolveError(f"{host}: invalid name") from exc
    query.header.id = query_id
    return query


def accept_reply(query: DNSRecord, reply_bytes: bytes) -> DNSRecord | None:
    """Parse ``reply_bytes`` if it answers ``query``; otherwise None (ignore it, keep waiting).

    A reply is accepted only if it parses, is a response (QR set), carries the
    query's id and repeats exactly its one question (name, case-insensitive;
    type; class). Anything else may be a spoofed or stale datagram (RFC 5452
    §3), so it is dropped rather than treated as an error.
    """
    try:
        reply = DNSRecord.parse(reply_bytes)
    except DNSError:
        return None
    if reply.header.qr != 1 or reply.header.id != query.header.id:
        return None
    if len(reply.questions) != 1:
        return None
    asked, answered = query.q, reply.q
    if same_name(answered.qname) != same_name(asked.qname):
        return None
    if answered.qtype != asked.qtype or answered.qclass != asked.qclass:
        return None
    return reply


@dataclass(frozen=True, slots=True)
class Resolution:
    """What one reply says about one name and type.

    ``rcode`` is the response code's name ("NOERROR", "NXDOMAIN", ...).
    ``ttl_s`` is, with addresses, the smallest TTL along the CNAME chain and
    the address records; without addresses, the RFC 2308 §5 negative TTL taken
    from an SOA in the authority section, or None when there was none.
    """

    rcode: str
    addresses: tuple[IPAddress, ...]
    ttl_s: int | None


def _negative_ttl(reply: DNSRecord) -> int | None:
    """RFC 2308 §5: the negative TTL is min(SOA record TTL, SOA MINIMUM field)."""
    ttls = [
        min(rr.ttl, rr.rdata.times[4])
        for rr in reply.auth
        if rr.rtype == QTYPE.SOA and rr.rclass == CLASS.IN
    ]
    return min(ttls) if ttls else None


def read_answer(reply: DNSRecord, qname: str, qtype: int) -> Resolution:
    """The addresses of type ``qtype`` that ``reply`` gives for ``qname``.

    1. A non-NOERROR rcode yields no addresses and the SOA negative TTL.
    2. CNAMEs are followed from ``qname`` only (at most ``MAX_CNAME_HOPS``,
       stopping at a loop); the first CNAME per owner counts (RFC 2181 §10.1
       allows only one).
    3. A/AAAA records count only if their owner is ``qname`` or a name reached
       by that chain. Every other record in the answer section is ignored: an
       unrelated record is the classic cache-poisoning vector (RFC 5452 §6).
    """
    rcode = RCODE.get(reply.header.rcode, str(reply.header.rcode))
    if reply.header.rcode != RCODE.NOERROR:
        return Resolution(rcode=rcode, addresses=(), ttl_s=_negative_ttl(reply))

    cnames: dict[str, tuple[str, int]] = {}
    for rr in reply.rr:
        if rr.rtype == QTYPE.CNAME and rr.rclass == CLASS.IN:
            cnames.setdefault(same_name(rr.rname), (same_name(rr.rdata.label), rr.ttl))

    name = same_name(qname)
    chain = {name}
    ttls: list[int] = []
    for _ in range(MAX_CNAME_HOPS):
        if name not in cnames:
            break
        target, ttl = cnames[name]
        if target in chain:
            break
        chain.add(target)
        ttls.append(ttl)
        name = target

    addresses: list[IPAddress] = []
    for rr in reply.rr:
        if rr.rtype != qtype or rr.rclass != CLASS.IN or same_name(rr.rname) not in chain:
            continue
        if qtype == QTYPE.A:
            addresses.append(IPv4Address(bytes(rr.rdata.data)))
        elif qtype == QTYPE.AAAA:
            addresses.append(IPv6Address(bytes(rr.rdata.data)))
        else:
            continue
        ttls.append(rr.ttl)

    if not addresses:
        return Resolution(rcode=rcode, addresses=(), ttl_s=_negative_ttl(reply))
    return Resolution(rcode=rcode, addresses=tuple(addresses), ttl_s=min(ttls))
