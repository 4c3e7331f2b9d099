"""The pure ClientHello parser: real and hand-built hellos, fragmentation, malformations, properties."""

from __future__ import annotations

import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.clienthello import (
    MAX_CLIENT_HELLO_BYTES,
    Alert,
    ClientHello,
    ClientHelloError,
    NotTls,
    parse_client_hello,
    tls_alert,
)
from tests import hellos
from tests.hellos import GREASE, body, client_hello, extension, handshake, record, records, sni_extension


def parse(data: bytes) -> ClientHello:
    hello = parse_client_hello(data)
    assert hello is not None
    return hello


# --- real ClientHellos ---------------------------------------------------------------


@pytest.mark.parametrize("max_version", [None, ssl.TLSVersion.TLSv1_2])
def test_python_ssl_hello_gives_its_server_name(max_version) -> None:
    data = hellos.python_hello("origin.test", max_version=max_version)
    hello = parse(data)
    assert hello.server_name == "origin.test"
    assert hello.offers_tls13 is (max_version is None)


def test_python_ssl_hello_without_server_name() -> None:
    assert parse(hellos.python_hello(None)).server_name is None


def test_every_strict_prefix_of_a_real_hello_needs_more() -> None:
    data = hellos.python_hello("sub.example.test")
    for cut in range(len(data)):
        assert parse_client_hello(data[:cut]) is None, cut
    assert parse(data).server_name == "sub.example.test"


def test_bytes_after_the_hello_are_not_looked_at() -> None:
    data = hellos.python_hello("origin.test") + b"\x17\x03\x03\x00\x05early" + b"\xff" * 50
    assert parse(data).server_name == "origin.test"


# --- hand-built ClientHellos ------------------------------------------------------------


def test_grease_and_padding_are_skipped() -> None:
    hello = parse(client_hello("origin.test", grease=True, padding=700))
    assert hello.server_name == "origin.test"
    assert GREASE[7] in hello.versions and 0x0304 in hello.versions


def test_tls12_hello_without_any_extension_has_no_server_name() -> None:
    hello = parse(client_hello(None, extensions=False))
    assert hello == ClientHello(None, (0x0303,))


def test_tls12_hello_with_sni_and_no_supported_versions() -> None:
    hello = parse(client_hello("legacy.test", tls13=False, grease=False))
    assert hello.server_name == "legacy.test" and not hello.offers_tls13


def test_one_byte_records_give_the_same_hello() -> None:
    message = handshake(body("byte.by.byte.test", padding=100))
    data = records(message, [1] * len(message))
    assert parse(data).server_name == "byte.by.byte.test"
    for cut in range(len(data)):
        assert parse_client_hello(data[:cut]) is None


def test_the_server_name_is_returned_as_sent() -> None:
    # Normalising (case, trailing dot) is the caller's job, with proxy.hosts.
    assert parse(client_hello("Origin.TEST.")).server_name == "Origin.TEST."


def test_a_large_hello_within_the_limit_is_parsed() -> None:
    message = handshake(body("big.test", padding=40_000))
    data = records(message, [16384] * 3)
    assert parse(data).server_name == "big.test"


