"""How a message body ends, found without decoding it (RFC 9112 §6, §7.1).

``declared_framing`` reads the framing a head's fields declare and refuses every
ambiguous one (the smuggling vectors); ``ChunkedScanner`` finds where a chunked
body ends. ``heads`` adds the rules by method and status (``request_body_kind``,
``response_body_kind``).

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import enum
from typing import Final, NoReturn

from egressd.proxy.core.http1.syntax import LINE_BYTES, OWS, TCHAR, Faults, HttpError

_HEXDIG: Final = b"0123456789abcdefABCDEF"
# 18 decimal digits stay below 2**63; anything longer is not a real body.
_MAX_CONTENT_LENGTH_DIGITS: Final = 18


class BodyKind(enum.Enum):
    """How the body after a head ends (RFC 9112 §6.3)."""

    NONE = "none"
    LENGTH = "length"  # exactly N bytes
    CHUNKED = "chunked"  # until the last chunk and trailers: use ChunkedScanner
    UNTIL_CLOSE = "until_close"  # responses only: until the upstream closes


# The answers without a length, made once (an enum member's lookup is not free).
NO_BODY: Final = (BodyKind.NONE, 0)
_CHUNKED: Final = (BodyKind.CHUNKED, 0)
UNTIL_CLOSE: Final = (BodyKind.UNTIL_CLOSE, 0)
_LENGTH: Final = BodyKind.LENGTH

# Transfer codings registered with IANA that may precede chunked; we relay
# them untouched, the point is only to refuse names nobody defined.
_KNOWN_CODINGS: Final = frozenset({"gzip", "x-gzip", "deflate", "compress", "x-compress"})


def declared_framing(headers: list[tuple[str, str]], version: str, faults: Faults) -> tuple[BodyKind, int]:
    """The framing a head's fields declare (its length for LENGTH, else 0), or HttpError if they are ambiguous.

    1. Transfer-Encoding with Content-Length is refused, not resolved: a
       message with both is the classic smuggling vector (RFC 9112 §6.1);
    2. Transfer-Encoding in HTTP/1.0 is faulty framing (RFC 9112 §6.1);
    3. chunked must be the final coding, once (RFC 9112 §6.3 item 4, §7);
    4. Content-Length must be digits, all copies the same (RFC 9110 §8.6).
    """
    lengths: list[str] = []
    codings: list[str] = []
    for name, value in headers:
        # By length first: lowercasing every name costs more than len().
        size = len(name)
        if size == 14 and name.lower() == "content-length":
            lengths += value.split(",")
        elif size == 17 and name.lower() == "transfer-encoding":
            codings += value.split(",")
    if codings:
        if lengths:
            raise HttpError(faults.malformed, "both Content-Length and Transfer-Encoding")
        if version == "HTTP/1.0":
            raise HttpError(faults.malformed, "Transfer-Encoding in an HTTP/1.0 message")
        # RFC 9110 §5.6.1: empty list elements are ignored.
        names = [coding.strip(OWS).lower() for coding in codings if coding.strip(OWS)]
        if not names or names[-1] != "chunked":
            raise HttpError(faults.malformed, "chunked must be the final transfer coding")
        for coding in names[:-1]:
            if coding == "chunked":
                raise HttpError(faults.malformed, "chunked applied more than once")
            if coding not in _KNOWN_CODINGS:
                raise HttpError(faults.coding, "unsupported transfer coding")
        return _CHUNKED
    if lengths:
        value = lengths[0].strip(OWS)
        for length in lengths[1:]:
            if length.strip(OWS) != value:
                raise HttpError(faults.malformed, "conflicting Content-Length values")
        if (
            not 0 < len(value) <= _MAX_CONTENT_LENGTH_DIGITS
            or not value.isascii()
            or not value.isdigit()
        ):
            raise HttpError(faults.malformed, "invalid Content-Length")
        return _LENGTH, int(value)
    return NO_BODY


# Longest chunk-size line (size and extensions) and trailer section we relay;
# RFC 9112 §7.1.1 asks recipients to limit extensions, real ones are short.
_MAX_CHUNK_LINE: Final = 4096
_MAX_TRAILER_BYTES: Final = 64 * 1024
# 16 hex digits is 2**64 - 1 bytes; longer sizes are overflow attempts.
_MAX_CHUNK_SIZE_DIGITS: Final = 16


class _Chunk(enum.Enum):
    """Where a ChunkedScanner is in the chunked-body grammar (RFC 9112 §7.1)."""

    SIZE = enum.auto()  # reading a chunk-size line
    DATA = enum.auto()  # skipping chunk data
    DATA_CR = enum.auto()  # expecting the CR after chunk data
    DATA_LF = enum.auto()  # expecting the LF after chunk data
    TRAILER = enum.auto()  # reading trailer lines until the empty one
    DONE = enum.auto()
    FAILED = enum.auto()


# The states as module constants: an Enum member's lookup on its class costs ten times a global's,
# and ``feed`` reads several per framing line.
_SIZE: Final = _Chunk.SIZE
_DATA: Final = _Chunk.DATA
_DATA_CR: Final = _Chunk.DATA_CR
_DATA_LF: Final = _Chunk.DATA_LF
_TRAILER: Final = _Chunk.TRAILER
_DONE: Final = _Chunk.DONE
_FAILED: Final = _Chunk.FAILED


class ChunkedScanner:
    """Find where a chunked body (RFC 9112 §7.1) ends, without decoding it.

    Feed the bytes that follow the head, in any pieces; ``feed`` returns how
    many of them belong to the body, all of them until the piece where the
    body ends. Relay exactly those bytes, then stop when ``done``. Chunk data
    is skipped in O(1) per feed. Framing lines must end in CRLF (no bare LF
    inside a body, unlike heads: there a lenient reader is a smuggling
    vector). Raises ``HttpError(error_status)`` on malformed framing; a
    scanner that raised stays failed.
    """

    __slots__ = ("_state", "_remaining", "_line", "_trailer_budget", "_error_status")

    def __init__(self, error_status: int = 400) -> None:
        self._state = _SIZE
        self._remaining = 0
        self._line = bytearray()
        self._trailer_budget = _MAX_TRAILER_BYTES
        self._error_status = error_status

    @property
    def done(self) -> bool:
        """True once the last chunk and the trailer section have been seen."""
        return self._state is _DONE

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """Scan ``data``; the number of its leading bytes that belong to the body."""
        if self._state is _FAILED:
            raise HttpError(self._error_status, "malformed chunked body")
        pos = 0
        end = len(data)
        text = data if not isinstance(data, memoryview) else None
        while pos < end:
            state = self._state
            if state is _DATA:
                step = min(self._remaining, end - pos)
                pos += step
                self._remaining -= step
                if not self._remaining:
                    self._state = _DATA_CR
            elif state is _DATA_CR and end - pos >= 2:
                if data[pos : pos + 2] != b"\r\n":
                    self._fail("chunk data not followed by CRLF")
                pos += 2
                self._state = _SIZE
            elif state is _DATA_CR:
                if data[pos] != 0x0D:
                    self._fail("chunk data not followed by CRLF")
                pos += 1
                self._state = _DATA_LF
            elif state is _DATA_LF:
                if data[pos] != 0x0A:
                    self._fail("chunk data not followed by CRLF")
                pos += 1
                self._state = _SIZE
            elif state is _DONE:
                break
            else:
                if text is None:
                    # Lines need find(); a memoryview is copied once, only
                    # when a feed reaches a line at all.
                    text = bytes(data)
                pos = self._scan_line(text, pos, end)
        return pos

    def _scan_line(self, text: bytes | bytearray, pos: int, end: int) -> int:
        """Consume up to one line from ``text[pos:end]``; the new position."""
        state = self._state
        limit = _MAX_CHUNK_LINE if state is _SIZE else self._trailer_budget
        room = limit - len(self._line)
        newline = text.find(b"\n", pos, pos + room)
        if newline < 0:
            if end - pos >= room:
                self._fail("chunk line too long" if state is _SIZE else "trailers too large")
            self._line += text[pos:end]
            return end
        if self._line:
            self._line += text[pos : newline + 1]
            line = bytes(self._line)
            self._line.clear()
        else:
            line = bytes(text[pos : newline + 1])
        if len(line) < 2 or line[-2] != 0x0D:
            self._fail("chunk framing line not ended by CRLF")
        content = line[:-2]
        if content.translate(None, LINE_BYTES):
            self._fail("control character in chunk framing")
        if state is _SIZE:
            self._on_size(content)
        else:
            self._trailer_budget -= len(line)
            self._on_trailer(content)
        return newline + 1

    def _on_size(self, content: bytes) -> None:
        """Read ``chunk-size [ chunk-ext ]``; extensions are relayed, not interpreted."""
        # chunk-ext = *( BWS ";" BWS ext-name [ BWS "=" BWS ext-val ] ): BWS may
        # precede the first ";", nothing else may follow the hex digits.
        size, semicolon, _ = content.partition(b";")
        if semicolon:
            size = size.rstrip(b" \t")
        if not 0 < len(size) <= _MAX_CHUNK_SIZE_DIGITS or size.translate(None, _HEXDIG):
            self._fail("invalid chunk size")
        self._remaining = int(size, 16)
        self._state = _DATA if self._remaining else _TRAILER

    def _on_trailer(self, content: bytes) -> None:
        """Check one trailer field line (RFC 9112 §7.1.2); the empty one ends the body."""
        if not content:
            self._state = _DONE
            return
        name, colon, _ = content.partition(b":")
        if not colon or not name or name.translate(None, TCHAR):
            self._fail("malformed trailer field")

    def _fail(self, detail: str) -> NoReturn:
        self._state = _FAILED
        raise HttpError(self._error_status, detail)
