"""Learn mode (--learn), as attacks: what the allowlist alone would refuse goes out and is recorded as
``learned``; a deny entry, an IP literal and a private address are still refused, and nothing reaches them."""

from __future__ import annotations

import asyncio
import json
import os
import tomllib

import pytest
from dnslib import RCODE

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest
from egressd.audit.log import MemoryAuditSink
from egressd.audit.records import EGRESS_FIELDS
from egressd.cli.wiring.service import EgressService
from egressd.config.settings import load_settings
from egressd.proxy.core.suggest import render, suggest
from egressd.vocabulary.reasons import Answer
from tests.fakes.dns import FakeDns
from tests.harness import LEAK, ORIGIN, ORIGIN_RANGE, connect_via, egress, open_proxy, read_response, wait_until
from tests.integration.proxy.test_dnsserver import ask, dns_records


def _raw_egress(svc) -> list[dict]:
    """The records as written (the write-ahead ``egress`` record of an allowed connection, not joined)."""
    return [r for r in svc.audit_records if r.get("event") == "egress"]


async def test_an_unlisted_host_goes_out_and_its_record_says_what_it_would_have_been(make_egressd, echo_origin) -> None:
    svc = await make_egressd(learn=True)
    status, headers, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200 and "x-egress-decision" not in headers
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    writer.close()
    await wait_until(lambda: egress(svc))
    ahead = _raw_egress(svc)[-1]  # written before the dial: it already says learned
    assert list(ahead)[: len(EGRESS_FIELDS)] == list(EGRESS_FIELDS)  # the design's keys first, in order
    assert list(ahead)[len(EGRESS_FIELDS)] == "learned"
    assert (ahead["decision"], ahead["reason"], ahead["rule"], ahead["learned"]) == (
        "allow",
        None,
        None,
        "not_allowlisted",
    )
    assert echo_origin.connections == 1
    start = next(r for r in svc.audit_records if r["event"] == "run.start")
    assert start["learn"] is True
    assert svc.path.recorder.metrics.learned == 1


class _Recording:
    """An approver that would hold every request until the test ends, and notes each question."""

    def __init__(self) -> None:
        self.asked: list[ApprovalRequest] = []

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        self.asked.append(request)
        await asyncio.sleep(3600)
        return ApprovalOutcome(Answer.DENY)


async def test_learn_mode_never_holds_a_request_for_approval(make_egressd, http_origin) -> None:
    approver = _Recording()
    svc = await make_egressd(learn=True, approver=approver)
    reader, writer = await open_proxy(svc)
    writer.write(f"GET http://origin.test:{http_origin.port}/x HTTP/1.1\r\n\r\n".encode())
    status, _, body = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert status == 200 and body.endswith(b"GET /x 0")
    record = egress(svc)[-1]
    assert (record["kind"], record["decision"], record["learned"]) == ("http", "allow", "not_allowlisted")
    assert approver.asked == []


async def test_a_port_the_allowlist_does_not_allow_is_learned_too(make_egressd, echo_origin) -> None:
    svc = await make_egressd(learn=True, allow=["origin.test"], ask=False)  # 80 and 443 only
    status, _, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    writer.close()
    assert status == 200
    await wait_until(lambda: egress(svc))
    assert (egress(svc)[-1]["rule"], egress(svc)[-1]["learned"]) == (None, "port_not_allowed")


@pytest.mark.parametrize("plain_http", [False, True], ids=["connect", "plain-http"])
async def test_learn_mode_still_refuses_a_deny_entry_an_ip_literal_and_a_private_address(
    make_egressd, leak, dns: FakeDns, plain_http: bool
) -> None:
    dns.set("sneaky.test", [LEAK])  # not denied, not allowlisted: learn mode lets the name through, the address not
    svc = await make_egressd(learn=True, deny=["leak.test"])
    attempts = {
        f"leak.test:{leak.port}": "denylisted",
        f"{LEAK}:{leak.port}": "ip_literal",
        f"sneaky.test:{leak.port}": "private_address",
    }
    for target, reason in attempts.items():
        if plain_http:
            reader, writer = await open_proxy(svc)
            writer.write(f"GET http://{target}/ HTTP/1.1\r\n\r\n".encode())
            status, headers, _ = await read_response(reader)
        else:
            status, headers, _, _, writer = await connect_via(svc, target)
        writer.close()
        assert (status, headers["x-egress-reason"]) == (403, reason), target
    assert leak.connections == 0 and leak.received == []
    await wait_until(lambda: len(egress(svc)) == 3)
    records = {r["host"]: r for r in egress(svc)}
    assert [(r["decision"], r["reason"]) for r in records.values()] == [("deny", why) for why in attempts.values()]
    # What the allowlist alone would have done is still said; the refusal stands.
    assert "learned" not in records["leak.test"] and "learned" not in records[LEAK]
    assert records["sneaky.test"]["learned"] == "not_allowlisted"
    assert records["sneaky.test"]["address"] == LEAK


