"""The reason table: one row per refusal reason, and no module keeps a table of its own.

It is complete against DESIGN.md's list, and what each listener sends for a
reason is pinned byte for byte as it was before the table (the forward proxy,
the Host and SNI listeners, a CONNECT tunnel's SNI check, the DNS server, and
the line ``egressd run`` prints).
"""

from __future__ import annotations

import ast
import asyncio
import re
import socket
import struct
from http import HTTPStatus
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from egressd.approvals.interface import ANSWER_REASONS, Answer
from egressd.audit.views import EgressSeen
from egressd.cli.commands.run import refusal_line
from egressd.proxy.core.clienthello import Alert, tls_alert
from egressd.proxy.core.dnsanswer import UNREACHABLE, refused
from egressd.proxy.core.reasons import Rcode, Reason, reason_for, reason_message
from egressd.proxy.core.responses import tls_refusal
from tests import REPO
from tests.conftest import Listener
from tests.fakes import hellos
from tests.harness import connect_via, egress, wait_until

ROOT = REPO
TABLE = ROOT / "proxy" / "core" / "reasons.py"
# Where a reason code or a table of reasons could hide: every package.
SCANNED = ("names", "proxy", "audit", "approvals", "cli", "sandbox", "agent", "config")
# approvals sits below the proxy, so it cannot import the table: it names the
# code each failed answer becomes in ``ANSWER_REASONS`` (checked below), and
# its ``Answer`` values share some of the words.
SPELLS_ITS_OWN = ROOT / "approvals" / "interface.py"
CODES = frozenset(reason.value for reason in Reason)
# The same word meaning something else: (module, word).
NOT_A_REASON = {
    ("proxy/core/runs.py", "denied"),  # the control API's list of a run's denied destinations
    ("approvals/message.py", "denied"),  # "denied by NAME via CHANNEL"
    ("approvals/slack.py", "denied"),  # the word a settled message ends with
    ("cli/commands/agent.py", "denied"),  # the tally's heading
    ("cli/commands/approvals.py", "denied"),  # "denied by NAME"
    ("cli/main.py", "approval_timeout"),  # the --approval-timeout setting's name
}
# DESIGN.md "What a client sees", in its order, then egressd's additions
# (audit_unavailable: DESIGN.md names it with shutting_down, after the list;
# unsupported_query: a DNS query of a type egressd does not answer;
# empty_answer: an AAAA query answered with no address, recorded deny as DESIGN.md says).
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
    assert {answer: reason_for(code) for answer, code in ANSWER_REASONS.items()} == {
        Answer.DENY: Reason.DENIED,
        Answer.TIMEOUT: Reason.APPROVAL_TIMEOUT,
        Answer.NO_APPROVER: Reason.NO_APPROVER,
        Answer.TOO_MANY_PENDING: Reason.TOO_MANY_PENDING,
        Answer.STOPPED_ASKING: Reason.NOT_ALLOWLISTED,
        Answer.SHUTTING_DOWN: Reason.SHUTTING_DOWN,
    }


def _modules() -> list[Path]:
    return sorted(p for package in SCANNED for p in (ROOT / package).rglob("*.py") if p not in (TABLE, SPELLS_ITS_OWN))


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
                found.append(f"{where}: the code {node.value!r}; use Reason (below the proxy: ANSWER_REASONS)")
            elif isinstance(node, ast.Dict | ast.Set | ast.List | ast.Tuple) and _reason_members(node) > 1:
                found.append(f"{where}: a table of reasons; give Reason a column instead")
    assert found == []


def test_the_scan_sees_a_spelled_code_and_a_table(tmp_path: Path) -> None:
    module = "A = 'upstream_timeout'\nB = {Reason.DENIED: 1, Reason.DENIED_EARLIER: 2}\n"
    tree = ast.parse(module)
    assert [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in CODES] == ["upstream_timeout"]
    assert [_reason_members(n) for n in ast.walk(tree) if isinstance(n, ast.Dict)] == [2]
    assert len(_modules()) > 20  # the scan reads the tree, not nothing


# --- what each listener sends for a few reasons, byte for byte (as before the table) ---------------


async def _exchange(address: tuple[str, int], data: bytes, source: str = "127.0.0.1") -> bytes:
    """Send ``data`` and read until egressd closes."""
    reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def _record(svc: Any, count: int) -> dict[str, Any]:
    """The ``count``-th finished attempt's record (the last one)."""
    await wait_until(lambda: len(egress(svc)) >= count)
    return egress(svc)[count - 1]


