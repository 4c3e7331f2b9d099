"""Host normalisation, IP-literal recognition and authority parsing."""

from __future__ import annotations

import re
from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from egressd.names.authority import parse_authority, parse_port, split_authority
from egressd.names.hosts import (
    HostError,
    is_public_suffix,
    normalise_host,
    normalised,
    parse_host,
    parse_ip_literal,
    registered_domain,
    unicode_host,
)

LOOPBACK = IPv4Address("127.0.0.1")


@st.composite
def ipv4_spellings(draw: st.DrawFn, address: IPv4Address) -> str:
    """Any inet_aton / WHATWG spelling of an IPv4 address: 1-4 parts, each in
    decimal, octal or hex with any leading zeros, optionally a trailing dot."""
    value = int(address)
    count = draw(st.integers(1, 4))
    parts = [(value >> (8 * (3 - index))) & 0xFF for index in range(count - 1)]
    parts.append(value & ((1 << (8 * (5 - count))) - 1))
    texts = []
    for part in parts:
        zeros = "0" * draw(st.integers(0, 3))
        style = draw(st.sampled_from(["dec", "oct", "hex", "HEX"]))
        if style == "dec":
            texts.append(str(part))
        elif style == "oct":
            texts.append("0" + zeros + f"{part:o}")
        else:
            texts.append(("0x" if style == "hex" else "0X") + zeros + f"{part:x}")
    return ".".join(texts) + draw(st.sampled_from(["", "."]))


@st.composite
def ip_spellings(draw: st.DrawFn, address: IPv4Address) -> str:
    """IPv4 spellings plus its IPv4-mapped IPv6 forms, bracketed or not."""
    value = int(address)
    return draw(
        st.one_of(
            ipv4_spellings(address),
            st.sampled_from(
                [
                    f"::ffff:{address}",
                    f"[::ffff:{address}]",
                    f"::FFFF:{value >> 16:X}:{value & 0xFFFF:X}",
                    f"[0:0:0:0:0:ffff:{value >> 16:x}:{value & 0xFFFF:x}]",
                ]
            ),
        )
    )


# Characters from which host-like garbage is built: name characters, IP
# punctuation, and the ones that must be refused.
HOSTISH = st.text(alphabet=st.sampled_from(list("abcxyzXn-_.0179:[]%@/ \x00ü。Ｅ１*")), max_size=30)


