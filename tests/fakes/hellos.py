"""ClientHellos for tests, built by hand (RFC 8446 §4.1.2) or taken from Python's ssl.

``handshake(...)`` is the handshake message (type 1, 3-byte length, body);
``records(message, sizes)`` cuts it into TLS records of the given fragment
sizes (the last takes the rest); ``python_hello(sni)`` is the first flight
OpenSSL sends through Python's ssl module, records and all.
``ech_extension()`` is an outer encrypted_client_hello extension
(draft-ietf-tls-esni §5), which Python's ssl cannot send; ``server_hello``
is a server's ServerHello record, a HelloRetryRequest (RFC 8446 §4.1.3) when
asked, and ``CCS`` the change_cipher_spec record of middlebox compatibility
mode (RFC 8446 §D.4).
"""

from __future__ import annotations

import hashlib
import os
import ssl
import struct
from collections.abc import Iterable, Sequence

# RFC 8701: GREASE values, 0x0A0A .. 0xFAFA.
GREASE = tuple(0x0A0A + 0x1010 * i for i in range(16))
# RFC 8446 §4.1.3: a HelloRetryRequest is a ServerHello with this random.
HRR_RANDOM = hashlib.sha256(b"HelloRetryRequest").digest()
ECH = 0xFE0D


def _vec(length_size: int, data: bytes) -> bytes:
    return len(data).to_bytes(length_size, "big") + data


def extension(kind: int, data: bytes) -> bytes:
    return struct.pack("!H", kind) + _vec(2, data)


def sni_extension(*names: bytes, name_type: int = 0) -> bytes:
    entries = b"".join(bytes([name_type]) + _vec(2, n) for n in names)
    return extension(0, _vec(2, entries))


def supported_versions(*versions: int) -> bytes:
    return extension(43, _vec(1, b"".join(struct.pack("!H", v) for v in versions)))


def body(
    sni: str | bytes | None = "origin.test",
    *,
    tls13: bool = True,
    grease: bool = True,
    padding: int = 0,
    session_id: bytes = b"",
    suites: Sequence[int] = (0x1301, 0x1302, 0xC02F),
    extra: Iterable[bytes] = (),
    extensions: bool = True,
) -> bytes:
    """A ClientHello body; ``extensions=False`` is a bare TLS 1.2 hello."""
    suites = ([GREASE[3]] if grease else []) + list(suites)
    out = b"\x03\x03" + os.urandom(32) + _vec(1, session_id)
    out += _vec(2, b"".join(struct.pack("!H", s) for s in suites)) + _vec(1, b"\x00")
    if not extensions:
        return out
    exts = []
    if grease:
        exts.append(extension(GREASE[5], b""))
    if sni is not None:
        exts.append(sni_extension(sni.encode() if isinstance(sni, str) else sni))
    if tls13:
        exts.append(supported_versions(*([GREASE[7]] if grease else []), 0x0304, 0x0303))
        exts.append(extension(51, _vec(2, struct.pack("!HH", 29, 32) + os.urandom(32))))  # key_share x25519
    exts.append(extension(10, _vec(2, b"\x00\x1d\x00\x17")))  # supported_groups
    exts.extend(extra)
    if grease:
        exts.append(extension(GREASE[9], b"\x00"))
    if padding:
        exts.append(extension(21, bytes(padding)))  # RFC 7685
    return out + _vec(2, b"".join(exts))


def handshake(hello_body: bytes, msg_type: int = 1) -> bytes:
    return bytes([msg_type]) + len(hello_body).to_bytes(3, "big") + hello_body


def record(fragment: bytes, content_type: int = 22, version: int = 0x0301) -> bytes:
    return struct.pack("!BHH", content_type, version, len(fragment)) + fragment


def records(message: bytes, sizes: Iterable[int] = ()) -> bytes:
    """``message`` cut into records of ``sizes`` bytes each, then one for the rest."""
    out, pos = b"", 0
    for size in sizes:
        if pos >= len(message):
            break
        out += record(message[pos : pos + size])
        pos += size
    if pos < len(message):
        out += record(message[pos:])
    return out


def client_hello(sni: str | bytes | None = "origin.test", **kwargs: object) -> bytes:
    """One record holding one hand-built ClientHello."""
    return record(handshake(body(sni, **kwargs)))  # type: ignore[arg-type]


def python_hello(sni: str | None, *, max_version: ssl.TLSVersion | None = None) -> bytes:
    """The bytes OpenSSL sends first as a client, through Python's ssl module."""
    ctx = ssl.create_default_context()
    if sni is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if max_version is not None:
        ctx.maximum_version = max_version
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def ech_extension(outer: bool = True) -> bytes:
    """encrypted_client_hello (draft-ietf-tls-esni §5): outer (type 0) with HKDF-SHA256/AES-128-GCM, or inner (1)."""
    if not outer:
        return extension(ECH, b"\x01")
    payload = b"\x00" + struct.pack("!HH", 1, 1) + b"\x2a" + _vec(2, os.urandom(32)) + _vec(2, os.urandom(208))
    return extension(ECH, payload)


def server_hello(*, hrr: bool = False, group: int = 0x0017, session_id: bytes = b"") -> bytes:
    """One record holding a TLS 1.3 ServerHello, or a HelloRetryRequest asking for ``group``."""
    random = HRR_RANDOM if hrr else os.urandom(32)
    key_share = struct.pack("!H", group) if hrr else struct.pack("!HH", 29, 32) + os.urandom(32)
    exts = extension(43, struct.pack("!H", 0x0304)) + extension(51, key_share)
    message = b"\x03\x03" + random + _vec(1, session_id) + struct.pack("!H", 0x1301) + b"\x00" + _vec(2, exts)
    return record(handshake(message, msg_type=2), version=0x0303)


# RFC 8446 §D.4: the dummy change_cipher_spec record of middlebox compatibility mode.
CCS = record(b"\x01", content_type=20, version=0x0303)