MALFORMED = [
    pytest.param(record(handshake(body(), msg_type=2)), id="first handshake message is not a ClientHello"),
    pytest.param(record(b""), id="zero-length handshake fragment"),
    pytest.param(b"\x16\x03\x01\x40\x01" + bytes(16385), id="record longer than 2^14"),
    pytest.param(record(handshake(body())[:10]) + record(b"\x01", content_type=21), id="alert between fragments"),
    pytest.param(record(handshake(body())[:10]) + b"\x16\x02\x01\x00\x05", id="second record version is not 3.x"),
    pytest.param(record(handshake(body(extra=[sni_extension(b"a.test")]))), id="two server_name extensions"),
    pytest.param(record(handshake(body(None, extra=[sni_extension(b"a.test", b"b.test")]))), id="two server names"),
    pytest.param(
        record(handshake(body(None, extra=[sni_extension(b"a.test", name_type=1)]))), id="name type not host_name"
    ),
    pytest.param(record(handshake(body(b""))), id="empty host_name"),
    pytest.param(record(handshake(body("caf\u00e9.test".encode()))), id="non-ASCII host_name"),
    pytest.param(record(handshake(body(b"a\x00b.test"))), id="NUL in host_name"),
    pytest.param(record(handshake(body(None, extra=[extension(0, b"")]))), id="empty server_name extension"),
    pytest.param(record(handshake(body(session_id=bytes(33)))), id="session id over 32 bytes"),
    pytest.param(record(handshake(body() + b"\x00")), id="bytes after the extensions"),
    pytest.param(record(handshake(body()[:-3])), id="extensions cut short"),
    pytest.param(
        record(handshake(b"\x03\x03" + bytes(32) + b"\x00\x00\x03\x13\x01\x00\x01\x00")), id="odd cipher_suites length"
    ),
    pytest.param(record(handshake(b"\x03\x03" + bytes(32) + b"\x00\x00\x02\x13\x01\x00")), id="no compression method"),
    pytest.param(
        b"\x16\x03\x01\x00\x04\x01" + (MAX_CLIENT_HELLO_BYTES + 1).to_bytes(3, "big"), id="over the size limit"
    ),
    pytest.param(record(handshake(body(None, extra=[extension(43, b"\x03\x03\x04")]))), id="odd supported_versions"),
]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_hellos_are_refused(data: bytes) -> None:
    with pytest.raises(ClientHelloError) as caught:
        parse_client_hello(data)
    assert not isinstance(caught.value, NotTls)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", id="HTTP"),
        pytest.param(b"SSH-2.0-OpenSSH_9.2\r\n", id="SSH"),
        pytest.param(b"\x15\x03\x03\x00\x02\x02\x28", id="an alert record"),
        pytest.param(b"\x16\x02", id="handshake type but version 2"),
        pytest.param(b"\x80\x2e\x01\x00\x02", id="SSLv2-style hello"),
    ],
)
def test_other_protocols_are_not_tls(data: bytes) -> None:
    with pytest.raises(NotTls):
        parse_client_hello(data)


def test_two_bytes_that_could_start_tls_need_more() -> None:
    assert parse_client_hello(b"\x16") is None
    assert parse_client_hello(b"\x16\x03") is None


def test_a_flood_of_tiny_records_stops_at_the_buffer_limit() -> None:
    message = handshake(body("x.test", padding=60_000))
    with pytest.raises(ClientHelloError, match="without a complete ClientHello"):
        parse_client_hello(records(message, [1] * len(message)))


def test_alert_record_is_fatal_and_well_formed() -> None:
    assert tls_alert(Alert.ACCESS_DENIED) == b"\x15\x03\x03\x00\x02\x02\x31"


# --- properties ----------------------------------------------------------------------

_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
hostnames = st.lists(_label, min_size=1, max_size=5).map(".".join)


@st.composite
def built_hellos(draw: st.DrawFn) -> tuple[bytes, str | None]:
    sni = draw(st.none() | hostnames)
    hello_body = body(
        sni,
        tls13=draw(st.booleans()),
        grease=draw(st.booleans()),
        padding=draw(st.integers(0, 600)),
        session_id=draw(st.binary(max_size=32)),
    )
    return handshake(hello_body), sni


@settings(max_examples=200, deadline=None)
@given(built_hellos(), st.lists(st.integers(1, 300), max_size=40))
def test_any_record_fragmentation_gives_the_same_server_name(built, sizes) -> None:
    message, sni = built
    data = records(message, sizes)
    assert parse(data).server_name == sni


@settings(max_examples=100, deadline=None)
@given(built_hellos(), st.lists(st.integers(1, 50), max_size=10), st.data())
def test_any_prefix_needs_more_and_the_whole_decides(built, sizes, data) -> None:
    message, sni = built
    wire = records(message, sizes)
    cut = data.draw(st.integers(0, len(wire) - 1))
    assert parse_client_hello(wire[:cut]) is None
    assert parse(wire).server_name == sni


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048))
def test_garbage_gives_a_value_need_more_or_our_error(data: bytes) -> None:
    try:
        result = parse_client_hello(data)
    except ClientHelloError:
        return
    assert result is None or isinstance(result, ClientHello)


@settings(max_examples=300, deadline=None)
@given(built_hellos(), st.data())
def test_a_corrupted_hello_gives_a_value_need_more_or_our_error(built, data) -> None:
    message, _ = built
    wire = bytearray(records(message))
    for _ in range(data.draw(st.integers(1, 4))):
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        result = parse_client_hello(bytes(wire))
    except ClientHelloError:
        return
    assert result is None or isinstance(result, ClientHello)


@settings(max_examples=200, deadline=None)
@given(built_hellos(), st.binary(max_size=100))
def test_what_follows_a_complete_hello_never_changes_it(built, tail) -> None:
    message, _ = built
    wire = records(message)
    assert parse_client_hello(wire + tail) == parse_client_hello(wire)
