"""The ClientHellos a TLS client sends, and their server names, read without terminating TLS.

Bytes in, values out, no I/O. ``parse_client_hello(data)`` takes everything
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
   is offered; ``encrypted_client_hello`` (draft-ietf-tls-esni §5) says the
   name that matters is encrypted (``ClientHello.ech``). Everything else —
   GREASE values (RFC 8701), padding (RFC 7685), key shares — is skipped by
   length.

The host name comes back as the ASCII text the client sent; checking that it
is a valid host (and not an IP literal, which RFC 6066 §3 forbids) is the
caller's job, with ``egressd.names.hosts``.

A client may send more than one ClientHello: a server that cannot use the
first answers with a HelloRetryRequest and the client sends a second
(RFC 8446 §4.1.4), and nothing stops a client from sending the second
unasked, early, or in the same record as the first. So a caller that checks
names follows both sides until the server has settled the handshake:

- ``scan_client(data, first=...)`` walks the client's bytes not yet passed
  on: how many of them are whole records whose handshake messages are all
  complete (``ClientRecords.ready``: they may go on once the ClientHellos
  among them, ``hellos``, are checked), the rest to be held. Until the
  server settles, every handshake message a client sends must be a
  ClientHello. change_cipher_spec (sent before a second ClientHello in
  middlebox compatibility mode, RFC 8446 §D.4), alert and application_data
  (0-RTT early data, RFC 8446 §4.2.10) records are passed over by length.
- ``ServerWatch`` is fed the server's bytes as they are relayed (it keeps
  only a few of them) and says when the handshake is settled: at the first
  ServerHello that is not a HelloRetryRequest (RFC 8446 §4.1.3: one whose
  random is SHA-256("HelloRetryRequest")). After that, a TLS 1.3 client's
  records are encrypted and a TLS 1.2 client's are the rest of its
  handshake; no server takes a new ClientHello in the clear (renegotiation
  runs inside the encrypted session, RFC 5746). A server whose bytes are not
  TLS handshake records settles it too: it will not answer a ClientHello.

``tls_alert`` builds the fatal alert record a listener sends before closing.
"""

from __future__ import annotations

from dataclasses import dataclass

from egressd.vocabulary.wire import Alert

__all__ = [
    "HRR_RANDOM",
    "MAX_BUFFER_BYTES",
    "MAX_CLIENT_HELLO_BYTES",
    "ClientHello",
    "ClientHelloError",
    "ClientRecords",
    "NotTls",
    "ServerWatch",
    "parse_client_hello",
    "scan_client",
    "tls_alert",
]

