"""IP addresses as values: the one ``IPAddress`` type and ``unmapped``.

Pure: no I/O.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

__all__ = ["IPAddress", "unmapped"]

IPAddress = IPv4Address | IPv6Address


def unmapped(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv4-mapped IPv6 address maps; any other address unchanged.

    ``::ffff:127.0.0.1`` is how a dual-stack socket sees or reaches
    127.0.0.1 (RFC 4291 §2.5.5.2): one host, so one key, one classification,
    one entry.
    """
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
