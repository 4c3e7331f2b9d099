"""Declared secrets: where a placeholder may go, and the real value put in only there."""

from __future__ import annotations

import base64

import pytest

from egressd.proxy.core.http1.heads import RequestHead
from egressd.proxy.core.secrets import Secret, SecretError, Secrets, parse_secret, placeholder

MARK = placeholder("0123456789abcdef0123456789abcdef")
REAL = "ghp_real-value"


def _secrets(text: str = "GITHUB_TOKEN@api.github.com|*.githubcdn.test") -> Secrets:
    return Secrets([parse_secret(text, value=REAL, placeholder=MARK)])


def _head(target: str = "/repos", **headers: str) -> RequestHead:
    return RequestHead("GET", target, "HTTP/1.1", [(k.replace("_", "-"), v) for k, v in headers.items()])


def test_declarations() -> None:
    secret = parse_secret("ANTHROPIC_API_KEY@api.anthropic.com x-api-key", value=REAL, placeholder=MARK)
    assert (secret.name, secret.header, [e.text for e in secret.hosts]) == (
        "ANTHROPIC_API_KEY", "x-api-key", ["api.anthropic.com"])
    assert secret.goes_to("api.anthropic.com", 443) and not secret.goes_to("evil.test", 443)
    assert REAL not in repr(secret) and REAL not in repr(Secrets([secret]))
    for bad in ("no-at-sign", "1BAD@h.test", "T@", "T@h.test bad:header", "T@GET h.test/a", "T@127.0.0.1", "T@*.com"):
        with pytest.raises(SecretError):
            parse_secret(bad, value=REAL, placeholder=MARK)
    with pytest.raises(SecretError, match="empty"):
        parse_secret("T@h.test", value="", placeholder=MARK)
    with pytest.raises(ValueError):
        placeholder("short")


def test_the_placeholder_goes_only_to_its_names_in_its_header_over_inspected_connections() -> None:
    secrets = _secrets()
    allowed = _head(Authorization=f"Bearer {MARK}")
    assert secrets.misdirected(allowed, "api.github.com", 443, inspected=True) is None
    assert secrets.misdirected(allowed, "raw.githubcdn.test", 443, inspected=True) is None
    cases = [
        (allowed, "evil.test", True, "to evil.test"),
        (allowed, "api.github.com", False, "does not inspect"),
        (_head(X_Exfil=MARK), "api.github.com", True, "in the header X-Exfil"),
        (_head(f"/gists?token={MARK}"), "api.github.com", True, "in the request target"),
        (_head(Authorization="Basic " + base64.b64encode(f"x:{MARK}".encode()).decode()), "evil.test", True, "to evil"),
    ]
    for head, host, inspected, where in cases:
        found = secrets.misdirected(head, host, 443, inspected=inspected)
        assert found is not None and found[0].name == "GITHUB_TOKEN" and where in found[1], (head, found)
    assert secrets.misdirected(_head(Authorization="Bearer other"), "evil.test", 443, inspected=False) is None


def test_the_real_value_is_put_in_its_header_only_and_for_basic_too() -> None:
    secrets = _secrets()
    head = _head(Authorization=f"token {MARK}", Accept="*/*")
    head.lowered = "stale"
    assert secrets.substitute(head, "api.github.com", 443)
    assert head.headers == [("Authorization", f"token {REAL}"), ("Accept", "*/*")] and head.lowered is None
    basic = _head(Authorization="Basic " + base64.b64encode(f"user:{MARK}".encode()).decode())
    assert secrets.substitute(basic, "api.github.com", 443)
    assert base64.b64decode(basic.headers[0][1][6:]) == f"user:{REAL}".encode()
    elsewhere = _head(Authorization=f"Bearer {MARK}")
    assert not secrets.substitute(elsewhere, "evil.test", 443) and MARK in elsewhere.headers[0][1]


def test_a_secret_value_is_never_shown() -> None:
    secret = Secret("T", (), "authorization", MARK, REAL)
    assert REAL not in repr(secret) and REAL not in str(secret)