IP_SPELLINGS = [
    ("127.0.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),
    ("0x7f000001", "127.0.0.1"),
    ("0X7F000001", "127.0.0.1"),
    ("0x7f.0.0.1", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("017700000001", "127.0.0.1"),
    ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"),
    ("0x7f.0.1", "127.0.0.1"),
    ("0177.0x0.0.01", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"),
    ("0", "0.0.0.0"),
    ("0x", "0.0.0.0"),
    ("255.255.255.255", "255.255.255.255"),
    ("4294967295", "255.255.255.255"),
    ("１２７．０．０．１", "127.0.0.1"),
    ("[::1]", "::1"),
    ("::1", "::1"),
    ("fe80::1%eth0", "fe80::1"),
    ("[fe80::1%25eth0]", "fe80::1"),
    ("[fe80::1%eth0]", "fe80::1"),
    ("::ffff:127.0.0.1", "::ffff:7f00:1"),
    ("::ffff:7f00:1", "::ffff:7f00:1"),
    ("[2001:DB8::0:1]", "2001:db8::1"),
]


@pytest.mark.parametrize(
    ("text", "expected"), IP_SPELLINGS, ids=[f"{a!r} is the address {b}" for a, b in IP_SPELLINGS]
)
def test_ip_literal_in_any_spelling_is_recognised(text: str, expected: str) -> None:
    assert parse_ip_literal(text) == ip_address(expected)
    assert normalise_host(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "256.1.1.1",
        "1.2.3.4.5",
        "1.2.3.256",
        "127.0.65536",
        "4294967296",
        "0x100000000",
        "08.0.0.1",
        "1..2.3",
        "example.123",
        "example.0x10",
        "[example.com]",
        "[::1",
        "1.2.3.4:80",
        "::ffff:0127.0.0.1",
        "fe80::1%",
        "fe80::1%eth/0",
        "1" * 5000,
    ],
    ids=lambda value: f"{value[:20]!r} is a broken IP literal, not a name",
)
def test_broken_ip_literal_is_an_error_not_a_name(text: str) -> None:
    with pytest.raises(HostError):
        parse_ip_literal(text)
    with pytest.raises(HostError):
        normalise_host(text)


@pytest.mark.parametrize(
    "text",
    ["example.com", "a.0xg", "0x7f.example", "1a.example", "localhost", "a_b.example"],
    ids=lambda value: f"{value!r} is a name",
)
def test_names_are_not_ip_literals(text: str) -> None:
    assert parse_ip_literal(text) is None


NAME_FORMS = [
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),
    ("bücher.example", "xn--bcher-kva.example"),
    ("BÜCHER.example", "xn--bcher-kva.example"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("XN--BCHER-KVA.example", "xn--bcher-kva.example"),
    ("ＥＸＡＭＰＬＥ。com", "example.com"),
    ("faß.de", "xn--fa-hia.de"),
    ("_dmarc.example.com", "_dmarc.example.com"),
    ("r3---sn-ab.example", "r3---sn-ab.example"),
    ("localhost", "localhost"),
    ("a" * 63 + ".example", "a" * 63 + ".example"),
]


@pytest.mark.parametrize(
    ("text", "expected"), NAME_FORMS, ids=[f"{a!r} normalises to {b!r}" for a, b in NAME_FORMS]
)
def test_names_normalise_to_lowercase_a_labels(text: str, expected: str) -> None:
    assert normalise_host(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        ".",
        "example.com..",
        "a..example",
        ".example.com",
        "exa mple.com",
        "example.com\x00",
        "user@example.com",
        "example.com/path",
        "-example.com",
        "example-.com",
        "a" * 64 + ".example",
        ".".join(["a" * 63] * 4),
        "xn--zz.example",
        "xn--abc-.example",
        "xn--abc.example",
        "exa*mple.com",
        "☃\u200d.example",
    ],
    ids=lambda value: f"{value[:24]!r} is malformed",
)
def test_malformed_hosts_are_refused(text: str) -> None:
    with pytest.raises(HostError):
        normalise_host(text)


AUTHORITIES = [
    ("example.com:443", None, ("example.com", 443)),
    ("Example.com.:8443", None, ("example.com", 8443)),
    ("example.com", 80, ("example.com", 80)),
    ("[::1]:443", None, ("::1", 443)),
    ("[::1]", 443, ("::1", 443)),
    ("::1", 443, ("::1", 443)),
    ("[fe80::1%25eth0]:80", None, ("fe80::1", 80)),
    ("127.1:00080", None, ("127.0.0.1", 80)),
    ("bücher.example:1", None, ("xn--bcher-kva.example", 1)),
    ("example.com:65535", None, ("example.com", 65535)),
]


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    AUTHORITIES,
    ids=[f"{a!r} with default port {b} is {c}" for a, b, c in AUTHORITIES],
)
def test_authority_splits_into_normalised_host_and_port(
    text: str, default: int | None, expected: tuple[str, int]
) -> None:
    assert parse_authority(text, default) == expected


BAD_AUTHORITIES = [
    ("example.com", None),
    ("example.com:", None),
    ("example.com:0", None),
    ("example.com:65536", None),
    ("example.com:+443", None),
    ("example.com:-1", None),
    ("example.com: 443", None),
    ("example.com:443 ", None),
    ("example.com:١٢٣", None),
    ("example.com:000443", None),
    ("example.com:4a", None),
    ("::1:443", None),
    ("::1", None),
    ("[::1]x", 443),
    ("[::1]:", None),
    ("[example.com]:443", None),
    (":443", None),
    ("a:b:c", 443),
]


@pytest.mark.parametrize(
    ("text", "default"),
    BAD_AUTHORITIES,
    ids=[f"{a!r} with default port {b} is refused" for a, b in BAD_AUTHORITIES],
)
def test_malformed_authorities_are_refused(text: str, default: int | None) -> None:
    with pytest.raises(HostError):
        parse_authority(text, default)


def test_split_authority_leaves_unbracketed_ipv6_whole() -> None:
    assert split_authority("fe80::1:443") == ("fe80::1:443", None)
    assert split_authority("[::1]:*") == ("[::1]", "*")


def test_port_accepts_only_decimal_digits_in_range() -> None:
    assert parse_port("1") == 1
    assert parse_port("65535") == 65535
    with pytest.raises(HostError):
        parse_port("0")


DISPLAY_FORMS = [
    ("xn--bcher-kva.example", "bücher.example"),
    ("www.xn--fa-hia.de", "www.faß.de"),
    ("example.com", "example.com"),
    ("xn--zz.example", "xn--zz.example"),
    ("::1", "::1"),
]


