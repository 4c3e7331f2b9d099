"""The server name in a TLS ClientHello, read without terminating TLS.

Bytes in, a value out, no I/O. ``parse_client_hello(data)`` takes everything
a client has sent so far and answers one of three ways:

- a ``ClientHello`` (its server name, None when it sent none) once the whole
  handshake message has arrived;
- ``None``: more bytes are needed;
- ``NotTls``: the first bytes cannot begin a TLS handshake record, so the
  client speaks another protocol; ``ClientHelloError``: they begin one but
  what follows is not a well-formed ClientHello (or is larger than we read).

The layers, outermost first:

1. records (RFC 8446 §5.1): ``type(1)=22 version(2) length(2) fragment``;
   a handshake message may be cut across any number of records, and records
   across any number of TCP segments; zero-length handshake fragments and
   fragments over 2^14 bytes are forbidden, and no other record type may
   come between the fragments;
2. the handshake message (RFC 8446 §4): ``msg_type(1)=1 length(3) body``;
3. the body (RFC 8446 §4.1.2, the same layout as RFC 5246 §7.4.1.2):
   ``legacy_version(2) random(32) session_id<0..32> cipher_suites<2..2^16-2>
   compression_methods<1..2^8-1> extensions<8..2^16-1>``; TLS 1.2 clients may
   send no extensions at all;
4. extensions (RFC 8446 §4.2): each type at most once; ``server_name``
   (RFC 6066 §3) carries exactly one ``host_name`` entry, as every TLS stack
   accepts it; ``supported_versions`` (RFC 8446 §4.2.1) says whether TLS 1.3
   is offered. Everything else — GREASE values (RFC 8701), padding
   (RFC 7685), key shares — is skipped by length.

The host name comes back as the ASCII text the client sent; checking that it
is a valid host (and not an IP literal, which RFC 6066 §3 forbids) is the
caller's job, with ``proxy.hosts``.

``tls_alert`` builds the fatal alert record a listener sends before closing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "MAX_BUFFER_BYTES",
    "MAX_CLIENT_HELLO_BYTES",
    "Alert",
    "ClientHello",
    "ClientHelloError",
    "NotTls",
    "parse_client_hello",
    "tls_alert",
]

_HANDSHAKE = 22
_ALERT = 21
_CLIENT_HELLO = 1
_EXT_SERVER_NAME = 0
_EXT_SUPPORTED_VERSIONS = 43
_HOST_NAME = 0
# RFC 8446 §5.1: "The length MUST NOT exceed 2^14 bytes."
_MAX_FRAGMENT = 1 << 14
# RFC 1035 §2.3.4 limits a name to 255 octets; a longer SNI is not a host.
_MAX_HOST_NAME = 255

# Real ClientHellos are a few hundred bytes to ~2 KiB (post-quantum key
# shares, PSK tickets, padding to 512); 64 KiB is four full records of
# headroom, and it bounds what we buffer before a decision.
MAX_CLIENT_HELLO_BYTES = 64 * 1024
# Fragmenting into 1-byte records is legal but multiplies the bytes on the
# wire by six; past this much buffered input we stop waiting.
MAX_BUFFER_BYTES = 4 * MAX_CLIENT_HELLO_BYTES


class ClientHelloError(ValueError):
    """The bytes begin a TLS handshake but are not a ClientHello we accept."""


class NotTls(ClientHelloError):
    """The first bytes cannot begin a TLS handshake record: another protocol."""


@dataclass(frozen=True, slots=True)
class ClientHello:
    """What egressd needs from a ClientHello.

    ``server_name`` is the SNI host name as sent (ASCII), None without one;
    ``versions`` are the protocol versions offered (``supported_versions``,
    else the legacy version alone), e.g. ``(0x0304, 0x0303)``.
    """

    server_name: str | None
    versions: tuple[int, ...]

    @property
    def offers_tls13(self) -> bool:
        return 0x0304 in self.versions


class Alert(enum.IntEnum):
    """RFC 8446 §6.2 alert descriptions a listener may send before closing."""

    HANDSHAKE_FAILURE = 40
    ACCESS_DENIED = 49
    DECODE_ERROR = 50
    INTERNAL_ERROR = 80
    MISSING_EXTENSION = 109
    UNRECOGNIZED_NAME = 112


def tls_alert(description: Alert) -> bytes:
    """A fatal alert record (RFC 8446 §6): level 2, in a TLS 1.2-versioned record."""
    return bytes((_ALERT, 3, 3, 0, 2, 2, int(description)))


def parse_client_hello(data: bytes | bytearray | memoryview) -> ClientHello | None:
    """Parse the ClientHello at the start of ``data`` (everything received so far).

    Returns the ClientHello once its handshake message is complete, None when
    more bytes are needed. Raises NotTls when the first record header is not
    a TLS handshake record, ClientHelloError for anything malformed or over
    the size limits. Bytes after the ClientHello are not looked at. The
    answer depends only on the bytes, not on how they were split into
    records or reads: a prefix gives None or the same answer.
    """
    # A copy: a view of the caller's bytearray would pin it (no resizing)
    # for as long as a traceback holds this frame.
    view = memoryview(bytes(data))
    handshake = bytearray()
    pos = 0
    while True:
        header = view[pos : pos + 5]
        _check_record_header(header, first=pos == 0)
        if len(header) < 5:
            return None
        length = (header[3] << 8) | header[4]
        if length == 0:
            raise ClientHelloError("zero-length handshake fragment (RFC 8446 §5.1)")
        if length > _MAX_FRAGMENT:
            raise ClientHelloError("record longer than 2^14 bytes (RFC 8446 §5.1)")
        fragment = view[pos + 5 : pos + 5 + length]
        handshake += fragment
        pos += 5 + len(fragment)
        message = _handshake_message(handshake)
        if message is not None:
            return _parse_body(message)
        _check_buffered(pos)
        if len(fragment) < length:
            return None


def _check_record_header(header: memoryview, *, first: bool) -> None:
    """Refuse a record header as soon as any of its bytes is wrong."""
    wrong = ClientHelloError if not first else NotTls
    if len(header) >= 1 and header[0] != _HANDSHAKE:
        if first:
            raise NotTls("not a TLS handshake record")
        raise ClientHelloError("another record type inside the ClientHello (RFC 8446 §5.1)")
    # Every TLS version's record header starts with major version 3.
    if len(header) >= 2 and header[1] != 3:
        raise wrong("record version is not 3.x")


def _check_buffered(total: int) -> None:
    if total > MAX_BUFFER_BYTES:
        raise ClientHelloError(f"more than {MAX_BUFFER_BYTES} bytes without a complete ClientHello")


def _handshake_message(handshake: bytearray) -> bytes | None:
    """The ClientHello body once complete; None while incomplete."""
    if handshake and handshake[0] != _CLIENT_HELLO:
        raise ClientHelloError("the first handshake message is not a ClientHello")
    if len(handshake) < 4:
        return None
    length = int.from_bytes(handshake[1:4], "big")
    if length > MAX_CLIENT_HELLO_BYTES:
        raise ClientHelloError(f"ClientHello of {length} bytes is over the {MAX_CLIENT_HELLO_BYTES}-byte limit")
    if len(handshake) < 4 + length:
        return None
    return bytes(handshake[4 : 4 + length])


class _Reader:
    """Bounds-checked reads from a ClientHello body; every overrun is malformed."""

    __slots__ = ("data", "pos", "end")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data) if end is None else end

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > self.end:
            raise ClientHelloError(f"truncated {what}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def uint(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def vector(self, length_size: int, what: str, minimum: int = 0, maximum: int | None = None) -> _Reader:
        """A length-prefixed vector (RFC 8446 §3.4) as a reader over its contents."""
        length = self.uint(length_size, f"{what} length")
        if length < minimum or (maximum is not None and length > maximum):
            raise ClientHelloError(f"{what} length {length} out of range")
        start = self.pos
        self.take(length, what)
        return _Reader(self.data, start, start + length)

    @property
    def left(self) -> int:
        return self.end - self.pos


def _parse_body(body: bytes) -> ClientHello:
    r = _Reader(body)
    legacy_version = r.uint(2, "legacy_version")
    r.take(32, "random")
    r.vector(1, "legacy_session_id", 0, 32)
    suites = r.vector(2, "cipher_suites", 2, 0xFFFE)
    if suites.left % 2:
        raise ClientHelloError("cipher_suites has an odd length")
    r.vector(1, "legacy_compression_methods", 1, 0xFF)
    if r.left == 0:
        # RFC 5246 §7.4.1.2: a TLS 1.2 client may send no extensions at all.
        return ClientHello(None, (legacy_version,))
    extensions = r.vector(2, "extensions", 0, 0xFFFF)
    if r.left:
        raise ClientHelloError("bytes after the extensions")
    seen: set[int] = set()
    server_name: str | None = None
    versions: tuple[int, ...] = (legacy_version,)
    while extensions.left:
        kind = extensions.uint(2, "extension type")
        content = extensions.vector(2, "extension")
        if kind in seen:
            raise ClientHelloError(f"extension {kind} appears twice (RFC 8446 §4.2)")
        seen.add(kind)
        if kind == _EXT_SERVER_NAME:
            server_name = _server_name(content)
        elif kind == _EXT_SUPPORTED_VERSIONS:
            versions = _supported_versions(content)
    return ClientHello(server_name, versions)


def _server_name(content: _Reader) -> str:
    """RFC 6066 §3: ServerNameList with exactly one host_name.

    The RFC allows other name types in principle; none was ever defined, and
    TLS stacks (OpenSSL among them) accept exactly one host_name entry, so a
    list a server would refuse is refused here too.
    """
    names = content.vector(2, "server_name_list", 1, 0xFFFF)
    if content.left:
        raise ClientHelloError("bytes after the server_name_list")
    name_type = names.uint(1, "server name type")
    if name_type != _HOST_NAME:
        raise ClientHelloError(f"server name type {name_type} is not host_name")
    host_vector = names.vector(2, "host_name", 1, _MAX_HOST_NAME)
    host = host_vector.take(host_vector.left, "host_name")
    if names.left:
        raise ClientHelloError("more than one server name (RFC 6066 §3)")
    if not all(0x21 <= b < 0x7F for b in host):
        raise ClientHelloError("host_name is not printable ASCII (RFC 6066 §3)")
    return host.decode("ascii")


def _supported_versions(content: _Reader) -> tuple[int, ...]:
    """RFC 8446 §4.2.1: ``ProtocolVersion versions<2..254>`` in a ClientHello."""
    versions = content.vector(1, "supported_versions", 2, 254)
    if content.left or versions.left % 2:
        raise ClientHelloError("malformed supported_versions")
    return tuple(versions.uint(2, "version") for _ in range(versions.left // 2))
