"""The one authority parser (``egressd.names.authority``) and the rules each caller gives it.

Each caller's rules are pinned twice: by examples of where they differ, and
by comparing the caller with a copy of the parser it had before it used
``egressd.names.authority`` (the ``_before_*`` functions), on generated text.
"""

from __future__ import annotations

import ipaddress
import re
from ipaddress import IPv4Address, IPv6Address

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from egressd.config.settings import parse_hostport
from egressd.names.authority import AuthorityError, Colons, Fault, parse_authority, parse_port, split_authority
from egressd.names.hosts import HostError
from egressd.proxy.core.http1.destination import request_destination
from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.net.resolver import parse_server

# -- the parser's own rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "colons", "expected"),
    [
        ("a:1", Colons.IPV6_HOST, ("a", "1")),
        ("a:1", Colons.FIRST, ("a", "1")),
        ("a:1", Colons.LAST, ("a", "1")),
        ("a:b:1", Colons.IPV6_HOST, ("a:b:1", None)),
        ("a:b:1", Colons.FIRST, ("a", "b:1")),
        ("a:b:1", Colons.LAST, ("a:b", "1")),
        ("[::1]:1", Colons.IPV6_HOST, ("[::1]", "1")),
        ("[::1]:1", Colons.FIRST, ("[::1]", "1")),
        ("[::1]:1", Colons.LAST, ("[::1]", "1")),
        ("[::1]", Colons.LAST, ("[:", "1]")),
        ("a", Colons.LAST, ("a", None)),
    ],
)
def test_colons_decide_where_the_port_starts(text: str, colons: Colons, expected: tuple[str, str | None]) -> None:
    assert split_authority(text, colons=colons) == expected


@pytest.mark.parametrize(
    ("text", "fault"),
    [("[::1", Fault.BRACKET), ("[::1]x", Fault.AFTER_BRACKET)],
)
def test_bracket_faults_are_named(text: str, fault: Fault) -> None:
    with pytest.raises(AuthorityError) as caught:
        split_authority(text)
    assert caught.value.fault is fault
    assert isinstance(caught.value, HostError)


def test_port_rules_are_parameters() -> None:
    assert parse_port("0", zero=True) == 0
    with pytest.raises(AuthorityError) as caught:
        parse_port("0")
    assert caught.value.fault is Fault.PORT_RANGE
    assert parse_port("0000080", digits=None) == 80
    with pytest.raises(AuthorityError) as caught:
        parse_port("000080")
    assert caught.value.fault is Fault.PORT
    assert parse_port("١٢٣", unicode_digits=True) == 123
    with pytest.raises(AuthorityError):
        parse_port("١٢٣")
    for bad in ("²", "", "+1", " 1", "1 ", "65536", "-0"):
        with pytest.raises(AuthorityError):
            parse_port(bad, zero=True, digits=None, unicode_digits=True)


def test_missing_port_and_host_errors_come_in_the_order_asked() -> None:
    with pytest.raises(AuthorityError) as caught:
        parse_authority("bad host!")
    assert caught.value.fault is Fault.MISSING_PORT
    with pytest.raises(HostError) as host_error:
        parse_authority("bad host!", host_first=True)
    assert not isinstance(host_error.value, AuthorityError)
    with pytest.raises(AuthorityError) as caught:
        parse_authority("[zz]x", 443)
    assert caught.value.fault is Fault.AFTER_BRACKET
    with pytest.raises(HostError) as host_error:
        parse_authority("[zz]x", 443, host_first=True)
    assert not isinstance(host_error.value, AuthorityError)
    with pytest.raises(AuthorityError) as caught:
        parse_authority("[::1]x", 443, host_first=True)
    assert caught.value.fault is Fault.AFTER_BRACKET


# -- each caller: where the rules differ ---------------------------------------------------------


def _connect(target: str) -> tuple[str, int] | str:
    try:
        destination = request_destination(RequestHead("CONNECT", target, "HTTP/1.1", []))
    except HttpError as error:
        return error.detail
    return destination.host, destination.port


def _setting(text: str) -> tuple[str, int] | str:
    try:
        return parse_hostport(text, "listen")
    except ValueError as error:
        return str(error)