@pytest.mark.parametrize(
    ("ascii_host", "expected"),
    DISPLAY_FORMS,
    ids=[f"{a!r} displays as {b!r}" for a, b in DISPLAY_FORMS],
)
def test_unicode_host_shows_u_labels_or_the_input(ascii_host: str, expected: str) -> None:
    assert unicode_host(ascii_host) == expected


REGISTERED = [
    ("a.b.example.co.uk", "example.co.uk"),
    ("example.com", "example.com"),
    ("WWW.Example.COM.", "example.com"),
    ("alice.github.io", "alice.github.io"),
    ("x.alice.github.io", "alice.github.io"),
    ("www.bücher.de", "xn--bcher-kva.de"),
    ("co.uk", None),
    ("com", None),
    ("127.0.0.1", None),
    ("::1", None),
]


@pytest.mark.parametrize(
    ("host", "expected"), REGISTERED, ids=[f"{a!r} is registered as {b!r}" for a, b in REGISTERED]
)
def test_registered_domain_is_etld_plus_one(host: str, expected: str | None) -> None:
    assert registered_domain(host) == expected


SUFFIXES = [
    ("com", True),
    ("co.uk", True),
    ("github.io", True),
    ("githubusercontent.com", True),
    ("CO.UK.", True),
    ("example.com", False),
    ("example.co.uk", False),
    ("127.0.0.1", False),
]


@pytest.mark.parametrize(
    ("name", "expected"),
    SUFFIXES,
    ids=[f"{a!r} is {'' if b else 'not '}a public suffix" for a, b in SUFFIXES],
)
def test_public_suffixes_are_recognised(name: str, expected: bool) -> None:
    assert is_public_suffix(name) is expected


@given(ipv4_spellings(LOOPBACK))
def test_every_ipv4_spelling_of_loopback_parses_to_it(text: str) -> None:
    assert parse_ip_literal(text) == LOOPBACK
    assert normalise_host(text) == "127.0.0.1"


@given(st.builds(IPv4Address, st.integers(0, 2**32 - 1)).flatmap(ipv4_spellings))
def test_every_ipv4_spelling_parses_to_its_address(text: str) -> None:
    address = parse_ip_literal(text)
    assert isinstance(address, IPv4Address)
    assert normalise_host(text) == str(address)


@given(ip_spellings(LOOPBACK))
def test_mapped_spellings_keep_the_ipv6_form(text: str) -> None:
    address = parse_ip_literal(text)
    assert address is not None
    expected = LOOPBACK if isinstance(address, IPv4Address) else IPv6Address("::ffff:7f00:1")
    assert address == expected


@example("::")  # found by this test: an IPv6 literal takes no trailing dot
@given(st.one_of(HOSTISH, st.text(max_size=40)))
def test_normalise_host_is_idempotent_or_refuses(text: str) -> None:
    try:
        once = normalise_host(text)
    except HostError:
        return
    assert normalise_host(once) == once
    if ":" not in once:  # a name's (or IPv4 literal's) trailing dot; "::." is no IPv6 address, and is refused
        assert normalise_host(once + ".") == once
    assert normalise_host(once.upper()) == once


@given(st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?(\.[a-z]{1,8}){1,3}", fullmatch=True))
def test_case_and_one_trailing_dot_do_not_change_a_name(name: str) -> None:
    assert normalise_host(name.upper() + ".") == normalise_host(name)
    with pytest.raises(HostError):
        normalise_host(name + "..")


@given(st.one_of(HOSTISH, st.text(max_size=40)), st.one_of(st.none(), st.integers(1, 65535)))
def test_garbage_yields_a_value_or_host_error(text: str, default: int | None) -> None:
    for parse in (parse_ip_literal, normalise_host, unicode_host, split_authority):
        try:
            parse(text)
        except HostError:
            pass
    try:
        host, port = parse_authority(text, default)
    except HostError:
        return
    assert 1 <= port <= 65535
    assert normalise_host(host) == host


@given(st.one_of(HOSTISH, st.text(max_size=40)))
@example("0x7f.1")
@example("[::ffff:127.0.0.1]")
@example("Bücher.example.")
def test_parse_host_is_normalise_host_and_parse_ip_literal_at_once(text: str) -> None:
    try:
        expected = (normalise_host(text), parse_ip_literal(text))
    except HostError as error:
        with pytest.raises(HostError, match=re.escape(str(error))):
            parse_host(text)
        assert normalised(text) is None
        return
    parsed = parse_host(text)
    assert (parsed.name, parsed.address) == expected
    assert normalised(text) == expected[0]
    assert parse_ip_literal(parsed.name) == parsed.address  # what the gate used to re-parse
