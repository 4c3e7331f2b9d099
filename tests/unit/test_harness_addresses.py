"""The test session's own loopback addresses (tests/harness.py) and the spellings derived from them (pure).

Every spelling must read back as the address it was made from, by the libc's lenient reader
(inet_aton, what curl and most clients use) and by egressd's own: else an attack test would be
sending something that is not the leak detector's address, and would pass without proving anything.
"""

from __future__ import annotations

import socket
from ipaddress import IPv4Address, IPv4Network, IPv6Address

import pytest

from egressd.names.hosts import parse_ip_literal
from tests.harness import LEAK, LEAK_SPELLINGS, NET, ORIGIN, ORIGIN_RANGE, mapped, session_net, spellings

# The session's own, plus addresses whose octets stress the arithmetic: 0, 255, 8 and 9 (not octal digits).
ADDRESSES = [
    pytest.param(LEAK, id="session-leak"),  # ids, not the addresses: the same in every session
    pytest.param(ORIGIN, id="session-origin"),
    *(pytest.param(a, id=a) for a in ("127.0.0.66", "127.255.255.254", "127.8.9.80", "127.1.0.1", "127.0.0.0")),
]


def _reads_back(spelling: str) -> IPv4Address:
    """The address a spelling means: IPv4 forms as inet_aton reads them, IPv6 forms via their mapped IPv4."""
    if spelling.startswith("["):
        mapped_address = IPv6Address(spelling[1:-1]).ipv4_mapped
        assert mapped_address is not None, spelling
        return mapped_address
    return IPv4Address(socket.inet_aton(spelling))


@pytest.mark.parametrize("address", ADDRESSES)
def test_every_spelling_reads_back_as_its_address(address: str) -> None:
    written = spellings(address)
    assert len(set(written.values())) == len(written) and address not in written.values()
    for name, spelling in written.items():
        assert _reads_back(spelling) == IPv4Address(address), (name, spelling)
        parsed = parse_ip_literal(spelling)  # egressd keeps a mapped address IPv6: compare what it maps
        assert (parsed.ipv4_mapped if isinstance(parsed, IPv6Address) else parsed) == IPv4Address(address), name


@pytest.mark.parametrize("address", ADDRESSES)
def test_both_mapped_forms_are_the_address(address: str) -> None:
    for text in mapped(address):
        assert IPv6Address(text).ipv4_mapped == IPv4Address(address), text


def test_the_spellings_have_the_shapes_they_are_named_for() -> None:
    written = spellings("127.0.0.66")
    assert written == {
        "integer": "2130706498",
        "hex-integer": "0x7f000042",
        "octal-parts": "0177.0.0.0102",
        "three-parts": "127.0.66",
        "two-parts": "127.66",
        "hex-and-decimal-parts": "0x7f.0.0.0x42",
        "mapped-dotted": "[::ffff:127.0.0.66]",
        "mapped-hex": "[::ffff:7f00:42]",
    }
    assert mapped("127.0.0.66") == ("::ffff:127.0.0.66", "::ffff:7f00:42")


def test_the_session_addresses_are_one_loopback_24_clear_of_127_0() -> None:
    assert NET.prefixlen == 24 and NET.subnet_of(IPv4Network("127.0.0.0/8"))
    assert not NET.overlaps(IPv4Network("127.0.0.0/16"))  # 127.0.0.1, 127.0.1.1 and the hand-written 127.0.0.x
    assert {IPv4Address(ORIGIN), IPv4Address(LEAK)} <= set(NET) and ORIGIN != LEAK
    assert ORIGIN_RANGE == f"{ORIGIN}/32" and IPv4Address(LEAK) not in IPv4Network(ORIGIN_RANGE)
    assert [p.values[0] for p in LEAK_SPELLINGS] == [LEAK, *spellings(LEAK).values()]
    assert [p.id for p in LEAK_SPELLINGS] == ["dotted", *spellings("127.0.0.66")]  # the same ids every session


def test_sessions_choose_apart_and_a_choice_by_hand_is_checked() -> None:
    chosen = {session_net() for _ in range(200)}
    assert len(chosen) > 150  # random, not one fixed /24 (200 draws from 224 x 254 rarely meet)
    for net in chosen:
        _, a, b, _ = net.network_address.packed
        assert 16 <= a < 240 and 1 <= b <= 254 and net.prefixlen == 24
    assert session_net("127.77.12") == IPv4Network("127.77.12.0/24")
    for bad in ("10.1.2", "127.0.5", "127.3.255", "127.3"):
        with pytest.raises(ValueError):
            session_net(bad)