def _http(status: str, code: str, body: str, *, auth: bool = False, retry: bool = False) -> bytes:
    """The refusal a listener sent before this table, its request id left as ``{id}``."""
    payload = body.encode() + b"\n"
    head = f"HTTP/1.1 {status}\r\nX-Egress-Decision: deny\r\nX-Egress-Reason: {code}\r\nX-Egress-Request-Id: {{id}}\r\n"
    if auth:
        head += 'Proxy-Authenticate: Basic realm="egressd"\r\n'
    if retry:
        head += "Retry-After: 1\r\n"
    head += f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    return head.encode() + payload


def _with_id(raw: bytes, record: dict[str, Any]) -> bytes:
    """``raw`` with the request id, which must be the record's, as ``{id}``."""
    found = re.search(rb"\r\nX-Egress-Request-Id: ([^\r]*)\r\n", raw)
    assert found is not None and found.group(1).decode() == record["id"], raw
    return raw.replace(found.group(1), b"{id}", 1)


async def test_the_forward_proxy_refuses_as_before(make_egressd, echo_origin: Listener) -> None:
    svc = await make_egressd(allow=["origin.test:*"], ask=False, max_connections_per_run=1)
    address = svc.proxy_address
    raw = await _exchange(address, b"CONNECT leak.test:443 HTTP/1.1\r\nHost: leak.test:443\r\n\r\n")
    record = await _record(svc, 1)
    assert _with_id(raw, record) == _http(
        "403 Forbidden", "not_allowlisted", "egressd: blocked leak.test:443 (not on the allowlist) in run default"
    )
    assert (record["decision"], record["reason"], record.get("detail")) == ("deny", "not_allowlisted", None)

    raw = await _exchange(address, b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    record = await _record(svc, 2)
    assert _with_id(raw, record) == _http("400 Bad Request", "bad_request", "egressd: blocked - (malformed request)")
    assert (record["decision"], record["reason"]) == ("deny", "bad_request") and record["detail"]

    # The run's one connection is a tunnel; the next is over its cap.
    held = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert held[0] == 200
    raw = await _exchange(address, f"CONNECT origin.test:{echo_origin.port} HTTP/1.1\r\n\r\n".encode())
    held[4].close()
    record = await _record(svc, 3)
    body = f"egressd: blocked origin.test:{echo_origin.port} (a limit was exceeded) in run default"
    assert _with_id(raw, record) == _http("429 Too Many Requests", "limit_exceeded", body, retry=True)
    assert (record["decision"], record["reason"]) == ("deny", "limit_exceeded")


async def test_the_forward_proxy_asks_for_credentials_as_before(make_egressd) -> None:
    svc = await make_egressd(require_auth=True)
    raw = await _exchange(svc.proxy_address, b"GET http://origin.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n")
    record = await _record(svc, 1)
    expected = _http(
        "407 Proxy Authentication Required",
        "auth_required",
        "egressd: blocked origin.test:80 (run credentials missing or wrong)",
        auth=True,
    )
    assert _with_id(raw, record) == expected
    assert (record["decision"], record["reason"], record["run"]) == ("deny", "auth_required", None)


async def test_the_host_listener_refuses_as_before(make_egressd) -> None:
    svc = await make_egressd(transparent_http="127.0.0.1:0", require_auth=True)
    svc.runs.create(task="t", allow=[], sources=[ip_address("127.0.0.5")])  # no approver to ask
    address = svc.transparent_http.address
    raw = await _exchange(address, b"GET / HTTP/1.1\r\nHost: leak.test\r\n\r\n", source="127.0.0.5")
    record = await _record(svc, 1)
    body = f"egressd: blocked leak.test:80 (no approver attached) in run {record['run']}"
    expected = _http("403 Forbidden", "no_approver", body)
    assert _with_id(raw, record) == expected
    # No proxy to authenticate to: an unbound source gets a plain 403, not a 407.
    raw = await _exchange(address, b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n", source="127.0.0.6")
    record = await _record(svc, 2)
    body = "egressd: blocked origin.test:80 (run credentials missing or wrong)"
    expected = _http("403 Forbidden", "auth_required", body)
    assert _with_id(raw, record) == expected
    assert (record["decision"], record["reason"], record["run"]) == ("deny", "auth_required", None)


MALFORMED_HELLO = hellos.record(hellos.handshake(hellos.body(session_id=bytes(40))))  # legacy_session_id too long


@pytest.mark.parametrize(
    ("data", "answer", "reason"),
    [
        (hellos.client_hello("leak.test"), b"\x15\x03\x03\x00\x02\x02\x31", "not_allowlisted"),  # access_denied
        (hellos.client_hello(None), b"\x15\x03\x03\x00\x02\x02\x6d", "bad_request"),  # missing_extension
        (MALFORMED_HELLO, b"\x15\x03\x03\x00\x02\x02\x32", "bad_request"),  # decode_error
        (b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n", b"", "bad_request"),  # not TLS: nothing
    ],
    ids=["policy", "no server_name", "malformed", "not TLS"],
)
async def test_the_sni_listener_refuses_as_before(make_egressd, data: bytes, answer: bytes, reason: str) -> None:
    svc = await make_egressd(transparent_tls="127.0.0.1:0", allow=["origin.test"], ask=False)
    assert await _exchange(svc.transparent_tls.address, data) == answer
    record = await _record(svc, 1)
    assert (record["kind"], record["decision"], record["reason"]) == ("tls", "deny", reason)


async def test_a_tunnel_with_another_name_is_refused_as_before(make_egressd, echo_origin: Listener) -> None:
    svc = await make_egressd(allow=["origin.test:*", "other.test:*"], ask=False)
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200
    writer.write(hellos.client_hello("other.test"))
    assert await asyncio.wait_for(reader.read(), 5) == b"\x15\x03\x03\x00\x02\x02\x31"  # access_denied
    writer.close()
    record = await _record(svc, 1)
    assert (record["decision"], record["reason"], record["sni"]) == ("deny", "sni_mismatch", "other.test")


def _dns_exchange(address: tuple[str, int], packet: bytes, source: str) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((source, 0))
        sock.settimeout(3)
        sock.sendto(packet, address)
        return sock.recv(65535)


def _dns_query(labels: list[bytes]) -> bytes:
    """Id 0x1234, RD set, one IN A question for ``labels``."""
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)


@pytest.mark.parametrize(
    ("labels", "source", "flags", "reason"),
    [
        ([b"10", b"1", b"2", b"3"], "127.0.0.5", 0x8183, "ip_literal"),  # NXDOMAIN
        ([b"a\x00b", b"test"], "127.0.0.5", 0x8181, "bad_request"),  # FORMERR
        ([b"origin", b"test"], "127.0.0.6", 0x8185, "auth_required"),  # REFUSED
    ],
    ids=["NXDOMAIN", "FORMERR", "REFUSED"],
)
async def test_the_dns_server_refuses_as_before(
    make_egressd, labels: list[bytes], source: str, flags: int, reason: str
) -> None:
    svc = await make_egressd(dns_listen="127.0.0.1:0", dns_strict=True, require_auth=True)
    svc.runs.create(task="t", allow=[], sources=[ip_address("127.0.0.5")])
    packet = _dns_query(labels)
    reply = await asyncio.to_thread(_dns_exchange, svc.dns.address, packet, source)
    # The id, QR|RD|RA and the rcode, one question and no records; the question as asked.
    assert reply == struct.pack("!HHHHHH", 0x1234, flags, 1, 0, 0, 0) + packet[12:]
    record = await _record(svc, 1)
    assert (record["kind"], record["decision"], record["reason"]) == ("dns", "deny", reason)


def test_the_cli_tells_of_a_refusal_as_before() -> None:
    record = {"decision": "deny", "host": "evil.example", "port": 443, "reason": "denied", "kind": "connect"}
    assert refusal_line(EgressSeen.of(record)) == "egressd: blocked evil.example:443 (denied by approver)\n"
    dns = {"decision": "deny", "host": "bad.test", "port": None, "reason": "denylisted", "kind": "dns"}
    assert refusal_line(EgressSeen.of(dns)) == "egressd: blocked bad.test (dns) (on the denylist)\n"
    unknown = {"decision": "deny", "host": "x.test", "port": 80, "reason": "some_future_code"}
    assert refusal_line(EgressSeen.of(unknown)) == "egressd: blocked x.test:80 (some_future_code)\n"


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
