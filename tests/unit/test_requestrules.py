"""Request rules and paths: every ambiguous spelling refused, the grammar, matching, the answers' prefixes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.proxy.core.policy import EntryError, RunPolicy, Verdict, decide, decide_request, parse_entry
from egressd.proxy.core.requestrules import (
    READ_ONLY,
    WEBSOCKET,
    PathError,
    RequestError,
    RuleError,
    approval_prefix,
    normalise_path,
    override_method,
    parse_rule,
    suggested_rule,
    under,
)
from egressd.vocabulary.reasons import Reason


@pytest.mark.parametrize(
    ("target", "path", "forwarded"),
    [
        ("/", "/", "/"),
        ("/a/b", "/a/b", "/a/b"),
        ("/a/b/", "/a/b/", "/a/b/"),
        ("/a/./b", "/a/b", "/a/b"),
        ("/a/b/../c", "/a/c", "/a/c"),
        ("/a/b/..", "/a/", "/a/"),
        ("/a/%7euser", "/a/~user", "/a/~user"),  # unreserved escapes decoded
        ("/a/%41%2d", "/a/A-", "/a/A-"),
        ("/a/%e2%82%ac", "/a/%E2%82%AC", "/a/%E2%82%AC"),  # others kept, in upper case
        ("/a%20b", "/a%20b", "/a%20b"),
        ("/search?q=1&x", "/search", "/search?q=1&x"),  # the query forwarded as sent
    ],
)
def test_paths_are_normalised_as_rfc_3986_says(target: str, path: str, forwarded: str) -> None:
    normal = normalise_path(target)
    assert (normal.path, normal.target) == (path, forwarded)


@pytest.mark.parametrize(
    "target",
    [
        "/docs/%2e%2e/admin", "/docs/.%2E/admin", "/docs/%2E", "/docs/..%2Fadmin", "/docs/%2fadmin", "/docs/%2F",
        "/docs/%5cadmin", "/docs\\admin", "/docs//a", "//a", "/docs/a;x=1", "/docs;/a", "/docs/%00", "/a\x00",
        "/docs/%c0%ae%c0%ae/a", "/a/%c0%af", "/a/%e0%80%ae", "/a/%ff", "/a/%zz", "/a/%4", "/a/%",
        "/..", "/a/../..", "a/b", "*", "http://x/a", "/a b", "/a\tb", "/é", "/a#frag",
    ],
)  # fmt: skip
def test_every_ambiguous_spelling_is_refused(target: str) -> None:
    with pytest.raises(PathError):
        normalise_path(target)


_SEGMENT = st.text(alphabet="ab.%2eEfF5cC0/~-;?", max_size=12)


@given(st.lists(_SEGMENT, max_size=6))
def test_normalising_is_idempotent_and_leaves_nothing_to_climb(parts: list[str]) -> None:
    target = "/" + "/".join(parts)
    try:
        normal = normalise_path(target)
    except PathError:
        return
    assert normalise_path(normal.target) == normal
    segments = normal.path.split("/")[1:]
    assert "." not in segments and ".." not in segments
    assert "//" not in normal.path and "%2F" not in normal.path.upper() and "\\" not in normal.path


def test_query_names_are_kept_and_values_are_not() -> None:
    assert normalise_path("/a?token=SECRET&page=2&flag").query_names == ("token", "page", "flag")
    assert normalise_path("/a").query_names == () and normalise_path("/a").query is None


@pytest.mark.parametrize(
    ("text", "methods", "authority", "pattern", "canonical"),
    [
        ("GET github.com/org/repo/**", {"GET"}, "github.com", ("org", "repo", "**"), "GET github.com/org/repo/**"),
        ("HEAD|GET github.com/org/*", {"GET", "HEAD"}, "github.com", ("org", "*"), "GET|HEAD github.com/org/*"),
        ("api.github.com/repos/org/*/pulls", None, "api.github.com", ("repos", "org", "*", "pulls"),
         "api.github.com/repos/org/*/pulls"),
        ("POST api.openai.com:8443", {"POST"}, "api.openai.com:8443", ("**",), "POST api.openai.com:8443/**"),
        ("read_only *.github.com", READ_ONLY, "*.github.com", ("**",), "read_only *.github.com"),
        ("inspect github.com", set(), "github.com", ("**",), "inspect github.com"),
    ],
)  # fmt: skip
def test_the_grammar(text: str, methods: set[str] | None, authority: str, pattern: tuple[str, ...],
                     canonical: str) -> None:  # fmt: skip
    rule = parse_rule(text)
    assert rule is not None
    assert (rule.methods, rule.authority, rule.pattern, rule.text) == (
        None if methods is None else frozenset(methods), authority, pattern, canonical)
    assert parse_rule(rule.text) == rule  # the canonical text reads back the same


@pytest.mark.parametrize("text", ["example.com", "*.example.com:443", "example.com:*", "[::1]:443", "127.0.0.1"])
def test_a_plain_entry_is_no_rule(text: str) -> None:
    assert parse_rule(text) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("get github.com/a", "not a method"),
        ("GET,POST github.com/a", "not a method"),
        ("CONNECT github.com", "cannot be allowed"),
        ("TRACE github.com/a", "cannot be allowed"),
        ("GET github.com/a/**/b", "'\\*\\*' comes last"),
        ("GET github.com/a*b", "whole segment"),
        ("GET github.com/a/../b", "not normalised"),
        ("GET github.com/a/%2e%2e", "dot segment"),
        ("GET github.com/a?x=1", "no query"),
        ("GET /a", "names a host"),
        ("read_only github.com/a", "names a host, not a path"),
        ("GET github.com/a extra", "a rule is"),
    ],
)
def test_bad_rules_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(RuleError, match=message):
        parse_rule(text)


@pytest.mark.parametrize(
    ("rule", "method", "path", "covered"),
    [
        ("GET h.test/org/repo/**", "GET", "/org/repo", True),
        ("GET h.test/org/repo/**", "GET", "/org/repo/issues/3", True),
        ("GET h.test/org/repo/**", "GET", "/org/repository", False),
        ("GET h.test/org/repo/**", "POST", "/org/repo/x", False),
        ("GET h.test/org/repo/**", "get", "/org/repo/x", False),  # methods are case-sensitive
        ("h.test/repos/org/*/pulls", "PATCH", "/repos/org/x/pulls", True),
        ("h.test/repos/org/*/pulls", "PATCH", "/repos/org/x/y/pulls", False),
        ("h.test/repos/org/*/pulls", "PATCH", "/repos/org//pulls", False),
        ("read_only h.test", "OPTIONS", "/anything/at/all", True),
        ("read_only h.test", "PUT", "/anything", False),
        ("inspect h.test", "GET", "/", False),
    ],
)  # fmt: skip
def test_matching(rule: str, method: str, path: str, covered: bool) -> None:
    parsed = parse_rule(rule)
    assert parsed is not None and parsed.covers(method, path) is covered


def test_method_override_headers_name_the_method_judged_or_refuse_when_they_disagree() -> None:
    assert override_method([("Accept", "*/*")]) is None
    assert override_method([("X-HTTP-Method-Override", "delete")]) == "DELETE"
    assert override_method([("x-method-override", "PUT"), ("X-HTTP-Method", "put")]) == "PUT"
    with pytest.raises(RequestError):
        override_method([("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method", "DELETE")])
    with pytest.raises(RequestError):
        override_method([("X-HTTP-Method-Override", "GET POST")])


def test_an_answer_for_the_run_covers_the_paths_prefix_and_always_keeps_a_rule_that_reads_back() -> None:
    assert approval_prefix("/org/repo/issues/3") == "/org/repo"
    assert approval_prefix("/v1") == "/v1" and approval_prefix("/") == "/"
    assert under("/org/repo/x", "/org/repo") and under("/org/repo", "/org/repo")
    assert not under("/org/repository", "/org/repo") and under("/anything", "/")
    text = suggested_rule("POST", "api.github.com", 443, "/org/repo/issues/3")
    assert text == "POST api.github.com/org/repo/**"
    assert suggested_rule("GET", "h.test", 8443, "/") == "GET h.test:8443/**"
    entry = parse_entry(text)
    assert entry.request is not None and entry.host == "api.github.com" and entry.request.covers("POST", "/org/repo")


# -- the policy with request rules ----------------------------------------------------------------


def _policy(*texts: str, **values: object) -> RunPolicy:
    return RunPolicy(allow=tuple(parse_entry(text) for text in texts), **values)  # type: ignore[arg-type]


def test_a_name_with_a_rule_is_allowed_for_inspection_and_a_name_without_is_not() -> None:
    policy = _policy("GET github.com/org/**", "pypi.org")
    inspected = decide(policy, "github.com", 443)
    assert (inspected.verdict, inspected.inspect, inspected.rule) == (Verdict.ALLOW, True, "GET github.com/org/**")
    plain = decide(policy, "pypi.org", 443)
    assert (plain.verdict, plain.inspect) == (Verdict.ALLOW, False)
    # A plain entry for the same name does not open it: its requests are still decided one by one.
    both = decide(_policy("github.com", "GET github.com/org/**"), "github.com", 443)
    assert both.inspect


def test_requests_are_decided_by_the_rules_then_the_runs_answers() -> None:
    policy = _policy("GET github.com/org/**")
    assert decide_request(policy, "GET", "github.com", 443, "/org/x").verdict is Verdict.ALLOW
    assert decide_request(policy, "POST", "github.com", 443, "/org/x").verdict is Verdict.ASK
    approved = _policy("GET github.com/org/**", approved_requests=frozenset({("POST", "github.com", 443, "/org/x")}))
    assert decide_request(approved, "POST", "github.com", 443, "/org/x/y").rule == "approved"
    assert decide_request(approved, "POST", "github.com", 443, "/org/y").verdict is Verdict.ASK
    denied = _policy("GET github.com/org/**", denied_requests=frozenset({("POST", "github.com", "/org/x")}))
    assert decide_request(denied, "POST", "github.com", 443, "/org/x").reason is Reason.DENIED_EARLIER
    no_ask = _policy("GET github.com/org/**", ask=False)
    assert decide_request(no_ask, "POST", "github.com", 443, "/org/x").reason is Reason.NOT_ALLOWLISTED
    learning = _policy("GET github.com/org/**", learn=True)
    assert decide_request(learning, "POST", "github.com", 443, "/org/x").learned is Reason.NOT_ALLOWLISTED


def test_rules_name_hosts_and_keep_entries_errors() -> None:
    with pytest.raises(EntryError, match="not IP addresses"):
        parse_entry("GET 127.0.0.1/a")
    with pytest.raises(EntryError, match="public suffix"):
        parse_entry("GET *.com/a")


@pytest.mark.parametrize("target", ["/a|b", "/a[0]", "/a{b}", "/a<b>", "/a^b", "/a`b", '/a"b'])
def test_characters_rfc_3986_does_not_allow_in_a_path_are_refused(target: str) -> None:
    with pytest.raises(PathError, match="RFC 3986"):
        normalise_path(target)
    assert normalise_path("/a?filter[x]=1|2").query == "filter[x]=1|2"  # the query is never decided on


def test_a_websocket_upgrade_is_judged_as_websocket_which_only_a_rule_naming_it_or_no_method_allows() -> None:
    from egressd.proxy.core.http1.heads import parse_request_head
    from egressd.proxy.core.insiderequest import inside_request

    raw = (b"GET /ws HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
           b"X-HTTP-Method-Override: GET\r\n\r\n")  # fmt: skip
    parsed = parse_request_head(raw, 8192)
    assert parsed is not None
    request = inside_request(parsed[0], "a.test", 443)
    assert request.method == WEBSOCKET  # whatever an override header says
    for rules, verdict in [
        (("GET a.test/**",), Verdict.ASK),
        (("read_only a.test",), Verdict.ASK),
        (("WEBSOCKET a.test/ws",), Verdict.ALLOW),
        (("a.test/**",), Verdict.ALLOW),
    ]:
        assert decide_request(_policy(*rules), request.method, "a.test", 443, request.path).verdict is verdict, rules