async def test_strict_dns_answers_a_name_it_would_refuse_and_still_refuses_a_denied_one(
    make_egressd, dns: FakeDns
) -> None:
    svc = await make_egressd(
        learn=True,
        ask=False,
        dns_strict=True,
        dns_listen="127.0.0.1:0",
        transparent_tls="127.0.0.1:0",
        deny=["bad.test"],
    )
    assert (await ask(svc, "elsewhere.test")).header.rcode == RCODE.NOERROR
    answered = dns_records(svc)[-1]
    assert (answered["decision"], answered["reason"], answered["learned"]) == ("allow", None, "not_allowlisted")
    assert (await ask(svc, "bad.test")).header.rcode == RCODE.NXDOMAIN
    assert (await ask(svc, "10.1.2.3")).header.rcode == RCODE.NXDOMAIN
    assert [(r["decision"], r["reason"]) for r in dns_records(svc)[1:]] == [
        ("deny", "denylisted"),
        ("deny", "ip_literal"),
    ]
    assert dns.queries == []  # nothing asked upstream


async def test_without_learn_mode_the_same_host_is_refused(make_egressd, echo_origin) -> None:
    svc = await make_egressd(ask=False)
    status, headers, _, _, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    writer.close()
    assert (status, headers["x-egress-reason"]) == (403, "not_allowlisted")
    assert echo_origin.connections == 0
    assert "learned" not in egress(svc)[-1]


async def test_the_terminal_is_told_at_start_and_again_with_the_count(
    tmp_path, dns: FakeDns, echo_origin, capfd
) -> None:
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "control": "127.0.0.1:0",
            "control_token": "test-token",
            "upstream_dns": f"{dns.address[0]}:{dns.address[1]}",
            "allow_private": [ORIGIN_RANGE],
            "audit_log": str(tmp_path / "audit.jsonl"),
            "log_level": "warning",
            "learn": True,
        }
    )
    service = EgressService(settings, approver=None, audit=MemoryAuditSink())
    service.learn_notice_interval_s = 0.05
    await service.start()
    try:
        assert "LEARN MODE: egress is NOT restricted by the allowlist" in capfd.readouterr().err
        status, _, _, _, writer = await connect_via(service, f"origin.test:{echo_origin.port}")
        writer.close()
        assert status == 200
        seen = ""
        for _ in range(100):  # bounded: 5 s
            await asyncio.sleep(0.05)
            seen += capfd.readouterr().err
            if "1 attempts learned so far" in seen:
                break
        assert "egress is NOT restricted by the allowlist; 1 attempts learned so far" in seen
    finally:
        await service.close(grace_s=0)


async def test_what_a_learning_run_did_becomes_an_allowlist_that_lets_it_do_it_again(
    make_egressd, echo_origin, leak, dns: FakeDns
) -> None:
    """Learn → suggest → lock: the suggested entries, used as the allowlist, let the same attempts out."""
    for name in ("a.example.test", "b.example.test", "c.example.test"):
        dns.set(name, [ORIGIN])
    learning = await make_egressd(learn=True, deny=["leak.test"])
    targets = [f"{h}:{echo_origin.port}" for h in ("origin.test", "a.example.test", "b.example.test", "c.example.test")]
    for target in [*targets, f"leak.test:{leak.port}"]:
        status, _, _, _, writer = await connect_via(learning, target)
        writer.close()
    await wait_until(lambda: len(egress(learning)) == 5)
    records = [json.loads(json.dumps(r)) for r in learning.audit_records]
    text = render(suggest(records))
    assert f'"*.example.test:{echo_origin.port}"' not in text  # a wildcard never invents a port
    assert "leak.test (denylisted)" in text
    allow = tomllib.loads(text)["allow"]
    assert f"origin.test:{echo_origin.port}" in allow and "leak.test" not in os.linesep.join(allow)
    locked = await make_egressd(allow=allow, ask=False)
    for target in targets:
        status, _, _, _, writer = await connect_via(locked, target)
        writer.close()
        assert status == 200, target
