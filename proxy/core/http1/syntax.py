"""What RFC 9110 and RFC 9112 let a message hold, and the error a message that breaks them earns.

``HttpError`` carries the status to answer, chosen by whose fault the message is
(``CLIENT``: 400, 431, 501, 505; ``UPSTREAM``: always 502); the byte classes are the
grammar's, shared by the head parser and the chunked-body scanner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


class HttpError(Exception):
    """Malformed or unsupported HTTP; ``detail`` is short and safe to show the client."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status} {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Faults:
    """The status to use for each kind of error, by whose fault it is."""

    malformed: int
    too_large: int
    version: int
    coding: int


CLIENT: Final = Faults(malformed=400, too_large=431, version=505, coding=501)
UPSTREAM: Final = Faults(malformed=502, too_large=502, version=502, coding=502)

# RFC 9110 §5.6.2 tchar, for methods, field names and transfer codings.
TCHAR: Final = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Every byte a line may hold: no controls but HTAB (RFC 9110 §5.5 for field
# values, RFC 9112 §3 for the start line), and a head also holds line ends.
LINE_BYTES: Final = bytes(b for b in range(256) if b == 0x09 or 0x20 <= b != 0x7F)
OWS: Final = " \t"
