"""Host names and IP literals: parsing and the one canonical form.

Every comparison egressd makes (allowlist matching, approvals, the audit log)
is done on ``normalise_host``'s output, so two spellings of one destination can
never be decided differently. IP literals are recognised in every spelling a
client library accepts (inet_aton shorthand, hex, octal, IPv6 with zone ids),
because a spelling we took for a name would slip past the IP-literal rule.

Pure: no I/O, except that the bundled Public Suffix List is read once, lazily
(``egressd.names.suffixes``, the one copy egressd keeps).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

import idna

from . import suffixes
from .addresses import IPAddress, unmapped
from .shown import quoted

__all__ = [
    "Host",
    "HostError",
    "is_public_suffix",
    "normalise_host",
    "normalised",
    "parse_host",
    "parse_ip_literal",
    "registered_domain",
    "split_port",
    "unicode_host",
]

# RFC 1035 §2.3.4: 63 octets per label, 255 per name on the wire, which is 253
# characters of dotted text without the trailing dot.
_MAX_LABEL = 63
_MAX_NAME = 253

# Letters, digits and hyphen (RFC 1123 §2.1), plus underscore: real names
# (_dmarc, SRV-style and some CDN hosts) use it and resolvers accept it.
_ASCII_LABEL = re.compile(r"[a-z0-9_-]{1,63}")

# RFC 6874 §2: ZoneID = 1*( unreserved / pct-encoded ).
_ZONE_ID = re.compile(r"[A-Za-z0-9._~%-]+")

_RADIX_DIGITS = {
    8: frozenset("01234567"),
    10: frozenset("0123456789"),
    16: frozenset("0123456789abcdefABCDEF"),
}

# A part with more significant digits than this is out of range in any radix;
# refusing it early also keeps int() clear of its digit-count limit.
_MAX_PART_DIGITS = 12


class HostError(ValueError):
    """A host, port or authority is malformed (``egressd.names.authority`` raises it too)."""


def _uts46(text: str) -> str:
    """Apply the UTS 46 mapping (nontransitional), as browsers and curl do."""
    try:
        return idna.uts46_remap(text, std3_rules=False, transitional=False)
    except idna.IDNAError as error:
        raise HostError(f"not a valid internationalised name: {quoted(text)}") from error


def _ipv4_number(part: str) -> int | None:
    """Parse one dotted part the way inet_aton and WHATWG do; None if not a number.

    WHATWG URL §4.4 "IPv4 number parser": ``0x``/``0X`` means hex, a leading
    ``0`` means octal, and a bare ``0x`` is zero.
    """
    if not part:
        return None
    radix = 10
    if part[:2] in ("0x", "0X"):
        radix, part = 16, part[2:]
    elif len(part) > 1 and part[0] == "0":
        radix, part = 8, part[1:]
    if not part:
        return 0
    if not set(part) <= _RADIX_DIGITS[radix]:
        return None
    significant = part.lstrip("0") or "0"
    if len(significant) > _MAX_PART_DIGITS:
        return 1 << 64
    return int(significant, radix)


def _parse_ipv4(text: str) -> IPv4Address | None:
    """Parse every inet_aton / WHATWG spelling of an IPv4 address; None for a name.

    WHATWG URL §3.5 "ends in a number checker": a host whose last label is a
    number is an IPv4 address or nothing; it is never a DNS name.
    """
    parts = text.split(".")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()
    last = parts[-1]
    if not (last.isascii() and last.isdigit()) and _ipv4_number(last) is None:
        return None
    numbers = [_ipv4_number(part) for part in parts]
    if len(parts) > 4 or None in numbers:
        raise HostError(f"malformed IPv4 address {quoted(text)}")
    values = [number for number in numbers if number is not None]
    if any(value > 255 for value in values[:-1]) or values[-1] >= 256 ** (5 - len(values)):
        raise HostError(f"IPv4 address out of range {quoted(text)}")
    result = values[-1]
    for index, value in enumerate(values[:-1]):
        result += value << (8 * (3 - index))
    return IPv4Address(result)


def _parse_ipv6(text: str) -> IPv6Address:
    """Parse an IPv6 address with an optional zone id, which is dropped."""
    address_text, percent, zone = text.partition("%")
    if percent and not _ZONE_ID.fullmatch(zone):
        raise HostError(f"malformed IPv6 zone id in {quoted(text)}")
    try:
        return IPv6Address(address_text)
    except ipaddress.AddressValueError as error:
        raise HostError(f"malformed IPv6 address {quoted(text)}") from error


def parse_ip_literal(text: str) -> IPAddress | None:
    """Recognise an IP literal in any spelling; None when the text is not one.

    Accepts dotted quads, inet_aton shorthand (``127.1``, ``2130706433``,
    ``0x7f.1``, ``0177.0.0.1``), one trailing dot, IPv6 bracketed or not, with
    or without a zone id (``fe80::1%eth0``, ``[fe80::1%25eth0]``). Non-ASCII
    text is UTS 46-mapped first, as WHATWG does, so full-width digits count.
    Raises HostError for text that can only be a broken IP literal: brackets
    around a non-IPv6, a colon outside a valid IPv6, or a numeric last label
    that is out of range (``256.1.1.1``, ``1.2.3.4.5``). None does not mean the
    text is a valid name: ``normalise_host`` decides that.
    """
    if not text.isascii():
        try:
            text = _uts46(text)
        except HostError:
            return None
    if text.startswith("["):
        if not text.endswith("]"):
            raise HostError(f"unbalanced bracket in {quoted(text)}")
        return _parse_ipv6(text[1:-1])
    if ":" in text:
        return _parse_ipv6(text)
    return _parse_ipv4(text)


def _address_text(address: IPAddress) -> str:
    """The compressed canonical text; IPv4-mapped addresses stay in hex form.

    Spelled out because Python 3.13 changed ``str()`` of IPv4-mapped addresses
    to dotted form, and the canonical form must not depend on the interpreter.
    """
    plain = unmapped(address)
    if plain is address:
        return address.compressed
    value = int(plain)
    return f"::ffff:{value >> 16:x}:{value & 0xFFFF:x}"


def _label(label: str) -> str:
    """Validate one label and return its ASCII (A-label) form."""
    if not label:
        raise HostError("empty label in host name")
    if not label.isascii():
        try:
            return idna.alabel(label).decode("ascii")
        except idna.IDNAError as error:
            raise HostError(f"invalid label {quoted(label)}: {error}") from error
    if label.startswith("xn--"):
        # An A-label must decode and re-encode to itself (RFC 5891 §5.4), or
        # two spellings of one name would compare unequal.
        try:
            canonical = idna.alabel(idna.ulabel(label)).decode("ascii")
        except idna.IDNAError as error:
            raise HostError(f"invalid A-label {quoted(label)}: {error}") from error
        if canonical != label:
            raise HostError(f"non-canonical A-label {quoted(label)}")
        return label
    # RFC 1123 §2.1 / RFC 5891 §4.2.3.1: no hyphen at either end of a label.
    if not _ASCII_LABEL.fullmatch(label) or label[0] == "-" or label[-1] == "-":
        raise HostError(f"invalid label {quoted(label)}")
    return label


@dataclass(frozen=True, slots=True)
class Host:
    """A host parsed once: ``name``, its canonical text (``normalise_host``), and ``address`` when it is an IP."""

    name: str
    address: IPAddress | None


def parse_host(text: str) -> Host:
    """``normalise_host``'s text and ``parse_ip_literal``'s address of ``text``, from one parse."""
    address = parse_ip_literal(text)
    if address is not None:
        return Host(_address_text(address), address)
    return Host(_normal_name(text), None)


def normalise_host(text: str) -> str:
    """Return the canonical form of a host: the form every comparison uses.

    IP literals become the address's compressed text (IPv6 without brackets or
    zone id; IPv4-mapped as ``::ffff:7f00:1``). Names are UTS 46-mapped and
    lowercased, lose exactly one trailing dot, and become A-labels (punycode).
    Raises HostError for anything else. Idempotent.
    """
    address = parse_ip_literal(text)
    if address is not None:
        return _address_text(address)
    return _normal_name(text)


def normalised(text: str) -> str | None:
    """``normalise_host(text)``, or None for text that is no host (a TLS server name, say, to compare)."""
    try:
        return normalise_host(text)
    except HostError:
        return None


def _normal_name(text: str) -> str:
    """``normalise_host`` of text that is no IP literal."""
    name = text.lower() if text.isascii() else _uts46(text)
    if name.endswith("."):
        name = name[:-1]
    result = ".".join(_label(label) for label in name.split("."))
    if len(result) > _MAX_NAME:
        raise HostError(f"host name longer than {_MAX_NAME} characters: {quoted(text)}")
    return result


def unicode_host(ascii_host: str) -> str:
    """Return the U-label (display) form of a normalised host.

    For showing to people only; never compare with it. Returns the input
    unchanged when any label does not decode.
    """
    try:
        return ".".join(idna.ulabel(label) if label.startswith("xn--") else label for label in ascii_host.split("."))
    except UnicodeError:
        return ascii_host


def registered_domain(host: str) -> str | None:
    """Return the registrable domain (eTLD+1) of a host, e.g. ``example.co.uk``.

    None for IP literals and for public suffixes themselves. The private PSL
    section counts, so ``alice.github.io`` is its own registered domain.
    Raises HostError for a malformed host.
    """
    name = normalise_host(host)
    if parse_ip_literal(name) is not None:
        return None
    return suffixes.registrable_domain(name)


def is_public_suffix(name: str) -> bool:
    """Whether a name is itself a public suffix (``com``, ``co.uk``, ``github.io``).

    False for IP literals. Raises HostError for a malformed name.
    """
    host = normalise_host(name)
    if parse_ip_literal(host) is not None:
        return False
    return suffixes.is_public_suffix(host)


def split_port(text: str) -> tuple[str, str]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as (host, port text; empty when none), unchecked."""
    text = text.strip()
    if text.startswith("["):
        inside, _, rest = text[1:].partition("]")
        return inside, rest[1:] if rest.startswith(":") else rest
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    return text, ""
