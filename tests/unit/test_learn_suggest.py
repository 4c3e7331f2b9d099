"""Learn mode in the policy, and ``egressd audit suggest``'s entries: pure, no I/O."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from egressd.proxy.core.dnsanswer import unreachable_reason
from egressd.proxy.core.policy import PolicyDecision, RunPolicy, Verdict, decide, parse_entry
from egressd.proxy.core.runs import RunRegistry
from egressd.proxy.core.suggest import SuggestError, render, suggest
from egressd.vocabulary.reasons import Reason

LEARN = RunPolicy(
    allow=(parse_entry("ok.example"),),
    deny=(parse_entry("evil.example"), parse_entry("*.bad.example")),
    learn=True,
)


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("evil.example", 443, PolicyDecision.deny("evil.example", 443, Reason.DENYLISTED, "evil.example")),
        ("x.bad.example", 443, PolicyDecision.deny("x.bad.example", 443, Reason.DENYLISTED, "*.bad.example")),
        ("10.0.0.1", 443, PolicyDecision.deny("10.0.0.1", 443, Reason.IP_LITERAL)),
        ("0x7f.1", 80, PolicyDecision.deny("127.0.0.1", 80, Reason.IP_LITERAL)),
        ("bad host", 443, PolicyDecision.deny("bad host", 443, Reason.BAD_REQUEST)),
        ("ok.example", 443, PolicyDecision.allow("ok.example", 443, "ok.example")),
        ("ok.example", 8443, PolicyDecision.learn("ok.example", 8443, Reason.PORT_NOT_ALLOWED)),
        ("new.example", 443, PolicyDecision.learn("new.example", 443, Reason.NOT_ALLOWLISTED)),
    ],
    ids=[
        "a deny entry is still refused",
        "a deny wildcard is still refused",
        "an IP literal is still refused",
        "an IP literal in another spelling is still refused",
        "a malformed host is still a bad request",
        "an allowlisted host is allowed by its rule",
        "a port the entry does not allow is learned",
        "an unlisted host is learned instead of asked about",
    ],
)
def test_learn_mode_decides(host: str, port: int, expected: PolicyDecision) -> None:
    assert decide(LEARN, host, port) == expected


def test_a_learned_allow_has_no_rule_and_names_the_refusal() -> None:
    decision = decide(LEARN, "new.example", 443)
    assert (decision.verdict, decision.rule, decision.learned) == (Verdict.ALLOW, None, Reason.NOT_ALLOWLISTED)
    with pytest.raises(ValueError):
        PolicyDecision(Verdict.DENY, "x", 1, Reason.DENIED, learned=Reason.DENIED)


def test_learn_mode_with_asking_off_learns_too_and_a_host_denied_earlier_stays_denied() -> None:
    policy = RunPolicy(ask=False, learn=True, denied=frozenset({"no.example"}))
    assert decide(policy, "new.example", 443).learned is Reason.NOT_ALLOWLISTED
    assert decide(policy, "no.example", 443).reason is Reason.DENIED_EARLIER


def test_runs_of_a_learning_registry_learn_and_a_denied_site_still_wins() -> None:
    runs = RunRegistry(learn=True)
    run = runs.create(task=None, allow=())
    assert run.learn and run.describe()["learn"] is True
    assert run.decide("a.new.example", 443).learned is Reason.NOT_ALLOWLISTED
    run.deny_host("a.new.example")
    assert run.decide("b.new.example", 443).reason is Reason.DENIED_EARLIER


def test_strict_dns_in_learn_mode_answers_only_what_the_allowlist_alone_refused() -> None:
    asking = RunRegistry(learn=True).create(task=None, allow=(), deny=(parse_entry("evil.example"),))
    quiet = RunRegistry(learn=True).create(task=None, allow=(), ask=False)
    assert unreachable_reason(asking, "evil.example")[0] is Reason.DENYLISTED
    assert unreachable_reason(asking, "new.example") == (None, None, None)  # a person could have been asked
    assert unreachable_reason(quiet, "new.example") == (None, None, Reason.NOT_ALLOWLISTED)
    assert unreachable_reason(quiet, "10.1.2.3")[0] is Reason.IP_LITERAL


# --- suggest ------------------------------------------------------------------------


def _egress(host: str, port: int | None = 443, decision: str = "allow", reason: str | None = None, **extra: Any):
    record = {
        "event": "egress",
        "id": f"{host}:{port}:{decision}",
        "ts": "2026-12-01T10:00:01Z",
        "run": "r-1",
        "kind": "connect",
        "host": host,
        "port": port,
        "decision": decision,
        "reason": reason,
        "rule": None,
    }
    return record | extra


START = {"event": "run.start", "ts": "2026-12-01T10:00:00Z", "run": "r-1", "learn": True}


def _allow(records: list[dict[str, Any]], **kw: Any) -> list[str]:
    text = render(suggest(records, **kw))
    allow = tomllib.loads(text)["allow"]
    for entry in allow:
        parse_entry(entry)  # every entry is one the policy accepts
    return allow


def test_three_names_under_one_domain_become_a_wildcard_and_the_apex_stays() -> None:
    names = ["a.example.com", "b.example.com", "c.example.com", "example.com"]
    records = [START, *(_egress(n, learned="not_allowlisted") for n in names)]
    allow = _allow(records)
    assert allow == ["*.example.com", "example.com"]
    wildcard = parse_entry("*.example.com")
    assert all(wildcard.reaches(n) for n in names[:3]) and not wildcard.reaches("example.com")


def test_two_names_stay_names() -> None:
    assert _allow([START, _egress("a.example.com"), _egress("b.example.com")]) == ["a.example.com", "b.example.com"]


@pytest.mark.parametrize(
    "names",
    [
        ["a.s3.amazonaws.com", "b.s3.amazonaws.com", "c.s3.amazonaws.com"],
        ["a.co.uk", "b.co.uk", "c.co.uk"],
        ["alice.github.io", "bob.github.io", "carol.github.io"],
    ],
    ids=["never *.s3.amazonaws.com nor *.amazonaws.com", "never *.co.uk", "never *.github.io"],
)
def test_no_wildcard_crosses_a_public_suffix(names: list[str]) -> None:
    allow = _allow([START, *(_egress(n) for n in names)])
    assert allow == sorted(names) and not any(e.startswith("*") for e in allow)


def test_names_under_a_private_suffix_group_under_their_own_registered_domain() -> None:
    names = ["x.bucket.s3.amazonaws.com", "y.bucket.s3.amazonaws.com", "z.bucket.s3.amazonaws.com"]
    assert _allow([START, *(_egress(n) for n in names)]) == ["*.bucket.s3.amazonaws.com"]


def test_other_ports_are_named_and_never_widened() -> None:
    records = [
        START,
        _egress("api.example.com", 8443),
        _egress("web.example.com", 80),
        _egress("web.example.com", 9000),
    ]
    assert _allow(records) == ["api.example.com:8443", "web.example.com", "web.example.com:9000"]


def test_refused_hosts_and_ip_literals_are_never_suggested_and_are_listed() -> None:
    records = [
        START,
        _egress("pypi.org", learned="not_allowlisted"),
        _egress("evil.example", decision="deny", reason="denylisted"),
        _egress("10.0.0.1", decision="deny", reason="ip_literal"),
        _egress("sneaky.example", decision="deny", reason="private_address", learned="not_allowlisted"),
        _egress("127.0.0.2", 8080),  # allowed by an entry naming the address: still no suggestion
        _egress("nonsense", decision="deny", reason="bad_request"),
    ]
    text = render(suggest(records))
    assert tomllib.loads(text)["allow"] == ["pypi.org"]
    assert "# refused, not suggested: 10.0.0.1 (ip_literal), evil.example (denylisted), " in text
    assert "sneaky.example (private_address)" in text and "nonsense" not in text
    assert "# IP addresses used, not suggested: 127.0.0.2" in text
    assert text.startswith(
        "# egressd audit suggest: 1 host from run r-1 (started 2026-12-01T10:00:00Z), 1 attempt let through"
    )


def test_a_connection_cut_after_its_record_is_not_suggested() -> None:
    records = [
        START,
        _egress("a.example"),
        {"event": "egress.end", "id": "a.example:443:allow", "run": "r-1", "end": "sni_mismatch"},
    ]
    text = render(suggest(records))
    assert tomllib.loads(text)["allow"] == [] and "a.example (sni_mismatch)" in text


def test_an_approved_host_is_suggested_and_an_upstream_failure_still_counts() -> None:
    records = [
        START,
        {"event": "approval.requested", "id": "a-1", "run": "r-1", "host": "approved.example", "port": 443},
        {"event": "approval.decided", "id": "a-1", "run": "r-1", "decision": "allow"},
        {"event": "approval.requested", "id": "a-2", "run": "r-1", "host": "refused.example", "port": 443},
        {"event": "approval.decided", "id": "a-2", "run": "r-1", "decision": "deny"},
        _egress("down.example", decision="deny", reason="upstream_unreachable"),
    ]
    assert _allow(records) == ["approved.example", "down.example"]


def test_dns_names_count_only_when_asked_for() -> None:
    records = [START, _egress("looked.example", None, kind="dns"), _egress("used.example")]
    assert _allow(records) == ["used.example"]
    assert _allow(records, include_dns=True) == ["looked.example", "used.example"]


def test_the_run_is_the_last_started_unless_named_and_counts_from_its_last_start() -> None:
    other = {"event": "run.start", "ts": "2026-12-01T11:00:00Z", "run": "r-2"}
    records = [
        _egress("before-restart.example"),
        START,
        _egress("mine.example"),
        other,
        _egress("theirs.example", run="r-2"),
    ]
    assert _allow(records) == ["theirs.example"]
    assert _allow(records, run="r-1") == ["mine.example"]
    with pytest.raises(SuggestError, match="no run 'r-9'"):
        suggest(records, "r-9")
    with pytest.raises(SuggestError):
        suggest([])


@pytest.mark.parametrize(
    "hostile",
    ['x"]\nallow = ["evil.example"]#', "a\nb.example", "\x1b[2Jpaint.example", "évil.example\u202e"],
)
def test_a_hostile_host_in_the_log_cannot_add_an_entry(hostile: str) -> None:
    records = [
        START,
        _egress(hostile),
        _egress(hostile, decision="deny", reason="denylisted"),
        _egress("fine.example"),
    ]
    text = render(suggest(records))
    parsed = tomllib.loads(text)
    assert list(parsed) == ["allow"]
    for entry in parsed["allow"]:
        parse_entry(entry)
    assert "evil.example" not in parsed["allow"] and "fine.example" in parsed["allow"]
    assert all(line.startswith(("#", "allow", "  ", "]")) for line in text.splitlines())


def test_egressd_run_tells_of_each_attempt_learn_mode_let_through() -> None:
    from egressd.audit.views import EgressSeen
    from egressd.cli.commands.run import refusal_line

    learned = _egress("new.example", learned="not_allowlisted")
    assert refusal_line(EgressSeen.of(learned)) == (
        "egressd: learned new.example:443 (let through by --learn: not on the allowlist)\n"
    )
    assert refusal_line(EgressSeen.of(_egress("ok.example"))) is None


def test_requests_on_inspected_names_become_request_rules_grouped_by_prefix_with_their_methods() -> None:
    def request(method: str, path: str, decision: str = "allow", **extra: Any) -> dict[str, Any]:
        return _egress("api.github.com", 443, decision, id=f"{method}{path}{decision}", kind="https",
                       method=method, path=path, **extra)

    records = [
        START,
        _egress("api.github.com", 443),  # the tunnel itself: its requests say more than its host
        request("GET", "/repos/org/repo/issues", learned="not_allowlisted"),
        request("GET", "/repos/org/repo/pulls/3"),
        request("POST", "/repos/org/repo/issues"),
        request("DELETE", "/repos/org/other", "deny", reason="denied"),
        _egress("pypi.org", 443),
        _egress("uploads.test", 8443, kind="https", method="PUT", path="/"),
    ]
    assert _allow(records) == [  # hosts first, then the rules
        "pypi.org",
        "GET|POST api.github.com/repos/org/**",
        "PUT uploads.test:8443/**",
    ]


def test_a_name_that_never_resolved_is_listed_not_suggested() -> None:
    """Issue 29: a typo the run tried (pypi.orgg) came back as an allowlist entry."""
    records = [START, _egress("pypi.org", learned="not_allowlisted"),
               _egress("pypi.orgg", decision="deny", reason="resolve_failed")]  # fmt: skip
    text = render(suggest(records))
    assert tomllib.loads(text)["allow"] == ["pypi.org"]
    assert "pypi.orgg (resolve_failed)" in text
