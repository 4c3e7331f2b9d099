"""Allowlist entries, the decision order, and the presets' entries."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.config.presets import PRESETS, UnknownPreset, preset_entries
from egressd.names.addresses import unmapped
from egressd.names.hosts import parse_ip_literal
from egressd.proxy.core.policy import (
    DEFAULT_PORTS,
    Entry,
    EntryError,
    PolicyDecision,
    Reason,
    RunPolicy,
    Verdict,
    approval_ports,
    decide,
    parse_entry,
)

# --- entries ---------------------------------------------------------------

VALID_ENTRIES: list[tuple[str, str, bool, frozenset[int] | None, str | None]] = [
    ("example.com", "example.com", False, DEFAULT_PORTS, None),
    ("*.example.com", "example.com", True, DEFAULT_PORTS, None),
    ("example.com:8443", "example.com", False, frozenset({8443}), None),
    ("*.example.com:*", "example.com", True, None, None),
    ("Bücher.Example.", "xn--bcher-kva.example", False, DEFAULT_PORTS, None),
    ("*.bücher.example", "xn--bcher-kva.example", True, DEFAULT_PORTS, None),
    ("*.example.co.uk", "example.co.uk", True, DEFAULT_PORTS, None),
    ("com", "com", False, DEFAULT_PORTS, None),
    ("127.0.0.1", "127.0.0.1", False, DEFAULT_PORTS, "127.0.0.1"),
    ("127.0.0.1:8080", "127.0.0.1", False, frozenset({8080}), "127.0.0.1"),
    ("0x7f.1", "127.0.0.1", False, DEFAULT_PORTS, "127.0.0.1"),
    ("[::1]:443", "::1", False, frozenset({443}), "::1"),
    ("[::1]:*", "::1", False, None, "::1"),
    ("::1", "::1", False, DEFAULT_PORTS, "::1"),
]


@pytest.mark.parametrize(
    ("text", "host", "wildcard", "ports", "address"),
    VALID_ENTRIES,
    ids=[f"{entry[0]!r} parses" for entry in VALID_ENTRIES],
)
def test_entries_parse_to_host_ports_and_address(
    text: str, host: str, wildcard: bool, ports: frozenset[int] | None, address: str | None
) -> None:
    entry = parse_entry(text)
    assert entry.text == text
    assert entry.host == host
    assert entry.wildcard is wildcard
    assert entry.ports == ports
    assert (None if entry.address is None else entry.address.compressed) == address


INVALID_ENTRIES = [
    ("", "empty"),
    ("*", "bare '*'"),
    ("*:*", "bare '*'"),
    ("*.", "empty label"),
    ("*.com", "public suffix"),
    ("*.co.uk", "public suffix"),
    ("*.CO.UK.", "public suffix"),
    ("*.github.io", "public suffix"),
    ("*.githubusercontent.com", "public suffix"),
    ("*.internal", "public suffix"),
    ("**.example.com", "only wildcard"),
    ("*.*.example.com", "only wildcard"),
    ("a.*.example.com", "only wildcard"),
    ("example.*", "only wildcard"),
    ("*example.com", "only wildcard"),
    ("*.127.0.0.1", "IP address"),
    ("*.1", "IP address"),
    ("*.::1", "IP address"),
    ("*.[::1]", "IP address"),
    ("example.com:0", "invalid port"),
    ("example.com:65536", "invalid port"),
    ("example.com:", "invalid port"),
    ("example.com:http", "invalid port"),
    ("::1:*", "needs brackets"),
    ("exa mple.com", "a host name has no spaces"),
    ("example..com", "empty label"),
    ("256.0.0.1", "out of range"),
    ("[::1", "unbalanced"),
]


@pytest.mark.parametrize(
    ("text", "message"),
    INVALID_ENTRIES,
    ids=[f"{text!r} is refused: {message}" for text, message in INVALID_ENTRIES],
)
def test_bad_entries_are_refused_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(EntryError, match=message):
        parse_entry(text)


MATCHES = [
    ("*.example.com", "a.example.com", True),
    ("*.example.com", "a.b.example.com", True),
    ("*.example.com", "example.com", False),
    ("*.example.com", "badexample.com", False),
    ("*.example.com", "a.example.com.evil", False),
    ("example.com", "example.com", True),
    ("example.com", "www.example.com", False),
    ("127.0.0.1", "127.0.0.1", True),
    ("127.0.0.1", "::ffff:7f00:1", True),
    ("[::ffff:127.0.0.1]", "127.0.0.1", True),
    ("127.0.0.1", "127.0.0.2", False),
    ("127.0.0.1", "localhost", False),
    ("::1", "::1", True),
    ("::1", "127.0.0.1", False),
]


@pytest.mark.parametrize(
    ("text", "host", "expected"),
    MATCHES,
    ids=[f"{e!r} {'matches' if m else 'does not match'} {h!r}" for e, h, m in MATCHES],
)
def test_entries_match_normalised_hosts(text: str, host: str, expected: bool) -> None:
    assert parse_entry(text).matches_host(host) is expected


def test_entry_without_port_allows_only_80_and_443() -> None:
    entry = parse_entry("example.com")
    assert [port for port in (22, 80, 443, 8080) if entry.allows_port(port)] == [80, 443]


def test_entry_with_star_port_allows_any_port() -> None:
    entry = parse_entry("example.com:*")
    assert all(entry.allows_port(port) for port in (1, 80, 22, 65535))


# --- the decision order ----------------------------------------------------

BASE = RunPolicy(
    allow=tuple(
        parse_entry(text)
        for text in (
            "example.com",
            "*.wild.example",
            "api.example.org:8443",
            "any.example:*",
            "127.0.0.1",
            "[::1]:8080",
        )
    ),
    deny=tuple(
        parse_entry(text)
        for text in ("bad.wild.example", "*.evil.wild.example", "blocked.example:8080", "10.9.9.9")
    ),
    approved={"approved.example": approval_ports(8443), "example.com": frozenset({8443})},
    denied=frozenset({"nope.example", "example.com", "api.example.org", "10.0.0.1"}),
)
QUIET = RunPolicy(allow=BASE.allow, deny=BASE.deny, approved=BASE.approved, denied=BASE.denied,
                  ask=False)  # fmt: skip


def _deny(host: str, port: int, reason: Reason, rule: str | None = None) -> PolicyDecision:
    return PolicyDecision.deny(host, port, reason, rule)


DECISIONS: list[tuple[str, RunPolicy, str, int, PolicyDecision]] = [
    # 1. malformed
    ("a host with a space is a bad request", BASE, "exa mple.com", 443,
     _deny("exa mple.com", 443, Reason.BAD_REQUEST)),
    ("two trailing dots are a bad request", BASE, "example.com..", 443,
     _deny("example.com..", 443, Reason.BAD_REQUEST)),
    ("an out-of-range IPv4 literal is a bad request", BASE, "256.1.1.1", 443,
     _deny("256.1.1.1", 443, Reason.BAD_REQUEST)),
    ("port 0 is a bad request", BASE, "example.com", 0,
     _deny("example.com", 0, Reason.BAD_REQUEST)),
    ("port 65536 is a bad request", BASE, "example.com", 65536,
     _deny("example.com", 65536, Reason.BAD_REQUEST)),
    # 2. denylisted
    ("a deny entry beats a wildcard allow entry", BASE, "bad.wild.example", 443,
     _deny("bad.wild.example", 443, Reason.DENYLISTED, "bad.wild.example")),
    ("a wildcard deny entry beats a wildcard allow entry", BASE, "x.evil.wild.example", 443,
     _deny("x.evil.wild.example", 443, Reason.DENYLISTED, "*.evil.wild.example")),
    ("a deny entry applies on every port", BASE, "blocked.example", 443,
     _deny("blocked.example", 443, Reason.DENYLISTED, "blocked.example:8080")),
    ("a deny entry for an IP catches other spellings", BASE, "0xa.9.9.9", 443,
     _deny("10.9.9.9", 443, Reason.DENYLISTED, "10.9.9.9")),
    # 3. IP literals
    ("an IP literal nobody named is refused", BASE, "10.0.0.1", 443,
     _deny("10.0.0.1", 443, Reason.IP_LITERAL)),
    ("an IPv6 literal nobody named is refused", BASE, "[2606:4700::1]", 443,
     _deny("2606:4700::1", 443, Reason.IP_LITERAL)),
    ("an IP literal is refused even with asking off", QUIET, "8.8.8.8", 443,
     _deny("8.8.8.8", 443, Reason.IP_LITERAL)),
    # 4. allowed
    ("an exact entry allows its host on 443", BASE, "example.com", 443,
     PolicyDecision.allow("example.com", 443, "example.com")),
    ("case and a trailing dot do not matter", BASE, "EXAMPLE.com.", 80,
     PolicyDecision.allow("example.com", 80, "example.com")),
    ("a wildcard entry allows a deep subdomain", BASE, "a.b.wild.example", 443,
     PolicyDecision.allow("a.b.wild.example", 443, "*.wild.example")),
    ("an entry with a port allows that port", BASE, "api.example.org", 8443,
     PolicyDecision.allow("api.example.org", 8443, "api.example.org:8443")),
    ("an entry with a star port allows any port", BASE, "any.example", 1,
     PolicyDecision.allow("any.example", 1, "any.example:*")),
    ("an IP entry allows its address in another spelling", BASE, "2130706433", 80,
     PolicyDecision.allow("127.0.0.1", 80, "127.0.0.1")),
    ("an IP entry allows the IPv4-mapped form", BASE, "[::ffff:127.0.0.1]", 443,
     PolicyDecision.allow("::ffff:7f00:1", 443, "127.0.0.1")),
    ("a bracketed IPv6 entry allows its port", BASE, "[::1]", 8080,
     PolicyDecision.allow("::1", 8080, "[::1]:8080")),
    ("an approved host is allowed on the approved port", BASE, "approved.example", 8443,
     PolicyDecision.allow("approved.example", 8443, "approved")),
    ("an approved host is allowed on 80", BASE, "approved.example", 80,
     PolicyDecision.allow("approved.example", 80, "approved")),
    ("an approved host is allowed on 443", BASE, "approved.example", 443,
     PolicyDecision.allow("approved.example", 443, "approved")),
    ("an approval extends an entry to another port", BASE, "example.com", 8443,
     PolicyDecision.allow("example.com", 8443, "approved")),
    ("an allow entry beats an earlier denial", BASE, "example.com", 443,
     PolicyDecision.allow("example.com", 443, "example.com")),
    # 5. port not allowed: a destination of its own, asked about; refused when asking is off
    ("an entry's host on another port is asked about", BASE, "x.wild.example", 8080,
     PolicyDecision.ask("x.wild.example", 8080)),
    ("an IP entry with a port asks about other ports", BASE, "::1", 443, PolicyDecision.ask("::1", 443, "::1")),
    ("another port of a host a person denied is not asked about again", BASE, "api.example.org", 443,
     _deny("api.example.org", 443, Reason.DENIED_EARLIER)),
    ("an entry's host on another port, asking off", QUIET, "example.com", 8080,
     _deny("example.com", 8080, Reason.PORT_NOT_ALLOWED, "example.com")),
    ("an entry with a port refuses the default ports, asking off", QUIET, "api.example.org", 443,
     _deny("api.example.org", 443, Reason.PORT_NOT_ALLOWED, "api.example.org:8443")),
    ("an IP entry with a port refuses other ports, asking off", QUIET, "::1", 443,
     _deny("::1", 443, Reason.PORT_NOT_ALLOWED, "[::1]:8080")),
    # 6. denied earlier
    ("a host denied earlier is refused without asking", BASE, "nope.example", 443,
     _deny("nope.example", 443, Reason.DENIED_EARLIER)),
    ("a denial covers every port of the host", BASE, "NOPE.example.", 22,
     _deny("nope.example", 22, Reason.DENIED_EARLIER)),
    ("denied earlier is reported even with asking off", QUIET, "nope.example", 443,
     _deny("nope.example", 443, Reason.DENIED_EARLIER)),
    # 7. ask, or not allowlisted
    ("a new host is asked about", BASE, "new.example", 443,
     PolicyDecision.ask("new.example", 443)),
    ("an exact entry does not cover a subdomain", BASE, "www.example.com", 443,
     PolicyDecision.ask("www.example.com", 443)),
    ("a wildcard entry does not cover its apex", BASE, "wild.example", 443,
     PolicyDecision.ask("wild.example", 443)),
    ("a wildcard entry does not cover a look-alike", BASE, "badwild.example", 443,
     PolicyDecision.ask("badwild.example", 443)),
    ("an approved host on another port is asked again", BASE, "approved.example", 22,
     PolicyDecision.ask("approved.example", 22)),
    ("a new host with asking off is not allowlisted", QUIET, "new.example", 443,
     _deny("new.example", 443, Reason.NOT_ALLOWLISTED)),
    ("a new international host is asked in punycode", BASE, "Bücher.example", 443,
     PolicyDecision.ask("xn--bcher-kva.example", 443)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "host", "port", "expected"),
    [case[1:] for case in DECISIONS],
    ids=[case[0] for case in DECISIONS],
)
def test_decide_follows_the_decision_order(
    policy: RunPolicy, host: str, port: int, expected: PolicyDecision
) -> None:
    assert decide(policy, host, port) == expected


def test_approval_grants_its_port_and_the_web_ports() -> None:
    assert approval_ports(8443) == frozenset({8443, 80, 443})
    assert approval_ports(443) == frozenset({80, 443})


def test_decision_has_a_reason_exactly_when_it_denies() -> None:
    with pytest.raises(ValueError):
        PolicyDecision(Verdict.ALLOW, "example.com", 443, Reason.DENIED)
    with pytest.raises(ValueError):
        PolicyDecision(Verdict.DENY, "example.com", 443)


def test_reason_codes_are_the_designs() -> None:
    assert {reason.value for reason in Reason} == {
        "denylisted", "not_allowlisted", "denied", "approval_timeout", "no_approver",
        "denied_earlier", "too_many_pending", "ip_literal", "private_address",
        "port_not_allowed", "sni_mismatch", "bad_request", "auth_required",
        "resolve_failed", "upstream_unreachable", "upstream_timeout", "limit_exceeded",
        "audit_unavailable", "shutting_down",  # 503s: the log cannot be written; egressd stopped
        "unsupported_query",  # a DNS query of a type egressd does not answer
        "empty_answer",  # an AAAA query answered with no address (NODATA)
        "tls_intercept_failed", "secret_misdirected",  # inspection's (DESIGN.md "Policy", request rules)
    }  # fmt: skip


# --- properties ------------------------------------------------------------

LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?", fullmatch=True)
NAME = st.lists(st.sampled_from(["a", "b", "example", "com", "wild", "evil"]), min_size=1,
                max_size=4).map(".".join)  # fmt: skip
PORT = st.sampled_from([1, 22, 80, 443, 8080, 8443, 65535])
LOOPBACK = IPv4Address("127.0.0.1")


@st.composite
def loopback_spellings(draw: st.DrawFn) -> str:
    """Any spelling of 127.0.0.1 a client library accepts, IPv4-mapped included."""
    value = int(LOOPBACK)
    count = draw(st.integers(1, 4))
    parts = [(value >> (8 * (3 - index))) & 0xFF for index in range(count - 1)]
    parts.append(value & ((1 << (8 * (5 - count))) - 1))
    texts = []
    for part in parts:
        style = draw(st.sampled_from(["dec", "oct", "hex"]))
        zeros = "0" * draw(st.integers(0, 2))
        texts.append(
            {"dec": str(part), "oct": f"0{zeros}{part:o}", "hex": f"0x{zeros}{part:X}"}[style]
        )
    return draw(
        st.sampled_from(
            [
                ".".join(texts),
                ".".join(texts) + ".",
                "::ffff:127.0.0.1",
                "[::FFFF:7f00:1]",
                "[0:0:0:0:0:ffff:127.0.0.1]",
            ]
        )
    )


@given(st.text(alphabet="abcexmplo.-_0123456789", max_size=20))
def test_wildcard_never_matches_apex_or_lookalike(prefix: str) -> None:
    entry = parse_entry("*.example.com")
    assert not entry.matches_host("example.com")
    if not prefix.endswith("."):
        assert not entry.matches_host(prefix + "example.com")


@given(st.lists(LABEL, min_size=1, max_size=3))
def test_wildcard_matches_every_subdomain(labels: list[str]) -> None:
    assert parse_entry("*.example.com").matches_host(".".join(labels) + ".example.com")


@given(loopback_spellings(), PORT)
def test_every_spelling_of_loopback_is_an_ip_literal_unless_named(text: str, port: int) -> None:
    refused = decide(RunPolicy(allow=(parse_entry("example.com:*"),)), text, port)
    assert (refused.verdict, refused.reason) == (Verdict.DENY, Reason.IP_LITERAL)
    allowed = decide(RunPolicy(allow=(parse_entry("127.0.0.1:*"),)), text, port)
    assert (allowed.verdict, allowed.rule) == (Verdict.ALLOW, "127.0.0.1:*")
    # What the gate dials, from the parse that decided: no second parse.
    assert allowed.address is not None and unmapped(allowed.address) == IPv4Address("127.0.0.1")
    assert allowed.address == parse_ip_literal(allowed.host)


def test_a_decision_carries_the_literal_address_only_for_an_ip() -> None:
    policy = RunPolicy(allow=(parse_entry("example.com"), parse_entry("[::1]")), ask=True)
    assert decide(policy, "example.com", 443).address is None
    assert decide(policy, "other.example", 443).address is None
    assert decide(policy, "[::1]", 443).address == IPv6Address("::1")
    assert decide(policy, "[::1%25eth0]", 80).address == IPv6Address("::1")


@given(NAME, PORT, st.booleans())
def test_case_and_one_trailing_dot_do_not_change_decisions(
    name: str, port: int, quiet: bool
) -> None:
    policy = QUIET if quiet else BASE
    assert decide(policy, name.upper() + ".", port) == decide(policy, name, port)
    malformed = decide(policy, name + "..", port)
    assert (malformed.verdict, malformed.reason) == (Verdict.DENY, Reason.BAD_REQUEST)


@given(st.text(max_size=40), st.integers(-5, 70000))
def test_garbage_yields_a_decision_or_entry_error(text: str, port: int) -> None:
    decision = decide(BASE, text, port)
    assert isinstance(decision, PolicyDecision)
    assert (decision.reason is None) == (decision.verdict is not Verdict.DENY)
    try:
        entry = parse_entry(text)
    except EntryError:
        return
    assert isinstance(entry, Entry)
    assert entry.wildcard or entry.matches_host(entry.host)


@given(st.integers(1, 65535))
def test_approval_always_grants_the_asked_port(port: int) -> None:
    host = "new.example"
    assert decide(BASE, host, port).verdict is Verdict.ASK
    approved = RunPolicy(approved={host: approval_ports(port)})
    for granted in (port, 80, 443):
        assert decide(approved, host, granted) == PolicyDecision.allow(host, granted, "approved")


# --- presets ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text"),
    [(name, text) for name, entries in PRESETS.items() for text in entries],
    ids=[f"preset {name} entry {text} parses" for name, es in PRESETS.items() for text in es],
)
def test_every_preset_entry_parses(name: str, text: str) -> None:
    entry = parse_entry(text)
    assert entry.address is None


def test_presets_name_the_common_toolchains() -> None:
    assert {"python", "node", "github", "debian", "rust"} <= set(PRESETS)
    assert set(preset_entries("python")) == {"pypi.org", "files.pythonhosted.org"}
    assert "registry.npmjs.org" in preset_entries("node")
    assert "github.com" in preset_entries("github")


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(UnknownPreset) as caught:
        preset_entries("cobol")
    assert isinstance(caught.value, KeyError)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith("unknown preset 'cobol'; known presets: ")
    assert all(name in str(caught.value) for name in PRESETS)


def test_ipv6_entry_is_one_address() -> None:
    entry = parse_entry("[::1]:443")
    assert entry.address == IPv6Address("::1")
    assert not entry.matches_host("::2")
