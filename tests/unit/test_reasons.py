"""The reason table: one row per refusal reason, and no module keeps a table of its own.

It is complete against DESIGN.md's list, and what each listener sends for a
reason is pinned byte for byte as it was before the table (the forward proxy,
the Host and SNI listeners, a CONNECT tunnel's SNI check, the DNS server, and
the line ``egressd run`` prints).
"""

from __future__ import annotations

import ast
import re
from http import HTTPStatus
from pathlib import Path

import pytest

from egressd.audit.views import EgressSeen
from egressd.cli.commands.run import refusal_line
from egressd.proxy.core.clienthello import tls_alert
from egressd.proxy.core.dnsanswer import UNREACHABLE, refused
from egressd.proxy.core.responses import tls_refusal
from egressd.vocabulary.egress import End
from egressd.vocabulary.reasons import ANSWER_REASONS, Answer, Reason, reason_for, reason_message
from egressd.vocabulary.wire import Alert, Rcode
from tests import REPO

ROOT = REPO
TABLE = ROOT / "vocabulary" / "reasons.py"
END_TABLE = ROOT / "vocabulary" / "egress.py"
# Where a reason code or a table of reasons could hide: every package.
SCANNED = ("names", "vocabulary", "proxy", "control", "audit", "approvals", "cli", "sandbox", "agent", "config")
CODES = frozenset(reason.value for reason in Reason)
# How an allowed connection ended: the same rule (End).
END_CODES = frozenset(end.value for end in End)
# The same word meaning something else: (module, word).
NOT_A_REASON = {
    ("proxy/core/runs.py", "denied"),  # the control API's list of a run's denied destinations
    ("approvals/message.py", "denied"),  # "denied by NAME via CHANNEL"
    ("approvals/slackblocks.py", "denied"),  # the word a settled message ends with
    ("cli/commands/agent.py", "denied"),  # the tally's heading
    ("cli/commands/approvals.py", "denied"),  # "denied by NAME"
    ("cli/flags.py", "approval_timeout"),  # the --approval-timeout setting's name
    ("approvals/interface.py", "denied"),  # "denied by NAME via CHANNEL"
    ("proxy/net/stream.py", "closed"),  # a slot's name
    ("proxy/core/exchange.py", "closed"),  # the exchange's state: it carries no more requests
}
# DESIGN.md "What a client sees", in its order, then egressd's additions
# (audit_unavailable: DESIGN.md names it with shutting_down, after the list;
# unsupported_query: a DNS query of a type egressd does not answer;
# empty_answer: an AAAA query answered with no address, recorded deny as DESIGN.md says).
# tls_intercept_failed, secret_misdirected: inspection's, named in DESIGN.md "Policy" (request rules) and the issue.
DESIGN_REASONS = (
    "denylisted",
    "not_allowlisted",
    "denied",
    "approval_timeout",
    "no_approver",
    "denied_earlier",
    "too_many_pending",
    "ip_literal",
    "private_address",
    "port_not_allowed",
    "sni_mismatch",
    "bad_request",
    "auth_required",
    "resolve_failed",
    "upstream_unreachable",
    "upstream_timeout",
    "limit_exceeded",
    "audit_unavailable",
    "shutting_down",
    "unsupported_query",
    "empty_answer",
    "tls_intercept_failed",
    "secret_misdirected",
)
# DESIGN.md's statuses: 403 unless it says otherwise.
DESIGN_STATUSES = {
    "bad_request": 400,
    "auth_required": 407,
    "resolve_failed": 502,
    "upstream_unreachable": 502,
    "upstream_timeout": 504,
    "limit_exceeded": 429,
    "audit_unavailable": 503,
    "shutting_down": 503,
    "unsupported_query": 400,
    "empty_answer": 400,
    "tls_intercept_failed": 502,
}


def test_the_table_is_designs_list_of_reasons_in_its_order() -> None:
    assert tuple(reason.value for reason in Reason) == DESIGN_REASONS
    assert {reason.value: reason.status for reason in Reason} == {
        code: DESIGN_STATUSES.get(code, 403) for code in DESIGN_REASONS
    }


def test_every_reason_has_a_code_a_status_a_message_and_an_alert() -> None:
    for reason in Reason:
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", reason.value), reason
        assert 400 <= reason.status <= 599 and HTTPStatus(reason.status), reason
        assert reason.message and reason.message.isascii() and reason.message.isprintable(), reason
        assert isinstance(reason.alert, Alert), reason


def test_a_policy_refusal_is_access_denied_and_anything_else_internal_error() -> None:
    # RFC 8446 §6.2: what the transparent TLS listener and a tunnel's SNI check send.
    for reason in Reason:
        expected = Alert.ACCESS_DENIED if reason.status in (403, 407) else Alert.INTERNAL_ERROR
        assert reason.alert is expected, reason


def test_tls_refusal_is_the_reasons_alert_unless_the_caller_knows_better() -> None:
    assert tls_refusal(Reason.DENIED) == tls_alert(Alert.ACCESS_DENIED) == b"\x15\x03\x03\x00\x02\x02\x31"
    assert tls_refusal(Reason.UPSTREAM_TIMEOUT) == tls_alert(Alert.INTERNAL_ERROR)
    assert tls_refusal(Reason.BAD_REQUEST, Alert.DECODE_ERROR) == tls_alert(Alert.DECODE_ERROR)


