"""The SOCKS5 codec (proxy/core/socks5.py): bytes in, messages or the reply to send out; no I/O."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.proxy.core.socks5 import (
    AUTH_FAILED,
    AUTH_OK,
    Command,
    Credentials,
    Method,
    SocksError,
    SocksRequest,
    choose_method,
    method_reply,
    parse_credentials,
    parse_greeting,
    parse_request,
    reply,
)
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import SocksReply


def request(command: int, tail: bytes) -> bytes:
    return bytes([5, command, 0]) + tail


def domain(name: bytes, port: int = 443) -> bytes:
    return b"\x03" + bytes([len(name)]) + name + struct.pack("!H", port)


# -- greeting ---------------------------------------------------------------------


def test_a_greeting_is_parsed_with_the_bytes_it_used() -> None:
    assert parse_greeting(b"\x05\x02\x00\x02rest") == (frozenset({0, 2}), 4)


@pytest.mark.parametrize("prefix", [b"", b"\x05", b"\x05\x03\x00\x02"])
def test_a_partial_greeting_needs_more(prefix: bytes) -> None:
    assert parse_greeting(prefix) is None


@pytest.mark.parametrize("data", [b"\x04\x01\x00", b"G", b"\x05\x00"])
def test_wrong_versions_and_empty_method_lists_are_errors(data: bytes) -> None:
    with pytest.raises(SocksError) as caught:
        parse_greeting(data)
    assert caught.value.reply is None  # no request reply fits a greeting: closed


def test_method_choice_prefers_credentials_and_needs_a_run_for_none() -> None:
    both = frozenset({0, 2})
    assert choose_method(both, credentials=True, anonymous=True) is Method.USERNAME_PASSWORD
    assert choose_method(frozenset({0}), credentials=True, anonymous=True) is Method.NO_AUTH
    assert choose_method(frozenset({0}), credentials=True, anonymous=False) is Method.NO_ACCEPTABLE
    assert choose_method(frozenset({1}), credentials=True, anonymous=True) is Method.NO_ACCEPTABLE  # GSSAPI
    assert method_reply(Method.NO_ACCEPTABLE) == b"\x05\xff"


# -- username/password ------------------------------------------------------------


def test_credentials_are_parsed() -> None:
    assert parse_credentials(b"\x01\x03run\x05tokenX") == (Credentials("run", "token"), 11)
    assert parse_credentials(b"\x01\x03run\x00") == (Credentials("run", ""), 6)
    assert (AUTH_OK, AUTH_FAILED) == (b"\x01\x00", b"\x01\x01")


@pytest.mark.parametrize("prefix", [b"", b"\x01", b"\x01\x03ru", b"\x01\x03run", b"\x01\x03run\x05tok"])
def test_partial_credentials_need_more(prefix: bytes) -> None:
    assert parse_credentials(prefix) is None


@pytest.mark.parametrize("data", [b"\x05\x03run\x00", b"\x01\x00\x00", b"\x01\x02r\x00\x00", b"\x01\x01\xff\x00"])
def test_malformed_credentials_are_errors(data: bytes) -> None:
    with pytest.raises(SocksError):
        parse_credentials(data)


# -- request ------------------------------------------------------------------------


def test_the_three_address_types() -> None:
    v4 = request(1, b"\x01\x7f\x00\x00\x42\x01\xbb")
    assert parse_request(v4) == (SocksRequest(1, "127.0.0.66", 443, literal=True), len(v4))
    v6 = request(1, b"\x04" + ipaddress.IPv6Address("::ffff:127.0.0.66").packed + b"\x00\x50")
    parsed = parse_request(v6)
    assert parsed is not None and parsed[0].host == "::ffff:7f00:42" and parsed[0].literal
    name = request(1, domain(b"Example.COM.", 8443))
    assert parse_request(name + b"tail") == (SocksRequest(1, "Example.COM.", 8443, literal=False), len(name))


def test_a_domain_spelling_an_address_is_not_a_literal_here() -> None:
    # The policy recognises it (``names.hosts``); the codec hands on the text as sent.
    parsed = parse_request(request(1, domain(b"2130706498")))
    assert parsed is not None and parsed[0].host == "2130706498" and not parsed[0].literal


def test_bind_and_udp_associate_parse_so_they_can_be_recorded() -> None:
    for command in (Command.BIND, Command.UDP_ASSOCIATE):
        parsed = parse_request(request(command, domain(b"a.test")))
        assert parsed is not None and parsed[0].command == command


@given(st.binary(max_size=30))
def test_every_prefix_of_a_request_needs_more_or_parses(tail: bytes) -> None:
    whole = request(1, domain(b"origin.test", 80))
    for cut in range(len(whole)):
        assert parse_request(whole[:cut]) is None
    assert parse_request(whole + tail) == (SocksRequest(1, "origin.test", 80, literal=False), len(whole))


@pytest.mark.parametrize(
    ("data", "rep"),
    [
        (b"\x04\x01\x00\x01", SocksReply.GENERAL_FAILURE),  # wrong version
        (b"\x05\x01\x01\x01\x00\x00\x00\x00\x00\x00", SocksReply.GENERAL_FAILURE),  # reserved byte set
        (b"\x05\x09\x00" + domain(b"a.test"), SocksReply.COMMAND_NOT_SUPPORTED),
        (b"\x05\x01\x00\x02\x00", SocksReply.ADDRESS_TYPE_NOT_SUPPORTED),
        (request(1, b"\x03\x00\x00\x50"), SocksReply.GENERAL_FAILURE),  # an empty name
        (request(1, domain(b"a\x00b.test")), SocksReply.GENERAL_FAILURE),
        (request(1, domain(b"a\nb.test")), SocksReply.GENERAL_FAILURE),
        (request(1, domain(b"a b.test")), SocksReply.GENERAL_FAILURE),
        (request(1, domain(b"\xc3\x28.test")), SocksReply.GENERAL_FAILURE),  # not UTF-8
    ],
)
def test_bad_requests_say_which_reply(data: bytes, rep: SocksReply) -> None:
    with pytest.raises(SocksError) as caught:
        parse_request(data)
    assert caught.value.reply is rep


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_the_parsers(data: bytes) -> None:
    for parse in (parse_greeting, parse_credentials, parse_request):
        try:
            parse(data)
        except SocksError:
            pass


# -- replies and the Reason table ---------------------------------------------------------


def test_replies_carry_the_bound_address() -> None:
    assert reply(SocksReply.NOT_ALLOWED) == b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"
    assert (
        reply(SocksReply.SUCCEEDED, ipaddress.ip_address("10.0.0.1"), 4242) == b"\x05\x00\x00\x01\n\x00\x00\x01\x10\x92"
    )
    six = reply(SocksReply.SUCCEEDED, ipaddress.ip_address("::1"), 1)
    assert six[:4] == b"\x05\x00\x00\x04" and len(six) == 4 + 16 + 2


def test_every_reason_has_a_reply_and_policy_refusals_say_not_allowed() -> None:
    for reason in Reason:
        assert isinstance(reason.socks, SocksReply) and reason.socks is not SocksReply.SUCCEEDED
        if reason.status in (403, 407):
            assert reason.socks is SocksReply.NOT_ALLOWED, reason
    assert Reason.RESOLVE_FAILED.socks is SocksReply.HOST_UNREACHABLE
    assert Reason.UPSTREAM_UNREACHABLE.socks is SocksReply.CONNECTION_REFUSED
    assert Reason.UPSTREAM_TIMEOUT.socks is SocksReply.HOST_UNREACHABLE
    assert Reason.LIMIT_EXCEEDED.socks is SocksReply.GENERAL_FAILURE
