"""``HOST:PORT`` text (an authority, RFC 3986 §3.2): the one parser.

egressd reads authorities in several places, and their rules differ on
purpose; each difference is a keyword parameter here, so it is visible where
the parser is called:

- defaults (``parse_authority(text)``; the allowlist, ``egressd.proxy.core.policy``, calls
  ``split_authority`` and ``parse_port`` itself, with these rules): no
  default port; port 1..65535 in at most 5 ASCII digits; unbracketed text
  with two or more colons is an IPv6 address without a port; the host is
  ``normalise_host``'d; bracket and missing-port errors come before host errors.
- CONNECT and absolute-form targets (``egressd.proxy.core.http1``): default port none or
  80; the port starts after the first colon (``Colons.FIRST``: IPv6 needs
  brackets); the host is checked for syntax only; host errors come first
  (``host_first``).
- ``--upstream-dns`` (``egressd.proxy.net.resolver``): default port 53; any number of
  leading zeros (``port_digits=None``); the host is an IP or a DNS name.
- listen and control addresses (``egressd.config.settings``): a port is required
  and port 0 (any free port) allowed (``port_zero``); the port follows the
  last colon, brackets or not (``Colons.LAST``); any number of leading
  zeros; any Unicode decimal digit (``port_unicode_digits``, as ``int()``);
  the host is checked by the caller (an IP or ``localhost``).

Port 0 is "any free port" for a socket we listen on, never a destination.
Every failure of the parser itself is an ``AuthorityError`` whose ``fault``
says what was wrong, so a caller can keep its own wording (an HTTP 400, a
setting's message); the host check's own errors pass through unchanged.

Pure: no I/O.
"""

from __future__ import annotations

import enum
import unicodedata
from collections.abc import Callable

from .hosts import HostError, normalise_host
from .shown import quoted

__all__ = ["AuthorityError", "Colons", "Fault", "parse_authority", "parse_port", "split_authority"]


class Fault(enum.Enum):
    """What is wrong with an authority, for callers that word their own message."""

    BRACKET = "unbalanced bracket"
    AFTER_BRACKET = "text after ']' that is not ':PORT'"
    MISSING_PORT = "missing port"
    PORT = "port is not a number"
    PORT_RANGE = "port is out of range"


class AuthorityError(HostError):
    """An authority is malformed: ``fault`` says how, ``part`` is the offending text."""

    def __init__(self, fault: Fault, part: str, message: str) -> None:
        super().__init__(message)
        self.fault = fault
        self.part = part


class Colons(enum.Enum):
    """What unbracketed text with two or more colons means."""

    IPV6_HOST = "an IPv6 address without a port (RFC 3986 §3.2.2: only brackets let one carry a port)"
    FIRST = "brackets are required for IPv6: the port starts after the first colon"
    LAST = "the port follows the last colon, brackets or not: an unbracketed IPv6 address may carry one"


def split_authority(text: str, *, colons: Colons = Colons.IPV6_HOST) -> tuple[str, str | None]:
    """Split ``host:port`` or ``[v6]:port`` into host text and port text.

    The host text keeps its brackets; the port text is None when there is
    none. Nothing is validated beyond the brackets (with ``Colons.LAST`` not
    even those: the host check sees them): the pieces go to a host check and
    ``parse_port``.
    """
    host, port, fault = _split(text, colons)
    if fault is not None:
        raise fault
    return host, port


def _split(text: str, colons: Colons) -> tuple[str, str | None, AuthorityError | None]:
    """``split_authority``, but text after ``]`` that is not ``:PORT`` is returned as an error, not raised.

    So that a caller may check the host first (``parse_authority``'s ``host_first``).
    """
    if colons is Colons.LAST:
        host, colon, port = text.rpartition(":")
        return (host, port, None) if colon else (text, None, None)
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise AuthorityError(Fault.BRACKET, text, f"unbalanced bracket in {quoted(text)}")
        host, rest = text[: end + 1], text[end + 1 :]
        if not rest:
            return host, None, None
        if not rest.startswith(":"):
            fault = AuthorityError(Fault.AFTER_BRACKET, rest, f"unexpected text after ']' in {quoted(text)}")
            return host, None, fault
        return host, rest[1:], None
    count = text.count(":")
    if count == 0 or (count > 1 and colons is Colons.IPV6_HOST):
        return text, None, None
    host, _, port = text.partition(":")
    return host, port, None


def parse_port(text: str, *, zero: bool = False, digits: int | None = 5, unicode_digits: bool = False) -> int:
    """Parse a decimal port (RFC 3986 §3.2.3: ASCII digits only, no sign or space).

    1..65535, or 0..65535 with ``zero`` (a socket we listen on: any free
    port). ``digits`` bounds the text's length (leading zeros included);
    None allows any number of leading zeros. ``unicode_digits`` also takes
    any Unicode decimal digit (``١٢٣``), as ``int()`` does: the settings
    always have.
    """
    if unicode_digits and text.isdecimal():
        text = "".join(str(unicodedata.decimal(char)) for char in text)
    if not (text.isascii() and text.isdigit()) or (digits is not None and len(text) > digits):
        raise AuthorityError(Fault.PORT, text, f"invalid port {quoted(text)}")
    significant = text.lstrip("0") or "0"
    if len(significant) > 5 or not (0 if zero else 1) <= int(significant) <= 65535:
        raise AuthorityError(Fault.PORT_RANGE, text, f"invalid port {quoted(text)}")
    return int(significant)


def parse_authority(
    text: str,
    default_port: int | None = None,
    *,
    colons: Colons = Colons.IPV6_HOST,
    port_zero: bool = False,
    port_digits: int | None = 5,
    port_unicode_digits: bool = False,
    host: Callable[[str], str] = normalise_host,
    host_first: bool = False,
) -> tuple[str, int]:
    """Parse ``host:port``, ``[v6]:port`` or a bare host into (host, port).

    1. split (``split_authority``, by ``colons``);
    2. check the host text, brackets included, with ``host``, which returns
       it in the caller's form (by default: normalised) or raises;
    3. a bare host takes ``default_port`` (not checked: it is the caller's
       constant); without one it is an error;
    4. parse the port (``parse_port`` with ``port_zero``, ``port_digits``,
       ``port_unicode_digits``).

    Which error a text with several faults gets: an unbalanced bracket
    first; then, by default, text after ``]`` and a missing port before the
    host check; with ``host_first`` (HTTP's order) the host check before them.
    """
    host_text, port_text, fault = _split(text, colons)
    if not host_first:
        if fault is not None:
            raise fault
        if port_text is None and default_port is None:
            raise _missing_port(text)
    checked = host(host_text)
    if fault is not None:
        raise fault
    if port_text is not None:
        return checked, parse_port(port_text, zero=port_zero, digits=port_digits, unicode_digits=port_unicode_digits)
    if default_port is None:
        raise _missing_port(text)
    return checked, default_port


def _missing_port(text: str) -> AuthorityError:
    return AuthorityError(Fault.MISSING_PORT, text, f"missing port in {quoted(text)}")
