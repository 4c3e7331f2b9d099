"""The pure ClientHello parser: real and hand-built hellos, fragmentation, malformations, properties;
ECH; and following both sides until the server settles the handshake (``scan_client``, ``ServerWatch``)."""

from __future__ import annotations

import ssl
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.proxy.core.clienthello import (
    HRR_RANDOM,
    MAX_CLIENT_HELLO_BYTES,
    ClientHello,
    ClientHelloError,
    NotTls,
    ServerWatch,
    parse_client_hello,
    scan_client,
    tls_alert,
)
from egressd.vocabulary.wire import Alert
from tests.fakes import hellos
from tests.fakes.hellos import (
    CCS,
    GREASE,
    body,
    client_hello,
    ech_extension,
    extension,
    handshake,
    record,
    records,
    server_hello,
    sni_extension,
)
from tests.fakes.tls import make_pki


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
    # Normalising (case, trailing dot) is the caller's job, with egressd.names.hosts.
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



# --- encrypted_client_hello ---------------------------------------------------------------


@pytest.mark.parametrize("outer", [True, False], ids=["outer", "inner"])
def test_a_hello_carrying_ech_says_so_and_keeps_its_cover_name(outer: bool) -> None:
    hello = parse(client_hello("cover.test", extra=[ech_extension(outer)]))
    assert hello.ech and hello.server_name == "cover.test"


def test_ech_outer_extensions_in_the_clear_counts_as_ech() -> None:
    # draft-ietf-tls-esni §5.1: it belongs inside the encrypted hello only.
    assert parse(client_hello("cover.test", extra=[extension(0xFD00, b"\x02\x00\x0a")])).ech


def test_hellos_without_ech_say_so() -> None:
    assert not parse(hellos.python_hello("origin.test")).ech
    assert not parse(client_hello("origin.test", padding=300)).ech
    assert not parse(client_hello(None, extensions=False)).ech


def test_ech_twice_is_malformed() -> None:
    with pytest.raises(ClientHelloError, match="twice"):
        parse_client_hello(client_hello("cover.test", extra=[ech_extension(), ech_extension()]))


# --- scan_client: every ClientHello before the server settles ---------------------------------


def test_a_real_first_flight_is_one_ready_hello() -> None:
    data = hellos.python_hello("origin.test")
    scanned = scan_client(data, first=True)
    assert scanned.ready == len(data)
    assert [h.server_name for h in scanned.hellos] == ["origin.test"]


def test_a_partial_record_is_held_and_what_precedes_it_is_ready() -> None:
    first = client_hello("origin.test")
    second = CCS + client_hello("other.test")
    for cut in range(len(second)):
        scanned = scan_client(first + second[:cut], first=True)
        expected = len(first) + (len(CCS) if cut >= len(CCS) else 0)
        assert (scanned.ready, [h.server_name for h in scanned.hellos]) == (expected, ["origin.test"]), cut
    assert [h.server_name for h in scan_client(first + second, first=True).hellos] == ["origin.test", "other.test"]


def test_records_cut_inside_a_hello_are_held_until_the_hello_is_whole() -> None:
    data = records(handshake(body("origin.test")), [10, 10])
    assert scan_client(data[:-1], first=True).ready == 0
    first_two = 2 * 5 + 20  # two whole records, but the message is not whole: nothing is ready
    assert scan_client(data[:first_two], first=True).ready == 0
    assert scan_client(data, first=True).ready == len(data)


def test_two_hellos_in_one_record_are_both_found() -> None:
    data = record(handshake(body("origin.test")) + handshake(body("other.test")))
    assert [h.server_name for h in scan_client(data, first=True).hellos] == ["origin.test", "other.test"]


def test_change_cipher_spec_alerts_and_early_data_are_passed_over() -> None:
    early = record(b"\x17" * 500, content_type=23, version=0x0303)
    alert = record(b"\x01\x00", content_type=21, version=0x0303)
    data = client_hello("origin.test") + CCS + early + alert + CCS
    scanned = scan_client(data, first=True)
    assert scanned.ready == len(data) and len(scanned.hellos) == 1
    assert scan_client(CCS + early, first=False).ready == len(CCS + early)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (client_hello() + record(handshake(b"\x00" * 36, msg_type=20)), "other than ClientHello"),
        (client_hello() + record(handshake(b"\x00" * 4, msg_type=11)[:2]), "other than ClientHello"),
        (client_hello() + record(handshake(body())[:9]) + CCS, "another record type inside"),
        (client_hello() + record(b"\x00", content_type=24), "record type 24"),
        (client_hello() + b"\x17\x02\x00\x00\x01\x00", "version"),
        (client_hello() + b"\x17\x03\x03\x48\x01", "longer than any TLS version"),
        (client_hello() + record(b""), "zero-length"),
        (client_hello() + record(handshake(body(session_id=bytes(33)))), "legacy_session_id"),
    ],
    ids=["finished", "certificate (partial)", "ccs inside a hello", "heartbeat", "version 2", "oversized",
         "empty handshake", "malformed second hello"],
)
def test_what_no_client_sends_before_the_server_settles_is_refused(data: bytes, match: str) -> None:
    with pytest.raises(ClientHelloError, match=match) as caught:
        scan_client(data, first=True)
    assert not isinstance(caught.value, NotTls)


