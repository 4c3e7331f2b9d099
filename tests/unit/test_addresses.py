"""Address classification: what egressd refuses to dial, and the overrides."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.names.addresses import IPAddress
from egressd.proxy.core.addresses import AddressClass, classify, embedded_ipv4, forbidden_reason

C = AddressClass

CLASSES = [
    ("8.8.8.8", C.PUBLIC),
    ("1.1.1.1", C.PUBLIC),
    ("0.0.0.0", C.UNSPECIFIED),
    ("0.1.2.3", C.RESERVED),
    ("10.1.2.3", C.PRIVATE),
    ("172.16.0.1", C.PRIVATE),
    ("172.31.255.255", C.PRIVATE),
    ("172.32.0.1", C.PUBLIC),
    ("192.168.1.1", C.PRIVATE),
    ("100.64.0.1", C.CARRIER_GRADE_NAT),
    ("100.127.255.254", C.CARRIER_GRADE_NAT),
    ("127.0.0.1", C.LOOPBACK),
    ("127.255.255.254", C.LOOPBACK),
    ("169.254.1.1", C.LINK_LOCAL),
    ("169.254.169.254", C.METADATA),
    ("169.254.170.2", C.METADATA),
    ("169.254.170.23", C.METADATA),
    ("100.100.100.200", C.METADATA),
    ("168.63.129.16", C.METADATA),
    ("192.0.0.192", C.METADATA),
    ("192.0.0.9", C.RESERVED),
    ("192.0.2.1", C.RESERVED),
    ("198.51.100.1", C.RESERVED),
    ("203.0.113.1", C.RESERVED),
    ("198.18.0.1", C.RESERVED),
    ("198.19.255.255", C.RESERVED),
    ("192.88.99.1", C.RESERVED),
    ("224.0.0.1", C.MULTICAST),
    ("239.255.255.250", C.MULTICAST),
    ("240.0.0.1", C.RESERVED),
    ("255.255.255.255", C.BROADCAST),
    ("2606:4700:4700::1111", C.PUBLIC),
    ("::", C.UNSPECIFIED),
    ("::1", C.LOOPBACK),
    ("fe80::1", C.LINK_LOCAL),
    ("fc00::1", C.PRIVATE),
    ("fd12:3456::1", C.PRIVATE),
    ("fec0::1", C.PRIVATE),
    ("ff02::1", C.MULTICAST),
    ("fd00:ec2::254", C.METADATA),
    ("fd00:ec2::23", C.METADATA),
    ("2001:db8::1", C.RESERVED),
    ("2001:10::1", C.RESERVED),
    ("2001:2::1", C.RESERVED),
    ("100::1", C.RESERVED),
    ("64:ff9b:1:808:8:800::", C.RESERVED),
    ("3fff::1", C.RESERVED),
    ("4000::1", C.RESERVED),
    ("::ffff:127.0.0.1", C.LOOPBACK),
    ("::ffff:8.8.8.8", C.PUBLIC),
    ("::ffff:169.254.169.254", C.METADATA),
    ("::ffff:0:10.0.0.1", C.PRIVATE),
    ("::ffff:0:8.8.8.8", C.RESERVED),
    ("::10.0.0.1", C.PRIVATE),
    ("::8.8.8.8", C.RESERVED),
    ("64:ff9b::7f00:1", C.LOOPBACK),
    ("64:ff9b::a9fe:a9fe", C.METADATA),
    ("64:ff9b::808:808", C.PUBLIC),
    ("64:ff9b:1:7f00:0:100::", C.LOOPBACK),
    ("2002:7f00:1::1", C.LOOPBACK),
    ("2002:a9fe:a9fe::", C.METADATA),
    ("2002:808:808::1", C.RESERVED),
    # Teredo: the client address is the inverted low 32 bits; 80ff:fefe is 127.0.1.1.
    ("2001:0:4136:e378:8000:63bf:80ff:fefe", C.LOOPBACK),
    ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", C.RESERVED),
]


@pytest.mark.parametrize(
    ("text", "expected"), CLASSES, ids=[f"{a} is {b.value}" for a, b in CLASSES]
)
def test_addresses_classify_by_the_special_purpose_registries(
    text: str, expected: AddressClass
) -> None:
    assert classify(ip_address(text)) is expected


EMBEDDED = [
    ("::ffff:127.0.0.1", "127.0.0.1"),
    ("::ffff:0:1.2.3.4", "1.2.3.4"),
    ("::1.2.3.4", "1.2.3.4"),
    ("64:ff9b::1.2.3.4", "1.2.3.4"),
    ("64:ff9b:1:102:3:400::", "1.2.3.4"),
    ("2002:102:304::", "1.2.3.4"),
    ("2001:0:4136:e378:8000:63bf:fefd:fcfb", "1.2.3.4"),
    ("::", None),
    ("::1", None),
    ("2606:4700::1", None),
    ("fe80::1", None),
]


@pytest.mark.parametrize(
    ("text", "expected"), EMBEDDED, ids=[f"{a} embeds {b}" for a, b in EMBEDDED]
)
def test_embedded_ipv4_is_found_in_every_transition_form(text: str, expected: str | None) -> None:
    address = IPv6Address(text)
    assert embedded_ipv4(address) == (None if expected is None else IPv4Address(expected))


OVERRIDES: list[tuple[str, list[str], AddressClass | None]] = [
    ("8.8.8.8", [], None),
    ("127.0.0.1", [], C.LOOPBACK),
    ("127.0.0.1", ["127.0.0.0/8"], None),
    ("127.0.0.1", ["10.0.0.0/8"], C.LOOPBACK),
    ("::ffff:127.0.0.1", ["127.0.0.1/32"], None),
    ("64:ff9b::a00:5", ["10.0.0.0/8"], None),
    ("::1", ["127.0.0.0/8"], C.LOOPBACK),
    ("::1", ["::1/128"], None),
    ("169.254.169.254", [], C.METADATA),
    ("169.254.169.254", ["169.254.0.0/16"], None),
    ("fd00:ec2::254", ["fd00::/8"], None),
    ("2001:db8::1", ["2001:db8::/32"], None),
    ("224.0.0.1", ["224.0.0.0/4"], None),
    ("0.0.0.0", ["0.0.0.0/8"], None),
]


@pytest.mark.parametrize(
    ("text", "allowed", "expected"),
    OVERRIDES,
    ids=[
        f"{a} with allow_private {b or 'empty'} is {c.value if c else 'dialable'}"
        for a, b, c in OVERRIDES
    ],
)
def test_forbidden_reason_honours_allow_private(
    text: str, allowed: list[str], expected: AddressClass | None
) -> None:
    networks: list[IPv4Network | IPv6Network] = [
        IPv4Network(item) if "." in item else IPv6Network(item) for item in allowed
    ]
    assert forbidden_reason(ip_address(text), networks) is expected


IPV4 = st.builds(IPv4Address, st.integers(0, 2**32 - 1))
IPV6 = st.builds(IPv6Address, st.integers(0, 2**128 - 1))


@given(IPV4)
def test_mapped_address_classifies_like_the_ipv4_it_embeds(address: IPv4Address) -> None:
    mapped = IPv6Address(f"::ffff:{address}")
    assert embedded_ipv4(mapped) == address
    assert classify(mapped) is classify(address)
    assert forbidden_reason(mapped) is forbidden_reason(address)


@given(IPV4)
def test_nat64_address_classifies_like_the_ipv4_it_embeds(address: IPv4Address) -> None:
    assert classify(IPv6Address(int(IPv6Address("64:ff9b::")) | int(address))) is classify(address)


@given(IPV4, st.integers(0, 2**80 - 1))
def test_six_to_four_is_never_public_and_keeps_special_classes(
    address: IPv4Address, rest: int
) -> None:
    six_to_four = IPv6Address((0x2002 << 112) | (int(address) << 80) | rest)
    kind = classify(six_to_four)
    assert kind is not C.PUBLIC
    if classify(address) is not C.PUBLIC:
        assert kind is classify(address)


@given(st.one_of(IPV4, IPV6))
def test_every_address_gets_exactly_one_class(address: IPAddress) -> None:
    kind = classify(address)
    assert isinstance(kind, AddressClass)
    assert (forbidden_reason(address) is None) == (kind is C.PUBLIC)
