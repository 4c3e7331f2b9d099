"""Approval scopes, the pure parts: the lasting entry, the terminal's words, the ledger, the record."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressd.approvals.interface import (
    AnswerResult,
    ApprovalRequest,
    ApprovalScope,
    Choice,
    Settlement,
    parse_scope,
    settled_text,
)
from egressd.approvals.ledger import Ledger
from egressd.approvals.prompt import allowed_text, choices, read_answer
from egressd.audit.approvalrecords import approval_decided_record
from egressd.proxy.core.policy import EntryError, RunPolicy, Verdict, decide, lasting_entry, parse_entry
from egressd.vocabulary.reasons import Answer

ALL = (ApprovalScope.ONCE, ApprovalScope.RUN, ApprovalScope.ALWAYS)
NO_FILE = (ApprovalScope.ONCE, ApprovalScope.RUN)


# -- the lasting entry ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "entry"),
    [
        ("api.github.com", 443, "api.github.com:443"),
        ("xn--bcher-kva.example", 8443, "xn--bcher-kva.example:8443"),
        ("bucket.s3.amazonaws.com", 443, "bucket.s3.amazonaws.com:443"),  # under a public suffix: itself, exactly
        ("203.0.113.7", 80, "203.0.113.7:80"),
        ("2001:db8::1", 443, "[2001:db8::1]:443"),
    ],
)
def test_the_lasting_entry_is_the_exact_host_on_its_port(host: str, port: int, entry: str) -> None:
    assert lasting_entry(host, port) == entry
    parsed = parse_entry(entry)
    assert not parsed.wildcard and parsed.ports == frozenset({port})


@pytest.mark.parametrize(("host", "port"), [("*.example.com", 443), ("", 443), ("a..b", 443)])
def test_an_entry_the_policy_refuses_or_reads_otherwise_is_refused(host: str, port: int) -> None:
    with pytest.raises(EntryError):
        lasting_entry(host, port)


labels = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)


@given(names=st.lists(labels, min_size=2, max_size=4), port=st.integers(1, 65535))
def test_a_kept_entry_allows_its_host_on_its_port_and_nothing_else(names: list[str], port: int) -> None:
    host = ".".join(names)
    try:
        entry = lasting_entry(host, port)
    except EntryError:
        return
    policy = RunPolicy(allow=(parse_entry(entry),), deny=())
    assert decide(policy, host, port).verdict is Verdict.ALLOW
    assert decide(policy, "x." + host, port).verdict is not Verdict.ALLOW  # no wildcard invented
    assert decide(policy, host, port % 65535 + 1).verdict is not Verdict.ALLOW


# -- what a person answers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "scopes", "read"),
    [
        ("allow", NO_FILE, (Choice.ALLOW, ApprovalScope.RUN)),
        (" ALLOW ", NO_FILE, (Choice.ALLOW, ApprovalScope.RUN)),
        ("once", NO_FILE, (Choice.ALLOW, ApprovalScope.ONCE)),
        ("always", ALL, (Choice.ALLOW, ApprovalScope.ALWAYS)),
        ("Always", ALL, (Choice.ALLOW, ApprovalScope.ALWAYS)),
        ("always", NO_FILE, None),  # not offered: not an answer, the prompt asks again
        ("", ALL, (Choice.DENY, ApprovalScope.RUN)),
        ("n", ALL, (Choice.DENY, ApprovalScope.RUN)),
        ("y", ALL, None),  # no single key allows
        ("a", ALL, None),
        ("A", ALL, None),
        ("o", ALL, None),
        ("alway", ALL, None),
    ],
)
def test_the_terminal_reads_whole_words(
    typed: str, scopes: tuple[ApprovalScope, ...], read: tuple[Choice, ApprovalScope] | None
) -> None:
    assert read_answer(typed, scopes) == read


def test_the_choices_line_names_always_only_when_it_is_offered() -> None:
    assert choices(NO_FILE) == "Answer once (this connection only), allow (this run) or deny."
    assert choices(ALL) == (
        "Answer once (this connection only), allow (this run), always (added to the allow file) or deny."
    )


def test_the_closing_line_says_how_far_the_allow_reaches() -> None:
    def allow(**more: object) -> Settlement:
        return Settlement(Answer.ALLOW, "terminal", "alice", 0.0, 1.0, **more)  # type: ignore[arg-type]

    assert allowed_text(allow(scope=ApprovalScope.ONCE)).startswith("allowed for this connection only")
    assert allowed_text(allow(scope=ApprovalScope.RUN)) == "allowed for this run"
    assert allowed_text(allow(scope=ApprovalScope.ALWAYS, entry="a.example:443")) == (
        "allowed always: a.example:443 added to the allow file"
    )
    said = allowed_text(allow(scope=ApprovalScope.RUN, scope_error="disk full\x1b[2J"))
    assert said.startswith("allowed for this run only, not always: disk full") and "\x1b" not in said
    assert settled_text(allow(scope=ApprovalScope.ONCE)) == "allowed (once) by alice via terminal"
    assert settled_text(allow(scope=ApprovalScope.RUN)) == "allowed by alice via terminal"


@pytest.mark.parametrize("value", ["once", "run", "always"])
def test_the_three_scopes_parse(value: str) -> None:
    scope = parse_scope(value)
    assert scope is not None and scope.value == value


@given(st.one_of(st.text(), st.integers(), st.none(), st.lists(st.text()), st.booleans()))
def test_anything_else_is_no_scope(value: object) -> None:
    if value not in ("once", "run", "always"):
        assert parse_scope(value) is None


# -- the ledger and the record -------------------------------------------------------------------


def req() -> ApprovalRequest:
    return ApprovalRequest(run_id="r-1", host="evil.example", port=443, command=None, task=None, allowed=())


@pytest.mark.parametrize("scope", list(ApprovalScope))
def test_an_allow_settles_with_its_scope_and_a_denial_with_none(scope: ApprovalScope) -> None:
    ledger = Ledger(max_pending_per_run=5)
    ledger.open(req(), approval_id="a-1", channels=("x",), now=0.0)
    answered = ledger.answer("a-1", Choice.ALLOW, channel="x", by="alice", now=2.0, scope=scope)
    assert answered.result is AnswerResult.ACCEPTED and answered.settlement is not None
    assert answered.settlement.scope is scope
    ledger.open(req(), approval_id="a-2", channels=("x",), now=3.0)
    denied = ledger.answer("a-2", Choice.DENY, channel="x", by="alice", now=4.0, scope=scope)
    assert denied.settlement is not None and denied.settlement.scope is None


def test_the_decided_record_keeps_the_design_keys_in_order_and_adds_the_scope_after() -> None:
    record = approval_decided_record(
        id="a-1",
        ts=0.0,
        decision="allow",
        reason=None,
        channel="slack",
        by="@alice (U0ALICE)",
        waited_s=1.5,
        run="r-1",
        scope="always",
        entry="api.github.com:443",
    )
    assert list(record) == [
        "event", "id", "ts", "run", "decision", "reason", "channel", "by", "waited_s", "scope", "entry", "scope_error"
    ]  # fmt: skip
    assert (record["scope"], record["entry"], record["scope_error"]) == ("always", "api.github.com:443", None)
