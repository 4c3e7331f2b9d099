"""Classify resolved addresses before dialling: which ones egressd may connect to.

A name that passed the policy can still resolve to a loopback, private or
cloud metadata address (DNS rebinding, or a hostile record). Every address is
classified here and only PUBLIC ones are dialled, unless the operator named
the range in ``allow_private``.

egressd itself is a separate question, asked per (address, port): "own"
means its listening endpoints (``OwnEndpoints``), never a whole address, so
another service on 127.0.0.1 is an ordinary loopback destination while the
proxy's and the control API's ports are never dialled, ``allow_private`` or
not (``is_own``).

Classification follows the IANA IPv4 and IPv6 Special-Purpose Address
Registries (RFC 6890 and updates). IPv6 addresses that embed an IPv4 address
(mapped, NAT64, 6to4, Teredo, ...) are judged by the IPv4 inside, so
``::ffff:127.0.0.1`` is loopback. Only IPv4-mapped and well-known-prefix NAT64
addresses actually reach the embedded IPv4 address; the other embedding forms
(IPv4-compatible, IPv4-translated, local-use NAT64, 6to4, Teredo) are
deprecated or local transition mechanisms, so they are never PUBLIC: when the
embedded IPv4 is public they are RESERVED.

Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

from egressd.names.addresses import IPAddress

__all__ = ["AddressClass", "OwnEndpoints", "classify", "embedded_ipv4", "forbidden_reason", "is_own"]


class AddressClass(enum.Enum):
    """What kind of destination an address is; only PUBLIC is dialled by default."""

    PUBLIC = "public"
    PRIVATE = "private"
    LOOPBACK = "loopback"
    LINK_LOCAL = "link_local"
    CARRIER_GRADE_NAT = "carrier_grade_nat"
    MULTICAST = "multicast"
    UNSPECIFIED = "unspecified"
    METADATA = "metadata"
    BROADCAST = "broadcast"
    RESERVED = "reserved"


# Cloud instance metadata and host endpoints: credentials live behind these.
# Checked before the ranges, because most sit inside link-local or private.
_METADATA: frozenset[IPAddress] = frozenset(
    ip_address(text)
    for text in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle IMDS
        "169.254.169.253",  # AWS VPC DNS resolver
        "169.254.169.123",  # AWS time sync
        "169.254.170.2",  # AWS ECS task metadata and credentials
        "169.254.170.23",  # AWS EKS Pod Identity agent
        "169.254.0.23",  # Tencent Cloud metadata
        "100.100.100.200",  # Alibaba Cloud metadata
        "168.63.129.16",  # Azure WireServer (host endpoint, in public space)
        "192.0.0.192",  # Oracle Cloud legacy metadata
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd00:ec2::253",  # AWS VPC DNS resolver over IPv6
        "fd00:ec2::123",  # AWS time sync over IPv6
        "fd00:ec2::23",  # AWS EKS Pod Identity agent over IPv6
    )
)

_C = AddressClass

# IANA IPv4 Special-Purpose Address Registry, plus multicast (RFC 5771) and
# limited broadcast (RFC 919). First match wins; the last row catches the rest.
_IPV4_RANGES: tuple[tuple[IPv4Network, AddressClass], ...] = tuple(
    (IPv4Network(text), kind)
    for text, kind in (
        ("0.0.0.0/32", _C.UNSPECIFIED),  # RFC 1122 §3.2.1.3: "this host"
        ("0.0.0.0/8", _C.RESERVED),  # RFC 791: "this network"
        ("10.0.0.0/8", _C.PRIVATE),  # RFC 1918
        ("100.64.0.0/10", _C.CARRIER_GRADE_NAT),  # RFC 6598
        ("127.0.0.0/8", _C.LOOPBACK),  # RFC 1122 §3.2.1.3
        ("169.254.0.0/16", _C.LINK_LOCAL),  # RFC 3927
        ("172.16.0.0/12", _C.PRIVATE),  # RFC 1918
        ("192.0.0.0/24", _C.RESERVED),  # RFC 6890: IETF protocol assignments
        ("192.0.2.0/24", _C.RESERVED),  # RFC 5737: TEST-NET-1
        ("192.31.196.0/24", _C.RESERVED),  # RFC 7535: AS112-v4
        ("192.52.193.0/24", _C.RESERVED),  # RFC 7450: AMT
        ("192.88.99.0/24", _C.RESERVED),  # RFC 7526: deprecated 6to4 relay anycast
        ("192.168.0.0/16", _C.PRIVATE),  # RFC 1918
        ("192.175.48.0/24", _C.RESERVED),  # RFC 7534: AS112 direct delegation
        ("198.18.0.0/15", _C.RESERVED),  # RFC 2544: benchmarking
        ("198.51.100.0/24", _C.RESERVED),  # RFC 5737: TEST-NET-2
        ("203.0.113.0/24", _C.RESERVED),  # RFC 5737: TEST-NET-3
        ("224.0.0.0/4", _C.MULTICAST),  # RFC 5771
        ("255.255.255.255/32", _C.BROADCAST),  # RFC 919 §7: limited broadcast
        ("240.0.0.0/4", _C.RESERVED),  # RFC 1112 §4: reserved for future use
        ("0.0.0.0/0", _C.PUBLIC),
    )
)

# IANA IPv6 Special-Purpose Address Registry. Only 2000::/3 is allocated
# global unicast (RFC 4291 §2.4); everything outside it that is not named here
# (::/8, 100::/8, 5f00::/16 SRv6, unassigned space) is RESERVED.
_IPV6_RANGES: tuple[tuple[IPv6Network, AddressClass], ...] = tuple(
    (IPv6Network(text), kind)
    for text, kind in (
        ("::/128", _C.UNSPECIFIED),  # RFC 4291 §2.5.2
        ("::1/128", _C.LOOPBACK),  # RFC 4291 §2.5.3
        ("2001::/23", _C.RESERVED),  # RFC 2928: IETF protocol assignments (ORCHID, ...)
        ("2001:db8::/32", _C.RESERVED),  # RFC 3849: documentation
        ("2620:4f:8000::/48", _C.RESERVED),  # RFC 7534: AS112 direct delegation
        ("3fff::/20", _C.RESERVED),  # RFC 9637: documentation
        ("2000::/3", _C.PUBLIC),  # RFC 4291 §2.4: global unicast
        ("fc00::/7", _C.PRIVATE),  # RFC 4193: unique local
        ("fe80::/10", _C.LINK_LOCAL),  # RFC 4291 §2.5.6
        ("fec0::/10", _C.PRIVATE),  # RFC 3879: deprecated site-local, private in scope
        ("ff00::/8", _C.MULTICAST),  # RFC 4291 §2.7
        ("::/0", _C.RESERVED),
    )
)

_MAPPED = IPv6Network("::ffff:0:0/96")  # RFC 4291 §2.5.5.2
_TRANSLATED = IPv6Network("::ffff:0:0:0/96")  # RFC 2765 §2.1 (SIIT, obsolete)
_COMPATIBLE = IPv6Network("::/96")  # RFC 4291 §2.5.5.1 (deprecated)
_NAT64 = IPv6Network("64:ff9b::/96")  # RFC 6052 §2.1: well-known prefix
_NAT64_LOCAL = IPv6Network("64:ff9b:1::/48")  # RFC 8215: local-use prefix
_SIX_TO_FOUR = IPv6Network("2002::/16")  # RFC 3056 §2
_TEREDO = IPv6Network("2001::/32")  # RFC 4380 §4

# The forms whose packets actually reach the embedded IPv4 address, so a
# public embedded address makes the IPv6 address public too.
_REACHES_EMBEDDED = (_MAPPED, _NAT64)

_LOW32 = 0xFFFFFFFF


def embedded_ipv4(addr: IPv6Address) -> IPv4Address | None:
    """Return the IPv4 address an IPv6 address carries, or None.

    Recognises IPv4-mapped, IPv4-translated, IPv4-compatible (not ``::`` or
    ``::1``), NAT64 (well-known /96 and local-use /48), 6to4 and Teredo. For
    Teredo it is the client's address (RFC 4380 §4: the low 32 bits,
    inverted); the server's is ignored.
    """
    value = int(addr)
    if addr in _MAPPED or addr in _TRANSLATED or addr in _NAT64:
        return IPv4Address(value & _LOW32)
    if addr in _COMPATIBLE:
        return IPv4Address(value) if value > 1 else None
    if addr in _NAT64_LOCAL:
        # RFC 6052 §2.2, /48 layout: octets 1-2 in bits 48-63, bits 64-71 are
        # the reserved "u" octet, octets 3-4 in bits 72-87.
        return IPv4Address((((value >> 64) & 0xFFFF) << 16) | ((value >> 40) & 0xFFFF))
    if addr in _SIX_TO_FOUR:
        return IPv4Address((value >> 80) & _LOW32)  # RFC 3056 §2: bits 16-47
    if addr in _TEREDO:
        return IPv4Address((value & _LOW32) ^ _LOW32)
    return None


def _destinations(addr: IPAddress) -> set[IPAddress]:
    """The address itself plus the IPv4 address it embeds, if any."""
    found: set[IPAddress] = {addr}
    if isinstance(addr, IPv6Address):
        inner = embedded_ipv4(addr)
        if inner is not None:
            found.add(inner)
    return found


def _plain_class(addr: IPAddress) -> AddressClass:
    """Classify by the tables alone, without looking inside embedded forms."""
    if addr in _METADATA:
        return AddressClass.METADATA
    if isinstance(addr, IPv4Address):
        return next(kind for network, kind in _IPV4_RANGES if addr in network)
    return next(kind for network, kind in _IPV6_RANGES if addr in network)


def classify(addr: IPAddress) -> AddressClass:
    """Classify an address for dialling.

    1. a cloud metadata or host endpoint → METADATA;
    2. an IPv6 address embedding a special IPv4 address → that address's class;
       embedding a public one → PUBLIC for mapped and NAT64, else RESERVED;
    3. otherwise the special-purpose tables; unlisted IPv4 and IPv6 global
       unicast (2000::/3) → PUBLIC.
    """
    if addr in _METADATA:
        return AddressClass.METADATA
    if isinstance(addr, IPv6Address):
        inner = embedded_ipv4(addr)
        if inner is not None:
            kind = _plain_class(inner)
            if kind is not AddressClass.PUBLIC:
                return kind
            if any(addr in network for network in _REACHES_EMBEDDED):
                return AddressClass.PUBLIC
            return AddressClass.RESERVED
    return _plain_class(addr)


def forbidden_reason(
    addr: IPAddress,
    allow_private: Sequence[IPv4Network | IPv6Network] = (),
) -> AddressClass | None:
    """Why an address must not be dialled, or None when it may be.

    PUBLIC → None. Every other class is forbidden unless a range in
    ``allow_private`` contains the address or the IPv4 address it embeds;
    that includes METADATA, so an operator who allows 169.254.0.0/16 allows
    the metadata service too. Whether the address and port are egressd's
    own is ``is_own``'s question, asked besides this one.
    """
    kind = classify(addr)
    if kind is AddressClass.PUBLIC:
        return None
    destinations = _destinations(addr)
    # ``in`` between an address and a network of the other IP version is False.
    if any(address in network for network in allow_private for address in destinations):
        return None
    return kind


Endpoint = tuple[IPAddress, int]


@dataclass(frozen=True, slots=True)
class OwnEndpoints:
    """egressd's listening endpoints: what no dial may reach.

    ``pairs`` are (address, port) pairs of listeners on one address, each
    address also in its embedded IPv4 form; ``any_address_ports`` are the
    ports of listeners on 0.0.0.0 or :: (each stands for every address of
    the host on its port; either family, since a dual-stack socket takes
    both); ``ports`` is every port of either, the quick first test. Build
    it with ``of``.
    """

    pairs: frozenset[Endpoint] = frozenset()
    any_address_ports: frozenset[int] = frozenset()
    ports: frozenset[int] = frozenset()

    @classmethod
    def of(cls, endpoints: Iterable[Endpoint]) -> OwnEndpoints:
        """From listeners' bound (address, port) pairs; an unspecified address means every address."""
        pairs: set[Endpoint] = set()
        wildcard: set[int] = set()
        for address, port in endpoints:
            if address.is_unspecified:
                wildcard.add(port)
            else:
                pairs |= {(destination, port) for destination in _destinations(address)}
        return cls(frozenset(pairs), frozenset(wildcard), frozenset(wildcard | {port for _, port in pairs}))