def _server(text: str) -> tuple[str, int] | str:
    try:
        return parse_server(text)
    except ValueError as error:
        return str(error)


def test_port_zero_only_for_an_address_we_listen_on() -> None:
    assert _setting("127.0.0.1:0") == ("127.0.0.1", 0)
    assert _connect("example.com:0") == "invalid port in request target"
    assert _server("1.1.1.1:0") == "DNS server '1.1.1.1:0': port 0 is out of range 1-65535"
    with pytest.raises(HostError):
        parse_authority("example.com:0")


def test_leading_zeros_only_where_they_always_were() -> None:
    assert _setting("127.0.0.1:0000080") == ("127.0.0.1", 80)
    assert _server("1.1.1.1:0000053") == ("1.1.1.1", 53)
    assert _connect("example.com:000080") == "invalid port in request target"
    assert _connect("example.com:00080") == ("example.com", 80)


def test_unicode_digits_only_in_settings() -> None:
    assert _setting("127.0.0.1:٨٠") == ("127.0.0.1", 80)
    assert _connect("example.com:٨٠") == "invalid port in request target"
    assert _server("1.1.1.1:٨٠") == "DNS server '1.1.1.1:٨٠': port '٨٠' is not a number"


def test_unbracketed_ipv6_means_three_things() -> None:
    assert _setting("::1:8080") == ("::1", 8080)
    assert _server("::1") == ("::1", 53)
    assert _connect("::1:443") == "invalid host in request target"
    assert parse_authority("::1", 443) == ("::1", 443)


def test_default_ports() -> None:
    assert _server("1.1.1.1") == ("1.1.1.1", 53)
    assert _connect("example.com") == "CONNECT needs host:port"
    assert _setting("127.0.0.1") == "listen: expected HOST:PORT, got '127.0.0.1'"
    head = RequestHead("GET", "http://example.com/x", "HTTP/1.1", [])
    assert request_destination(head).port == 80


def test_http_checks_the_host_before_the_rest() -> None:
    assert _connect("bad!host") == "invalid host in request target"
    assert _connect("[zz]x") == "invalid IPv6 address in request target"
    assert _connect("[::1]x") == "invalid authority in request target"
    assert _connect("[::1") == "invalid IPv6 address in request target"


# -- each caller against the parser it had before -----------------------------------------------

_REG_NAME = re.compile(r"[A-Za-z0-9._-]+")
_IPV6_TEXT = re.compile(r"[0-9A-Fa-f:.]+")


def _before_http(text: str, default_port: int | None) -> tuple[str, int] | str:
    if "@" in text:
        return "userinfo in request target is not allowed"
    if text.startswith("["):
        close = text.find("]")
        host, rest = text[1:close], text[close + 1 :]
        if close < 0 or ":" not in host or not _IPV6_TEXT.fullmatch(host):
            return "invalid IPv6 address in request target"
        if rest and not rest.startswith(":"):
            return "invalid authority in request target"
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_or_empty = text.partition(":")
        if not _REG_NAME.fullmatch(host):
            return "invalid host in request target"
        port_text = port_text_or_empty if colon else None
    if port_text is None:
        if default_port is None:
            return "CONNECT needs host:port"
        return host, default_port
    if not 0 < len(port_text) <= 5 or not port_text.isascii() or not port_text.isdigit():
        return "invalid port in request target"
    port = int(port_text)
    if not 1 <= port <= 65535:
        return "invalid port in request target"
    return host, port


def _before_setting(text: str) -> tuple[str, int] | str:
    setting = "listen"
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"{setting}: expected HOST:PORT, got {text!r}"
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            return f"{setting}: {host!r} is not an IP address"
    return host, int(port)


_DNS_NAME = re.compile(
    r"(?=.{1,253}\.?$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*"
    r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.?",
    re.IGNORECASE,
)