def test_only_the_start_of_a_connection_can_be_another_protocol() -> None:
    with pytest.raises(NotTls):
        scan_client(b"SSH-2.0-OpenSSH_9.2\r\n", first=True)
    with pytest.raises(NotTls):
        scan_client(CCS + client_hello(), first=True)  # TLS, but not a start a client makes
    with pytest.raises(ClientHelloError) as caught:
        scan_client(b"SSH-2.0-OpenSSH_9.2\r\n", first=False)
    assert not isinstance(caught.value, NotTls)


def test_a_flood_of_tiny_records_is_refused_at_the_buffer_limit() -> None:
    message = handshake(body("x.test", padding=60_000))
    with pytest.raises(ClientHelloError, match="without a whole record"):
        scan_client(records(message, [1] * len(message)), first=True)


def test_nothing_is_ready_before_the_first_whole_record() -> None:
    assert scan_client(b"", first=True).ready == 0
    assert scan_client(b"\x16", first=True).ready == 0
    assert scan_client(b"\x16\x03\x01\x02", first=True).ready == 0


# --- ServerWatch: when the server has settled the handshake -------------------------------------


def settle_point(stream: bytes) -> int | None:
    """The number of server bytes after which a watch fed byte by byte is settled (None: never)."""
    watch = ServerWatch()
    for i in range(len(stream)):
        if watch.feed(stream[i : i + 1]):
            return i + 1
    return None


def hrr_with_cookie(cookie_size: int) -> bytes:
    exts = extension(43, b"\x03\x04") + extension(51, b"\x00\x17") + extension(44, struct.pack("!H", cookie_size)
                                                                           + bytes(cookie_size))
    message = handshake(b"\x03\x03" + HRR_RANDOM + b"\x00" + b"\x13\x01\x00" + struct.pack("!H", len(exts)) + exts, 2)
    return records(message, [16384] * 4)


def test_a_server_hello_settles_once_its_random_is_in() -> None:
    assert settle_point(server_hello()) == 5 + 38


def test_a_retry_request_and_its_change_cipher_spec_do_not_settle_and_the_next_hello_does() -> None:
    retry = server_hello(hrr=True) + CCS
    watch = ServerWatch()
    assert not watch.feed(retry) and watch.retries == 1
    assert watch.feed(server_hello()) and watch.retries == 1
    assert settle_point(retry + server_hello()) == len(retry) + 5 + 38


def test_a_retry_request_with_a_large_cookie_across_records_is_passed_over() -> None:
    retry = hrr_with_cookie(40_000)
    assert settle_point(retry + server_hello()) == len(retry) + 5 + 38


@pytest.mark.parametrize(
    "stream",
    [b"SSH-2.0-OpenSSH_9.2\r\n", b"HTTP/1.1 400 Bad Request\r\n", record(b"\x00" * 20, content_type=23),
     record(handshake(b"\x00" * 40, msg_type=11)), b"\x16\x02\x00"],
    ids=["ssh", "http", "application data", "certificate first", "version 2"],
)
def test_a_server_that_does_not_open_a_tls_handshake_settles_at_once(stream: bytes) -> None:
    assert settle_point(stream) is not None and settle_point(stream) <= 6


def test_server_alerts_are_passed_over() -> None:
    alert = record(b"\x01\x70", content_type=21, version=0x0303)  # a warning: unrecognized_name
    assert settle_point(alert + server_hello()) == len(alert) + 5 + 38


