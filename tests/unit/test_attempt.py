"""An attempt's three stages: what was asked, what was decided (once), what happened (first cause stays)."""

from __future__ import annotations

import ipaddress

import pytest

from egressd.proxy.core.attempt import Admission, Attempt, Seen
from egressd.vocabulary.egress import Decision, EgressKind, End
from egressd.vocabulary.reasons import Reason

ASKED = Seen(id="req-1", kind=EgressKind.CONNECT, client="127.0.0.1:5555", ts=1.0, started=0.0,
             host="Example.COM", port=443, command="curl")
ALLOWED = Admission(None, "example.com", 443, (ipaddress.ip_address("127.0.0.9"),), ("127.0.0.9",), rule="example.com")
REFUSED = Admission(Reason.PRIVATE_ADDRESS, "example.com", 443, rule="example.com", address="127.0.1.5",
                    detail="every address is private")


def test_before_the_decision_it_is_what_was_asked_and_refused_by_default() -> None:
    attempt = Attempt(ASKED)
    assert (attempt.id, attempt.kind, attempt.host, attempt.port, attempt.command) == (
        "req-1", EgressKind.CONNECT, "Example.COM", 443, "curl")
    assert (attempt.decided, attempt.decision, attempt.reason, attempt.rule) == (False, Decision.DENY, None, None)


def test_the_decision_is_written_once() -> None:
    attempt = Attempt(ASKED)
    attempt.conclude(ALLOWED)
    assert (attempt.decision, attempt.reason, attempt.rule, attempt.host) == (
        Decision.ALLOW, None, "example.com", "example.com")
    with pytest.raises(ValueError, match="decided already"):
        attempt.conclude(REFUSED)
    assert attempt.decision is Decision.ALLOW


def test_a_refusal_names_the_address_it_concerned_and_its_detail() -> None:
    attempt = Attempt(ASKED)
    attempt.conclude(REFUSED)
    assert (attempt.decision, attempt.reason, attempt.recorded_address) == (
        Decision.DENY, Reason.PRIVATE_ADDRESS, "127.0.1.5")
    assert attempt.notes() == {"detail": "every address is private"}
    attempt.deny(Reason.PRIVATE_ADDRESS, "said again")
    assert (attempt.cut, attempt.detail) == (None, "every address is private")


def test_what_happens_after_an_allow_cuts_it_and_the_first_cause_stays() -> None:
    attempt = Attempt(ASKED)
    attempt.conclude(ALLOWED)
    attempt.deny(Reason.SNI_MISMATCH, "the ClientHello named another server")
    attempt.deny(Reason.UPSTREAM_TIMEOUT, "later")
    assert (attempt.decision, attempt.reason, attempt.rule) == (Decision.DENY, Reason.SNI_MISMATCH, "example.com")
    assert attempt.detail == "the ClientHello named another server"
    attempt.ends(End.IDLE_TIMEOUT)
    attempt.ends(End.CLOSED)
    assert attempt.end is End.IDLE_TIMEOUT


def test_learn_mode_is_read_from_the_decision_and_noted_first() -> None:
    attempt = Attempt(ASKED)
    attempt.conclude(ALLOWED._replace(rule=None, learned=Reason.NOT_ALLOWLISTED))
    attempt.status = 200
    assert attempt.notes() == {"learned": "not_allowlisted", "status": 200}
    assert attempt.notes(learned=False) == {"status": 200}
