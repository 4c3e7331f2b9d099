"""Refusals: what a refused client sees, read back with the strict parser."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from egressd.proxy.core.http1.framing import BodyKind
from egressd.proxy.core.http1.heads import ResponseHead, parse_response_head, response_body_kind
from egressd.proxy.core.responses import CONNECT_ESTABLISHED, refusal
from egressd.vocabulary.reasons import Reason


def read_back(raw: bytes) -> tuple[ResponseHead, bytes]:
    """Parse a refusal strictly; its head and its body (exactly Content-Length)."""
    parsed = parse_response_head(raw, 64 * 1024)
    assert parsed is not None
    head, used = parsed
    assert response_body_kind(head, "GET") == (BodyKind.LENGTH, len(raw) - used)
    return head, raw[used:]


def refuse(
    host: str = "evil.example",
    port: int | None = 443,
    run_id: str | None = "r-7f3a",
    message: str | None = "denied by approver",
    *,
    status: int | None = 403,
    reason: Reason = Reason.DENIED,
    request_id: str = "q-1",
    retry_after_s: int | None = None,
) -> bytes:
    return refusal(reason, host, port, run_id, request_id, status=status, message=message, retry_after_s=retry_after_s)


def test_refusal_matches_the_design_example_byte_for_byte() -> None:
    body = b"egressd: blocked evil.example:443 (denied by approver) in run r-7f3a\n"
    assert (
        refuse()
        == (
            b"HTTP/1.1 403 Forbidden\r\n"
            b"X-Egress-Decision: deny\r\n"
            b"X-Egress-Reason: denied\r\n"
            b"X-Egress-Request-Id: q-1\r\n"
            b"Content-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: %d\r\n"
            b"Connection: close\r\n"
            b"\r\n" % len(body)
        )
        + body
    )


def test_refusal_reads_back_with_the_strict_parser() -> None:
    head, body = read_back(refuse(reason=Reason.NOT_ALLOWLISTED, request_id="01HX"))
    assert (head.version, head.status, head.reason) == ("HTTP/1.1", 403, "Forbidden")
    assert head.get("X-Egress-Decision") == "deny"
    assert head.get("X-Egress-Reason") == "not_allowlisted"
    assert head.get("X-Egress-Request-Id") == "01HX"
    assert head.get("Content-Type") == "text/plain; charset=utf-8"
    assert head.keep_alive is False
    assert body.count(b"\n") == 1 and body.endswith(b"\n")


@pytest.mark.parametrize(
    ("port", "run_id", "body"),
    [
        pytest.param(443, "r-1", b"egressd: blocked h.example:443 (m) in run r-1\n", id="all"),
        pytest.param(None, "r-1", b"egressd: blocked h.example (m) in run r-1\n", id="no port"),
        pytest.param(80, None, b"egressd: blocked h.example:80 (m)\n", id="no run"),
        pytest.param(None, None, b"egressd: blocked h.example (m)\n", id="neither"),
    ],
)
def test_body_omits_what_is_not_known(port: int | None, run_id: str | None, body: bytes) -> None:
    assert read_back(refuse("h.example", port, run_id, "m"))[1] == body


def test_ipv6_host_is_bracketed_before_the_port() -> None:
    assert read_back(refuse("2001:db8::1", 443))[1].startswith(b"egressd: blocked [2001:db8::1]:443 ")
    assert read_back(refuse("2001:db8::1", None))[1].startswith(b"egressd: blocked 2001:db8::1 ")


@pytest.mark.parametrize(
    ("status", "phrase"),
    [
        (400, "Bad Request"),
        (403, "Forbidden"),
        (407, "Proxy Authentication Required"),
        (408, "Request Timeout"),
        (429, "Too Many Requests"),
        (431, "Request Header Fields Too Large"),
        (501, "Not Implemented"),
        (502, "Bad Gateway"),
        (504, "Gateway Timeout"),
        (505, "HTTP Version Not Supported"),
    ],
)
def test_status_line_carries_the_standard_phrase(status: int, phrase: str) -> None:
    head, _ = read_back(refuse(status=status))
    assert (head.status, head.reason) == (status, phrase)


def test_only_407_asks_for_proxy_credentials() -> None:
    head, _ = read_back(refuse(status=407, reason=Reason.AUTH_REQUIRED))
    assert head.get_all("Proxy-Authenticate") == ['Basic realm="egressd"']
    for status in (400, 403, 429, 502):
        assert read_back(refuse(status=status))[0].get("Proxy-Authenticate") is None


def test_retry_after_follows_the_egress_fields() -> None:
    head, _ = read_back(refuse(status=429, reason=Reason.LIMIT_EXCEEDED, retry_after_s=1))
    names = [name for name, _ in head.headers]
    assert names.index("Retry-After") == 3
    assert head.get("Retry-After") == "1"


INJECTIONS = [
    "evil\r\nX-Egress-Decision: allow",
    "evil\nX-Egress-Decision: allow",
    "evil\rX-Egress-Decision: allow",
    "evil\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
    "evil\x00\x1b[31m\x7f",
    "evil\u2028\u0085line",
    "évil.example\U0001f600",
    "a\\x0d\\x0a",
]


@pytest.mark.parametrize("text", INJECTIONS)
def test_injection_in_any_field_adds_no_header_and_no_line(text: str) -> None:
    attempts = [
        (refuse(host=text, retry_after_s=1), refuse(retry_after_s=1)),
        (refuse(message=text, retry_after_s=1), refuse(retry_after_s=1)),
        (refuse(run_id=text, retry_after_s=1), refuse(retry_after_s=1)),
        (refuse(request_id=text, retry_after_s=1), refuse(retry_after_s=1)),
    ]
    for raw, plain in attempts:
        head, body = read_back(raw)
        assert raw.isascii()
        assert [n for n, _ in head.headers] == [n for n, _ in read_back(plain)[0].headers]
        assert head.get_all("X-Egress-Decision") == ["deny"]
        assert body.count(b"\n") == 1 and body.endswith(b"\n")
        assert b"\r" not in body


def test_escaping_is_visible_and_unambiguous() -> None:
    body = read_back(refuse(host="a\r\nb\\x\u00e9", port=None, run_id=None, message="m"))[1]
    assert body == b"egressd: blocked a\\x0d\\x0ab\\\\x\\xe9 (m)\n"


@pytest.mark.parametrize("status", [200, 302, 399, 600, 499])
def test_a_refusal_needs_a_known_error_status(status: int) -> None:
    with pytest.raises(ValueError):
        refuse(status=status)


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("denied", 403),
        ("not_allowlisted", 403),
        ("private_address", 403),
        ("sni_mismatch", 403),
        ("too_many_pending", 403),
        ("bad_request", 400),
        ("auth_required", 407),
        ("resolve_failed", 502),
        ("upstream_unreachable", 502),
        ("upstream_timeout", 504),
        ("limit_exceeded", 429),
    ],
)
def test_default_status_per_reason(reason: str, status: int) -> None:
    assert Reason(reason).status == status
    assert read_back(refuse(reason=Reason(reason), status=None))[0].status == status


def test_the_example_message_for_denied() -> None:
    assert Reason.DENIED.message == "denied by approver"
    assert b"(denied by approver)" in read_back(refuse(message=None))[1]


def test_reason_table_is_read_only() -> None:
    with pytest.raises(AttributeError):
        Reason.DENIED.message = "ok"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Reason.DENIED.status = 200  # type: ignore[misc]


def test_connect_established_is_a_bodyless_200() -> None:
    parsed = parse_response_head(CONNECT_ESTABLISHED, 1024)
    assert parsed is not None
    head, used = parsed
    assert used == len(CONNECT_ESTABLISHED)
    assert (head.status, head.reason, head.headers) == (200, "Connection established", [])
    assert response_body_kind(head, "CONNECT") == (BodyKind.NONE, 0)


@given(
    st.text(max_size=40),
    st.one_of(st.none(), st.integers(min_value=1, max_value=65535)),
    st.one_of(st.none(), st.text(max_size=20)),
    st.text(max_size=20),
    st.text(max_size=40),
    st.sampled_from(list(Reason)),
)
@example("evil\r\nX-Egress-Decision: allow", 443, "r\n", "id\r", "m\x00", Reason.DENIED)
def test_any_text_gives_one_well_formed_refusal(
    host: str, port: int | None, run_id: str | None, request_id: str, message: str, reason: Reason
) -> None:
    raw = refusal(reason, host, port, run_id, request_id, message=message)
    head, body = read_back(raw)
    expected = ["X-Egress-Decision", "X-Egress-Reason", "X-Egress-Request-Id"]
    if head.status == 407:
        expected.append("Proxy-Authenticate")
    expected += ["Content-Type", "Content-Length", "Connection"]
    assert [name for name, _ in head.headers] == expected
    assert head.get("X-Egress-Reason") == reason.value
    assert body.startswith(b"egressd: blocked ")
    assert body.count(b"\n") == 1 and body.endswith(b"\n")
    assert raw.isascii()
