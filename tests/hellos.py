"""ClientHellos for tests, built by hand (RFC 8446 §4.1.2) or taken from Python's ssl.

``handshake(...)`` is the handshake message (type 1, 3-byte length, body);
``records(message, sizes)`` cuts it into TLS records of the given fragment
sizes (the last takes the rest); ``python_hello(sni)`` is the first flight
OpenSSL sends through Python's ssl module, records and all.
"""

from __future__ import annotations

import os
import ssl
import struct
from collections.abc import Iterable, Sequence

# RFC 8701: GREASE values, 0x0A0A .. 0xFAFA.
GREASE = tuple(0x0A0A + 0x1010 * i for i in range(16))


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