def test_a_real_retried_handshake_is_followed_to_its_end(tmp_path: Path) -> None:
    """OpenSSL on both sides, a server that accepts only P-256: the client offers X25519, gets a
    HelloRetryRequest, sends change_cipher_spec and a second ClientHello, and the handshake ends."""
    pki = make_pki(tmp_path, ["origin.test"])
    server_ctx = pki.server_context()
    server_ctx.set_ecdh_curve("prime256v1")
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = pki.client_context().wrap_bio(c_in, c_out, server_hostname="origin.test")
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)

    def step(side: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, data: bytes) -> bytes:
        incoming.write(data)
        try:
            side.do_handshake()
        except ssl.SSLWantReadError:
            pass
        return outgoing.read()

    flight1 = step(client, c_in, c_out, b"")
    retry = step(server, s_in, s_out, flight1)
    flight2 = step(client, c_in, c_out, retry)
    settle = step(server, s_in, s_out, flight2)
    watch = ServerWatch()
    scanned = scan_client(flight1, first=True)
    assert scanned.ready == len(flight1) and [h.server_name for h in scanned.hellos] == ["origin.test"]
    assert not watch.feed(retry) and watch.retries == 1
    assert flight2.startswith(CCS)  # middlebox compatibility: not the end of the check
    scanned = scan_client(flight2, first=False)
    assert scanned.ready == len(flight2) and [h.server_name for h in scanned.hellos] == ["origin.test"]
    assert watch.feed(settle)


# --- properties of the watch -----------------------------------------------------------------


@st.composite
def client_streams(draw: st.DrawFn) -> tuple[bytes, list[str | None]]:
    """What a client may send before the server settles: hellos, change_cipher_spec, early data."""
    names: list[str | None] = []
    out = b""
    for _ in range(draw(st.integers(1, 3))):
        sni = draw(st.none() | hostnames)
        names.append(sni)
        message = handshake(body(sni, padding=draw(st.integers(0, 300))))
        out += records(message, draw(st.lists(st.integers(1, 200), max_size=4)))
        for _ in range(draw(st.integers(0, 2))):
            out += draw(st.sampled_from([CCS, record(b"\x17" * 40, content_type=23, version=0x0303)]))
    return out, names


@settings(max_examples=200, deadline=None)
@given(client_streams(), st.lists(st.integers(1, 400), max_size=12))
def test_relaying_what_is_ready_as_bytes_arrive_finds_every_hello_in_order(stream, splits) -> None:
    """Splitting the input anywhere gives the same hellos, and every byte is eventually ready."""
    data, names = stream
    held, found, relayed, pos = b"", [], 0, 0
    for size in [*splits, len(data)]:
        held += data[pos : pos + size]
        pos += size
        scanned = scan_client(held, first=relayed == 0)
        found += [h.server_name for h in scanned.hellos]
        held = held[scanned.ready :]
        relayed += scanned.ready
        if pos >= len(data):
            break
    assert found == names and relayed == len(data) and held == b""


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048), st.booleans())
def test_scanning_garbage_gives_a_value_or_our_error(data: bytes, first: bool) -> None:
    try:
        scanned = scan_client(data, first=first)
    except ClientHelloError:
        return
    assert 0 <= scanned.ready <= len(data)
    assert all(isinstance(h, ClientHello) for h in scanned.hellos)


@settings(max_examples=300, deadline=None)
@given(client_streams(), st.data())
def test_a_prefix_is_never_more_ready_than_the_whole(stream, data) -> None:
    wire, _ = stream
    cut = data.draw(st.integers(0, len(wire)))
    prefix, whole = scan_client(wire[:cut], first=True), scan_client(wire, first=True)
    assert prefix.ready <= whole.ready and whole.hellos[: len(prefix.hellos)] == prefix.hellos


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["hrr", "ccs", "alert"]), max_size=4), st.lists(st.integers(1, 60), max_size=10))
def test_any_split_of_the_server_bytes_settles_at_the_same_byte(before, splits) -> None:
    parts = {"hrr": server_hello(hrr=True), "ccs": CCS, "alert": record(b"\x01\x70", content_type=21)}
    stream = b"".join(parts[p] for p in before) + server_hello() + record(b"\x17" * 30, content_type=23)
    point = settle_point(stream)
    assert point == len(stream) - 35 - len(server_hello()) + 5 + 38
    watch, pos = ServerWatch(), 0
    for size in [*splits, len(stream)]:
        chunk = stream[pos : pos + size]
        settled = watch.feed(chunk)
        pos += len(chunk)
        assert settled is (pos >= point)
        if settled or pos >= len(stream):
            break


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=8))
def test_server_garbage_never_raises(chunks) -> None:
    watch = ServerWatch()
    for chunk in chunks:
        assert isinstance(watch.feed(chunk), bool)