@pytest.mark.parametrize(
    ("reason", "rcode"),
    [
        (Reason.BAD_REQUEST, Rcode.FORMERR),
        (Reason.AUTH_REQUIRED, Rcode.REFUSED),
        (Reason.AUDIT_UNAVAILABLE, Rcode.REFUSED),
        (Reason.UNSUPPORTED_QUERY, Rcode.REFUSED),
        (Reason.DENYLISTED, Rcode.NXDOMAIN),
        (Reason.IP_LITERAL, Rcode.NXDOMAIN),
        (Reason.DENIED_EARLIER, Rcode.NXDOMAIN),
        (Reason.NOT_ALLOWLISTED, Rcode.NXDOMAIN),
    ],
)
def test_every_reason_the_dns_server_gives_has_its_rcode(reason: Reason, rcode: Rcode) -> None:
    plan = refused(reason)
    assert (plan.rcode, plan.reason, plan.address) == (rcode, reason, None)


def test_strict_mode_answers_nxdomain_for_exactly_the_reasons_that_hold_for_every_port() -> None:
    assert UNREACHABLE == {Reason.DENYLISTED, Reason.IP_LITERAL, Reason.DENIED_EARLIER, Reason.NOT_ALLOWLISTED}


def test_a_reason_no_dns_answer_carries_is_not_turned_into_one() -> None:
    for reason in Reason:
        if reason.rcode is None:
            with pytest.raises(ValueError):
                refused(reason)


def test_codes_read_back_from_records_find_their_reason() -> None:
    assert reason_for("denied") is Reason.DENIED
    assert reason_message("denied") == "denied by approver"
    assert reason_message("no_such_reason") == "no_such_reason"
    with pytest.raises(ValueError):
        reason_for("no_such_reason")


def test_every_failed_approval_answer_names_a_reason() -> None:
    assert dict(ANSWER_REASONS) == {
        Answer.DENY: Reason.DENIED,
        Answer.TIMEOUT: Reason.APPROVAL_TIMEOUT,
        Answer.NO_APPROVER: Reason.NO_APPROVER,
        Answer.TOO_MANY_PENDING: Reason.TOO_MANY_PENDING,
        Answer.STOPPED_ASKING: Reason.NOT_ALLOWLISTED,
        Answer.SHUTTING_DOWN: Reason.SHUTTING_DOWN,
    }


def _modules() -> list[Path]:
    return sorted(p for package in SCANNED for p in (ROOT / package).rglob("*.py") if p not in (TABLE, END_TABLE))


def _reason_members(node: ast.AST) -> int:
    return sum(
        1
        for child in ast.walk(node)
        if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "Reason"
    )


def test_no_other_module_spells_a_reason_or_end_code_or_keeps_a_table_of_reasons() -> None:
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value in CODES | END_CODES:
                if (path.relative_to(ROOT).as_posix(), node.value) in NOT_A_REASON:
                    continue
                found.append(f"{where}: the code {node.value!r}; use {'Reason' if node.value in CODES else 'End'}")
            elif isinstance(node, ast.Dict | ast.Set | ast.List | ast.Tuple) and _reason_members(node) > 1:
                found.append(f"{where}: a table of reasons; give Reason a column instead")
    assert found == []


def test_the_scan_sees_a_spelled_code_and_a_table(tmp_path: Path) -> None:
    module = "A = 'upstream_timeout'\nB = {Reason.DENIED: 1, Reason.DENIED_EARLIER: 2}\nC = 'idle_timeout'\n"
    tree = ast.parse(module)
    spelled = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in CODES | END_CODES]
    assert spelled == ["upstream_timeout", "idle_timeout"]
    assert [_reason_members(n) for n in ast.walk(tree) if isinstance(n, ast.Dict)] == [2]
    assert len(_modules()) > 20  # the scan reads the tree, not nothing


# --- what the CLI prints (what each listener sends: tests/integration/proxy/test_reasons_on_the_wire.py) ---


def test_the_cli_tells_of_a_refusal_as_before() -> None:
    record = {"decision": "deny", "host": "evil.example", "port": 443, "reason": "denied", "kind": "connect"}
    assert refusal_line(EgressSeen.of(record)) == "egressd: blocked evil.example:443 (denied by approver)\n"
    dns = {"decision": "deny", "host": "bad.test", "port": None, "reason": "denylisted", "kind": "dns"}
    assert refusal_line(EgressSeen.of(dns)) == "egressd: blocked bad.test (dns) (on the denylist)\n"
    unknown = {"decision": "deny", "host": "x.test", "port": 80, "reason": "some_future_code"}
    assert refusal_line(EgressSeen.of(unknown)) == "egressd: blocked x.test:80 (some_future_code)\n"
    private = {"decision": "deny", "host": "db.corp", "port": 5432, "reason": "private_address",
               "address": "10.1.2.3"}  # fmt: skip
    said = "resolves only to private or special addresses: 10.1.2.3, if it is yours: --allow-private 10.1.2.3/32"
    assert refusal_line(EgressSeen.of(private)) == f"egressd: blocked db.corp:5432 ({said})\n"


def test_the_cli_is_silent_about_dns_answered_as_designed() -> None:
    # Issue 16: ``egressd run`` printed "egressd: blocked NAME (dns) ()" for every lookup.
    base = {"kind": "dns", "host": "ok.test", "port": None}
    aaaa = {**base, "decision": "allow", "reason": None, "qtype": "AAAA", "answer": "NOERROR"}
    https = {**base, "decision": "deny", "reason": "unsupported_query", "qtype": "HTTPS", "answer": "REFUSED"}
    old_aaaa = {**base, "decision": "deny", "reason": None, "qtype": "AAAA", "answer": "NOERROR"}
    for record in (aaaa, https, old_aaaa):
        assert refusal_line(EgressSeen.of(record)) is None, record
        assert not EgressSeen.of(record).is_refusal
    strict = {**base, "decision": "deny", "reason": "not_allowlisted", "qtype": "AAAA", "answer": "NXDOMAIN"}
    assert refusal_line(EgressSeen.of(strict)) == "egressd: blocked ok.test (dns) (not on the allowlist)\n"