def _always_local(addr: IPAddress) -> bool:
    """Loopback (all of 127.0.0.0/8 and ::1) and the unspecified address reach this host on any machine."""
    return addr.is_loopback or addr.is_unspecified


def is_own(
    addr: IPAddress,
    port: int,
    own: OwnEndpoints,
    is_local: Callable[[IPAddress], bool],
) -> bool:
    """Whether dialling (addr, port) would reach egressd itself.

    1. ``port`` is none of egressd's listening ports → False (the common case,
       one set lookup);
    2. the address, or the IPv4 address it embeds, is a listener's with that
       port, or is unspecified (``0.0.0.0``, ``::``: a destination the kernel
       takes for this host, 127.0.0.1, whatever egressd listens on) → True;
    3. a listener on 0.0.0.0 or :: has that port, and the address (or the one
       it embeds) is loopback, unspecified, or one of the host's own
       (``is_local``, asked only here: it is the caller's I/O) → True.

    egressd dialling itself would loop, and would put its control API within
    the sandbox's reach, so a True here is refused whatever ``allow_private``
    says.
    """
    if port not in own.ports:
        return False
    destinations = _destinations(addr)
    if any((destination, port) in own.pairs or destination.is_unspecified for destination in destinations):
        return True
    if port not in own.any_address_ports:
        return False
    if any(_always_local(destination) for destination in destinations):
        return True
    return any(is_local(destination) for destination in destinations)