def _before_server(text: str) -> tuple[str, int] | str:
    def check_host(host: str) -> str:
        if not host:
            raise ValueError(f"DNS server {text!r}: missing host")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                return str(IPv4Address(host))
            except ValueError as exc:
                raise ValueError(f"DNS server {text!r}: {host!r} is not an IPv4 address") from exc
        if not _DNS_NAME.fullmatch(host):
            raise ValueError(f"DNS server {text!r}: {host!r} is not a valid host name")
        return host.lower()

    def check_port(port_text: str) -> int:
        if not port_text.isascii() or not port_text.isdigit():
            raise ValueError(f"DNS server {text!r}: port {port_text!r} is not a number")
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise ValueError(f"DNS server {text!r}: port {port} is out of range 1-65535")
        return port

    try:
        value = text.strip()
        if not value:
            raise ValueError("DNS server address is empty; expected HOST, HOST:PORT or [IPv6]:PORT")
        port_text: str | None = None
        if value.startswith("["):
            host, sep, rest = value[1:].partition("]")
            if not sep:
                raise ValueError(f"DNS server {text!r}: missing ']' after the IPv6 address")
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"DNS server {text!r}: expected ':PORT' after ']'")
                port_text = rest[1:]
            try:
                host = str(IPv6Address(host))
            except ValueError as exc:
                raise ValueError(f"DNS server {text!r}: {host!r} is not an IPv6 address") from exc
        elif value.count(":") > 1:
            try:
                host = str(IPv6Address(value))
            except ValueError as exc:
                raise ValueError(
                    f"DNS server {text!r}: not an IPv6 address; write [IPv6]:PORT to give a port"
                ) from exc
        else:
            host, sep, port_text_or_empty = value.partition(":")
            port_text = port_text_or_empty if sep else None
            host = check_host(host)
        return host, 53 if port_text is None else check_port(port_text)
    except ValueError as error:
        return str(error)


# Pieces that make the rules' edges likely: brackets, colons, ports, IPs, names.
_PIECE = st.sampled_from(
    ["[", "]", ":", "::", "::1", "fe80::1", "%25eth0", "%eth0", "1", "0", "00", "80", "65535", "65536", "99999",
     "١", "²", "127.0.0.1", "1.2.3", "256.1.1.1", "localhost", "example.com", "EXAMPLE.com", "a", "-", "_", ".",
     "@", " ", "!", "x", "é"]
)
_AUTHORITY_TEXT = st.one_of(st.lists(_PIECE, max_size=6).map("".join), st.text(max_size=12))


@settings(max_examples=1500)
@given(_AUTHORITY_TEXT, st.sampled_from([None, 80]))
@example("[zz]x", None)
@example("[::1]:0", 80)
def test_http_authority_is_unchanged(text: str, default_port: int | None) -> None:
    if default_port is None:
        assert _connect(text) == _before_http(text, None)
    else:
        assert _absolute(text) == _before_http(text, 80)


def _absolute(authority: str) -> tuple[str, int] | str:
    if any(c in authority for c in "/?#"):
        return _before_http(authority, 80)  # not an authority alone: not what this test is about
    try:
        destination = request_destination(RequestHead("GET", f"http://{authority}/", "HTTP/1.1", []))
    except HttpError as error:
        return error.detail
    return destination.host, destination.port


@settings(max_examples=1500)
@given(_AUTHORITY_TEXT)
@example("127.0.0.1:٨٠")
@example("[::1]:0")
@example("::%25eth0²::1")
def test_listen_addresses_are_unchanged(text: str) -> None:
    if "²" in text or "³" in text or "¹" in text:
        # int() of a superscript digit raised its own ValueError; now the setting's message says it.
        # (A superscript in the host part reaches no int(): then both parse it alike.)
        now, before = _setting(text), _before_setting_or_error(text)
        assert isinstance(now, str) == isinstance(before, str)
        assert isinstance(now, str) or now == before
        return
    assert _setting(text) == _before_setting(text)


def _before_setting_or_error(text: str) -> tuple[str, int] | str:
    try:
        return _before_setting(text)
    except ValueError as error:
        return str(error)


@settings(max_examples=1500)
@given(_AUTHORITY_TEXT)
@example("[::1]x")
@example(" [::1]:0053 ")
def test_dns_servers_are_unchanged(text: str) -> None:
    assert _server(text) == _before_server(text)