_CHANGE_CIPHER_SPEC = 20
_ALERT = 21
_HANDSHAKE = 22
_APPLICATION_DATA = 23
_CLIENT_HELLO = 1
_SERVER_HELLO = 2
_EXT_SERVER_NAME = 0
_EXT_SUPPORTED_VERSIONS = 43
# draft-ietf-tls-esni §5: encrypted_client_hello; ech_outer_extensions (§5.1)
# belongs only inside the encrypted inner hello, so seeing it in the clear
# means the same thing: the name that matters is not the one we can read.
_EXT_ENCRYPTED_CLIENT_HELLO = 0xFE0D
_EXT_ECH_OUTER_EXTENSIONS = 0xFD00
_HOST_NAME = 0
# RFC 8446 §5.1: "The length MUST NOT exceed 2^14 bytes."
_MAX_FRAGMENT = 1 << 14
# The largest record of either version: RFC 8446 §5.2 allows 2^14 + 256
# bytes of ciphertext, RFC 5246 §6.2.3 2^14 + 2048.
_MAX_RECORD = (1 << 14) + 2048
# What a client may send besides handshake records before the server settles.
_PASSED_OVER = frozenset((_CHANGE_CIPHER_SPEC, _ALERT, _APPLICATION_DATA))
# RFC 8446 §4.1.3: the random of a HelloRetryRequest, SHA-256("HelloRetryRequest").
HRR_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
# A ServerHello up to the end of its random: msg_type(1) length(3) legacy_version(2) random(32).
_SERVER_HELLO_HEAD = 38
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
    else the legacy version alone), e.g. ``(0x0304, 0x0303)``; ``ech``: it
    carries encrypted_client_hello (or ech_outer_extensions), so
    ``server_name`` is only the cover name and the one asked for is hidden.
    """

    server_name: str | None
    versions: tuple[int, ...]
    ech: bool = False

    @property
    def offers_tls13(self) -> bool:
        return 0x0304 in self.versions


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
    ech = False
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
        elif kind == _EXT_ENCRYPTED_CLIENT_HELLO or kind == _EXT_ECH_OUTER_EXTENSIONS:
            ech = True
    return ClientHello(server_name, versions, ech)


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


# -- every ClientHello until the server settles ------------------------------------


@dataclass(frozen=True, slots=True)
class ClientRecords:
    """What ``scan_client`` found: ``ready`` bytes of whole records, and the ClientHellos in them."""

    ready: int
    hellos: tuple[ClientHello, ...]


def scan_client(data: bytes | bytearray | memoryview, *, first: bool) -> ClientRecords:
    """Walk the client's bytes not yet passed on, record by record.

    ``data`` must begin at a record boundary; ``first``: it is the start of
    the connection. Returns how many bytes at its start are whole records in
    which every handshake message is complete, and the ClientHellos among
    them; the bytes after ``ready`` (an incomplete record or handshake
    message) are to be held until more arrive. The answer depends only on
    the bytes: a longer ``data`` never gives a smaller ``ready``.

    Raises NotTls when ``first`` and the first record header is not a TLS
    handshake record (another protocol); ClientHelloError for a handshake
    message that is not a ClientHello, another record type inside a
    handshake message (RFC 8446 §5.1), a record type no client sends before
    the handshake is settled, a malformed ClientHello, or more than
    ``MAX_BUFFER_BYTES`` without a whole record and message.
    """
    view = memoryview(bytes(data))  # a copy, as in parse_client_hello
    pos = ready = 0
    hellos: list[ClientHello] = []
    pending: list[ClientHello] = []  # complete hellos in records not all ready yet
    message = bytearray()  # handshake bytes of a message not complete yet
    while True:
        header = view[pos : pos + 5]
        if not header:
            break
        _check_client_header(header, first=first and pos == 0)
        if len(header) < 5:
            break
        kind = header[0]
        length = (header[3] << 8) | header[4]
        if kind == _HANDSHAKE:
            if length == 0:
                raise ClientHelloError("zero-length handshake fragment (RFC 8446 §5.1)")
            if length > _MAX_FRAGMENT:
                raise ClientHelloError("record longer than 2^14 bytes (RFC 8446 §5.1)")
        else:
            if message:
                raise ClientHelloError("another record type inside a handshake message (RFC 8446 §5.1)")
            if length > _MAX_RECORD:
                raise ClientHelloError(f"record of {length} bytes is longer than any TLS version allows")
        end = pos + 5 + length
        if end > len(view):
            if kind == _HANDSHAKE:
                # Refuse a bad message as soon as its first bytes show it.
                _hello_messages(message + view[pos + 5 :], [])
            break
        if kind == _HANDSHAKE:
            message += view[pos + 5 : end]
            message = _hello_messages(message, pending)
        pos = end
        if not message:
            ready = pos
            hellos += pending
            pending.clear()
        if pos - ready > MAX_BUFFER_BYTES:
            break
    if len(view) - ready > MAX_BUFFER_BYTES:
        raise ClientHelloError(f"more than {MAX_BUFFER_BYTES} bytes without a whole record and handshake message")
    return ClientRecords(ready, tuple(hellos))


def _check_client_header(header: memoryview, *, first: bool) -> None:
    """Refuse a client record header as soon as any of its bytes is wrong."""
    if first:
        _check_record_header(header, first=True)  # the start of the connection: a handshake record, or not TLS
        return
    if header[0] != _HANDSHAKE and header[0] not in _PASSED_OVER:
        raise ClientHelloError(f"record type {header[0]} before the server's ServerHello")
    if len(header) >= 2 and header[1] != 3:
        raise ClientHelloError("record version is not 3.x")


def _hello_messages(message: bytearray, found: list[ClientHello]) -> bytearray:
    """Parse the complete ClientHellos at the start of ``message`` into ``found``; the incomplete rest."""
    pos = 0
    while pos < len(message):
        if message[pos] != _CLIENT_HELLO:
            raise ClientHelloError("a handshake message other than ClientHello before the server's ServerHello")
        if len(message) - pos < 4:
            break
        length = int.from_bytes(message[pos + 1 : pos + 4], "big")
        if length > MAX_CLIENT_HELLO_BYTES:
            raise ClientHelloError(f"ClientHello of {length} bytes is over the {MAX_CLIENT_HELLO_BYTES}-byte limit")
        if len(message) - pos < 4 + length:
            break
        found.append(_parse_body(bytes(message[pos + 4 : pos + 4 + length])))
        pos += 4 + length
    return message[pos:]


class ServerWatch:
    """Follows a server's first records until it settles the handshake (see the module docstring).

    ``feed(data)`` with every byte the server sends, in order, until it
    answers True (``settled``); ``retries`` counts the HelloRetryRequests
    seen. Settled: the first ServerHello that is not a HelloRetryRequest, a
    first handshake message that is not a ServerHello, or a record that is
    neither handshake, change_cipher_spec nor alert (not TLS, or keys in
    use). The server's alerts and change_cipher_spec records (RFC 8446 §D.4:
    one follows a HelloRetryRequest) are passed over. It holds at most one
    record header and one ServerHello's first 38 bytes. ``tls``: a whole TLS
    record header came first (False when settled: the server does not speak TLS).
    """

    __slots__ = ("settled", "retries", "tls", "_header", "_left", "_kind", "_message", "_skip")

    def __init__(self) -> None:
        self.settled = False
        self.retries = 0
        self.tls = False
        self._header = bytearray()  # a record header still incomplete
        self._left = 0  # bytes of the current record's fragment still to come
        self._kind = 0
        self._message = bytearray()  # the current handshake message, up to the end of its random
        self._skip = 0  # bytes of the current (HelloRetryRequest) message after its random still to come

    def feed(self, data: bytes | bytearray | memoryview) -> bool:
        """Take the server's next bytes; True once the handshake is settled."""
        pos, end = 0, len(data)
        while pos < end and not self.settled:
            if self._left == 0:
                take = min(5 - len(self._header), end - pos)
                self._header += data[pos : pos + take]
                pos += take
                # Judged byte by byte: a server that is not TLS may send fewer than five.
                header = self._header
                if header[0] not in (_HANDSHAKE, _CHANGE_CIPHER_SPEC, _ALERT) or (len(header) > 1 and header[1] != 3):
                    self.settled = True
                    break
                if len(header) < 5:
                    break
                self._kind = header[0]
                self.tls = True
                self._left = (header[3] << 8) | header[4]
                self._header.clear()
                continue
            take = min(self._left, end - pos)
            if self._kind == _HANDSHAKE:
                self._handshake(data[pos : pos + take])
            pos += take
            self._left -= take
        return self.settled

    def _handshake(self, fragment: bytes | bytearray | memoryview) -> None:
        pos, end = 0, len(fragment)
        while pos < end and not self.settled:
            if self._skip:
                take = min(self._skip, end - pos)
                self._skip -= take
                pos += take
                continue
            take = min(_SERVER_HELLO_HEAD - len(self._message), end - pos)
            self._message += fragment[pos : pos + take]
            pos += take
            if self._message[0] != _SERVER_HELLO:
                self.settled = True
                return
            if len(self._message) < _SERVER_HELLO_HEAD:
                return
            length = int.from_bytes(self._message[1:4], "big")
            if self._message[6:] != HRR_RANDOM or length < _SERVER_HELLO_HEAD - 4:
                self.settled = True
                return
            self.retries += 1
            self._skip = length - (_SERVER_HELLO_HEAD - 4)
            self._message.clear()
