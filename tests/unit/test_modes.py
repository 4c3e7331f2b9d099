"""Listener modes as values: where a request goes, how it is attributed, which refusal it earns."""

from __future__ import annotations

import pytest

from egressd.proxy.core.http1.heads import RequestHead, parse_request_head
from egressd.proxy.core.http1.syntax import HttpError
from egressd.proxy.core.modes import (
    EXPLICIT,
    RETRY_AFTER_S,
    RUN_CAP_DETAIL,
    Reads,
    Refusal,
    bad_head,
    head_too_slow,
    no_destination,
    run_at_cap,
    too_many_connections,
    transparent_http,
    transparent_tls,
)
from egressd.vocabulary.reasons import Reason
from egressd.vocabulary.wire import Alert


def _head(method: str, target: str, *headers: tuple[str, str]) -> RequestHead:
    return RequestHead(method, target, "HTTP/1.1", list(headers))


def test_the_explicit_proxy_goes_where_the_request_target_says_whatever_the_host_header() -> None:
    dest = EXPLICIT.destination(_head("GET", "http://origin.test:8080/x", ("Host", "leak.test")))
    assert (dest.host, dest.port, dest.path) == ("origin.test", 8080, "/x")
    assert EXPLICIT.destination(_head("CONNECT", "origin.test:443")).port == 443


def test_the_transparent_http_mode_goes_where_the_host_header_says_on_its_own_port() -> None:
    mode = transparent_http()
    dest = mode.destination(_head("GET", "/a", ("Host", "origin.test")))
    assert (dest.host, dest.port, dest.path) == ("origin.test", 80, "/a")
    with pytest.raises(HttpError):
        mode.destination(_head("GET", "/a", ("Host", "origin.test:8081")))
    with pytest.raises(HttpError):
        mode.destination(_head("CONNECT", "origin.test:80"))
    assert transparent_http(8081).destination(_head("GET", "/", ("Host", "origin.test:8081"))).port == 8081


def test_only_the_explicit_proxy_attributes_by_proxy_credentials() -> None:
    head = _head("GET", "/", ("Host", "a.test"), ("Proxy-Authorization", "Basic eDp5"))
    assert EXPLICIT.proxy_credentials(head) == "Basic eDp5"
    assert transparent_http().proxy_credentials(head) is None
    assert transparent_tls().proxy_credentials(None) is None
    assert EXPLICIT.proxy_credentials(_head("GET", "http://a.test/")) is None


def test_the_modes_read_what_their_clients_send_first_on_the_design_ports() -> None:
    assert (EXPLICIT.reads, EXPLICIT.dest_port) == (Reads.HTTP, None)
    assert (transparent_http().reads, transparent_http().dest_port) == (Reads.HTTP, 80)
    assert (transparent_tls().reads, transparent_tls().dest_port) == (Reads.TLS, 443)


def test_a_transparent_client_is_refused_plainly_not_asked_for_proxy_credentials() -> None:
    auth = Refusal(Reason.AUTH_REQUIRED)
    assert EXPLICIT.status(auth) is None  # the reason's own: 407
    assert transparent_http().status(auth) == 403
    assert transparent_http().status(Refusal(Reason.AUTH_REQUIRED, status=400)) == 400
    assert transparent_http().status(Refusal(Reason.DENIED)) is None


def test_a_full_listener_sheds_http_with_a_429_and_tls_without_an_alert() -> None:
    assert too_many_connections(Reads.HTTP) == Refusal(
        Reason.LIMIT_EXCEEDED, status=429, retry_after_s=RETRY_AFTER_S
    )
    tls = too_many_connections(Reads.TLS)
    assert (tls.reason, tls.silent, tls.status) == (Reason.LIMIT_EXCEEDED, True, None)


def test_a_run_at_its_cap_says_so_in_the_record_unless_found_at_attribution_over_http() -> None:
    assert run_at_cap(Reads.HTTP, attributed=False).detail == RUN_CAP_DETAIL
    assert run_at_cap(Reads.HTTP, attributed=True).detail is None
    assert run_at_cap(Reads.HTTP, attributed=True).status == 429
    for attributed in (False, True):
        tls = run_at_cap(Reads.TLS, attributed=attributed)
        assert (tls.detail, tls.silent, tls.alert) == (RUN_CAP_DETAIL, False, None)


def test_a_slow_head_is_a_408_and_a_slow_hello_a_silent_close() -> None:
    assert head_too_slow(Reads.HTTP) == Refusal(Reason.LIMIT_EXCEEDED, "request head too slow", status=408)
    assert head_too_slow(Reads.TLS).silent


def test_a_head_too_large_is_a_limit_and_any_other_bad_head_a_bad_request() -> None:
    assert bad_head(HttpError(431, "head too large")) == Refusal(Reason.LIMIT_EXCEEDED, "head too large", status=431)
    assert bad_head(HttpError(505, "version")) == Refusal(Reason.BAD_REQUEST, "version", status=505)
    assert no_destination(HttpError(400, "no host")) == Refusal(Reason.BAD_REQUEST, "no host", status=400)


def test_a_refusal_carries_no_alert_unless_told() -> None:
    assert Refusal(Reason.BAD_REQUEST).alert is None
    assert Refusal(Reason.BAD_REQUEST, alert=Alert.DECODE_ERROR).alert is Alert.DECODE_ERROR


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nProxy-Authorization: Basic eDp5\r\n\r\n", "Basic eDp5"),
        (b"GET http://a.test/ HTTP/1.1\r\nproxy-authorization: Basic eDp5\r\n\r\n", "Basic eDp5"),
        (b"GET http://a.test/ HTTP/1.1\nHost: a.test\nProxy-Authorization: Basic eDp5\n\n", "Basic eDp5"),
        (b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nX-Proxy-Authorization: no\r\n\r\n", None),
        (b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n", None),
    ],
)
def test_proxy_credentials_of_a_parsed_head(raw: bytes, expected: str | None) -> None:
    parsed = parse_request_head(raw, 65536)
    assert parsed is not None
    assert EXPLICIT.proxy_credentials(parsed[0]) == expected
