"""The reason table: one row per refusal reason, and no module keeps a table of its own."""

from __future__ import annotations

import ast
import re
from http import HTTPStatus
from pathlib import Path

import pytest

from approvals.interface import ANSWER_REASONS
from proxy.clienthello import Alert, tls_alert
from proxy.dnsserver import UNREACHABLE, refused
from proxy.reasons import Rcode, Reason, reason_for, reason_message
from proxy.responses import tls_refusal

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "proxy" / "reasons.py"
# Where a reason code or a table of reasons could hide: the proxy, and the audit
# log it writes (approvals sits below the proxy and names its codes in
# ``ANSWER_REASONS``, checked below; cli only reads codes back).
SCANNED = ("proxy", "audit")
CODES = frozenset(reason.value for reason in Reason)
# The same word meaning something else: (module, word).
NOT_A_REASON = {("proxy/runs.py", "denied")}  # the control API's list of a run's denied destinations


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
    assert set(ANSWER_REASONS.values()) <= CODES


def _modules() -> list[Path]:
    return sorted(p for package in SCANNED for p in (ROOT / package).rglob("*.py") if p != TABLE)


def _reason_members(node: ast.AST) -> int:
    return sum(
        1
        for child in ast.walk(node)
        if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "Reason"
    )


def test_no_other_module_spells_a_reason_code_or_keeps_a_table_of_reasons() -> None:
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value in CODES:
                if (path.relative_to(ROOT).as_posix(), node.value) in NOT_A_REASON:
                    continue
                found.append(f"{where}: the code {node.value!r}; use Reason")
            elif isinstance(node, ast.Dict | ast.Set | ast.List | ast.Tuple) and _reason_members(node) > 1:
                found.append(f"{where}: a table of reasons; give Reason a column instead")
    assert found == []


def test_the_scan_sees_a_spelled_code_and_a_table(tmp_path: Path) -> None:
    module = "A = 'upstream_timeout'\nB = {Reason.DENIED: 1, Reason.DENIED_EARLIER: 2}\n"
    tree = ast.parse(module)
    assert [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in CODES] == ["upstream_timeout"]
    assert [_reason_members(n) for n in ast.walk(tree) if isinstance(n, ast.Dict)] == [2]
    assert len(_modules()) > 20  # the scan reads the tree, not nothing
