"""Attacks on the proxy, each checked three ways: the client was refused with
the right reason, nothing reached the leak detector (and the upstream DNS was
not asked about a denied name), and the audit log holds the refusal."""

from __future__ import annotations

import asyncio

import pytest

from egressd.approvals.deny import DenyApprover
from tests.fakes.dns import FakeDns
from tests.harness import LEAK, LEAK_SPELLINGS, connect_via, egress, open_proxy, read_response, wait_until


def assert_refused(status: int, headers: dict[str, str], body: bytes, reason: str, code: int = 403) -> None:
    assert status == code, body
    assert headers["x-egress-decision"] == "deny"
    assert headers["x-egress-reason"] == reason
    assert headers["x-egress-request-id"]
    assert body.startswith(b"egressd: blocked ")


def audit_for(service, request_id: str) -> dict:  # type: ignore[no-untyped-def]
    matching = [r for r in egress(service) if r["id"] == request_id]
    assert len(matching) == 1, egress(service)
    return matching[0]


@pytest.mark.parametrize("spelling", LEAK_SPELLINGS)
async def test_every_ip_literal_spelling_is_refused_unless_named(make_egressd, leak, spelling) -> None:
    svc = await make_egressd(allow=["origin.test"], allow_private=["127.0.0.0/8"])
    port = leak.port
    status, headers, body, _, w = await connect_via(svc, f"{spelling}:{port}")
    w.close()
    assert_refused(status, headers, body, "ip_literal")
    assert leak.connections == 0
    record = audit_for(svc, headers["x-egress-request-id"])
    assert (record["decision"], record["reason"], record["kind"]) == ("deny", "ip_literal", "connect")


async def test_ip_literal_named_by_an_entry_is_still_checked_for_private_addresses(make_egressd, leak) -> None:
    svc = await make_egressd(allow=[f"{LEAK}:*"])  # named, but LEAK is not in allow_private
    status, headers, body, _, w = await connect_via(svc, f"{LEAK}:{leak.port}")
    w.close()
    assert_refused(status, headers, body, "private_address")
    assert leak.connections == 0
    assert audit_for(svc, headers["x-egress-request-id"])["reason"] == "private_address"


async def test_name_rebinding_to_a_forbidden_address_is_refused(make_egressd, leak, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    dns.set("origin.test", [LEAK], ttl=0)
    status, headers, body, _, w = await connect_via(svc, f"origin.test:{leak.port}")
    w.close()
    assert_refused(status, headers, body, "private_address")
    assert leak.connections == 0
    record = audit_for(svc, headers["x-egress-request-id"])
    assert record["address"] == LEAK and record["reason"] == "private_address"
    # The person who allowed the name learns which address it was and what would let it through.
    assert f"({LEAK}; if it is yours: --allow-private {LEAK}/32)" in body.decode(), body


async def test_an_allow_entry_naming_a_private_address_is_warned_about_at_start(
    make_egressd, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="egressd"):
        await make_egressd(allow=[f"{LEAK}:*", "origin.test"])
    said = [r.getMessage() for r in caplog.records if "names a private or special address" in r.getMessage()]
    assert said == [f"egressd: the allow entry {LEAK}:* names a private or special address, which is refused unless "
                    f"--allow-private covers it (if it is yours: --allow-private {LEAK}/32)"], said  # fmt: skip
    caplog.clear()
    with caplog.at_level("WARNING", logger="egressd"):
        await make_egressd(allow=[f"{LEAK}:*"], allow_private=[f"{LEAK}/32"])  # covered: nothing to say
    assert not [r for r in caplog.records if "private or special" in r.getMessage()]


async def test_only_addresses_that_passed_the_check_are_dialled(make_egressd, leak, echo_origin) -> None:
    svc = await make_egressd(allow=["mixed.test:*"])  # resolves to LEAK first, then ORIGIN
    status, headers, _, reader, writer = await connect_via(svc, f"mixed.test:{echo_origin.port}")
    assert status == 200
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    writer.close()
    assert leak.connections == 0
    assert echo_origin.connections == 1


async def test_loopback_is_denied_by_default(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], allow_private=[])
    status, headers, body, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert_refused(status, headers, body, "private_address")
    assert echo_origin.connections == 0


@pytest.mark.parametrize("host", ["example.test", "evilexample.test", "sub.example.test.evil", "xexample.test"])
async def test_wildcard_confusion_is_refused_and_never_resolved(make_egressd, leak, dns: FakeDns, host) -> None:
    svc = await make_egressd(allow=["*.example.test:*"], ask=False)
    status, headers, body, _, w = await connect_via(svc, f"{host}:{leak.port}")
    w.close()
    assert_refused(status, headers, body, "not_allowlisted")
    assert leak.connections == 0
    assert not dns.asked(host)
    assert audit_for(svc, headers["x-egress-request-id"])["reason"] == "not_allowlisted"


@pytest.mark.parametrize("spelling", ["ORIGIN.TEST", "origin.test.", "OrIgIn.TeSt."])
async def test_case_and_one_trailing_dot_do_not_change_the_decision(make_egressd, echo_origin, spelling) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    status, _, _, _, w = await connect_via(svc, f"{spelling}:{echo_origin.port}")
    w.close()
    assert status == 200
    await wait_until(lambda: egress(svc))
    assert egress(svc)[-1]["host"] == "origin.test"


async def test_two_trailing_dots_are_a_bad_request(make_egressd, leak, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    status, headers, body, _, w = await connect_via(svc, f"origin.test..:{leak.port}")
    w.close()
    assert_refused(status, headers, body, "bad_request", code=400)
    assert not dns.queries


async def test_a_port_not_allowed_for_the_host_is_asked_about_and_a_denial_reaches_nothing(
    make_egressd, echo_origin, dns: FakeDns
) -> None:
    """A port the entries do not name is a destination of its own: a person is asked, as for a new name."""
    asked: list[tuple[str, int]] = []

    class Recording(DenyApprover):
        async def ask(self, request):  # type: ignore[no-untyped-def]
            asked.append((request.host, request.port))
            return await super().ask(request)

    svc = await make_egressd(allow=["origin.test"], approver=Recording())  # ports 80 and 443 only
    status, headers, body, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert_refused(status, headers, body, "denied")
    assert echo_origin.connections == 0 and asked == [("origin.test", echo_origin.port)] and not dns.queries


async def test_a_port_not_allowed_for_the_host_is_refused_without_asking_when_asking_is_off(
    make_egressd, echo_origin, dns: FakeDns
) -> None:
    svc = await make_egressd(allow=["origin.test"], ask=False)
    status, headers, body, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert_refused(status, headers, body, "port_not_allowed")
    assert echo_origin.connections == 0 and not dns.queries


async def test_denylist_wins_over_allowlist(make_egressd, leak, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["*.example.test:*"], deny=["sub.example.test"])
    status, headers, body, _, w = await connect_via(svc, f"sub.example.test:{leak.port}")
    w.close()
    assert_refused(status, headers, body, "denylisted")
    assert not dns.queries
    assert audit_for(svc, headers["x-egress-request-id"])["rule"] == "sub.example.test"


async def test_denied_by_approver_then_denied_earlier_without_asking_again(make_egressd, leak, dns: FakeDns) -> None:
    asked: list[str] = []

    class Recording(DenyApprover):
        async def ask(self, request):  # type: ignore[no-untyped-def]
            asked.append(request.host)
            return await super().ask(request)

    svc = await make_egressd(allow=["origin.test"], approver=Recording())
    first = await connect_via(svc, "leak.test:443")
    second = await connect_via(svc, "leak.test:443")
    for _, _, _, _, w in (first, second):
        w.close()
    assert_refused(*first[:3], "denied")
    assert_refused(*second[:3], "denied_earlier")
    assert first[2] == b"egressd: blocked leak.test:443 (denied by approver) in run default\n"
    assert asked == ["leak.test"]
    assert not dns.asked("leak.test") and leak.connections == 0


async def test_no_approver_attached_fails_the_request(make_egressd, dns: FakeDns) -> None:
    svc = await make_egressd(allow=["origin.test"])
    status, headers, body, _, w = await connect_via(svc, "leak.test:443")
    w.close()
    assert_refused(status, headers, body, "no_approver")
    assert not dns.asked("leak.test")


async def test_absolute_uri_decides_and_a_disagreeing_host_header_is_replaced(make_egressd, http_origin, leak) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer = await open_proxy(svc)
    writer.write(
        f"GET http://origin.test:{http_origin.port}/x?q=1 HTTP/1.1\r\nHost: leak.test:{leak.port}\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    status, headers, body = await read_response(reader)
    writer.close()
    assert status == 200 and body.startswith(b"hello from origin")
    assert http_origin.requests[0]["headers"]["Host"] == f"origin.test:{http_origin.port}"
    assert leak.connections == 0
    record = egress(svc)[-1]
    assert record["host"] == "origin.test" and "q=1" not in str(record)


async def test_oversized_head_gets_431_and_the_server_keeps_serving(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], max_head_bytes=4096)
    reader, writer = await open_proxy(svc)
    writer.write(b"CONNECT origin.test:1 HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 8000 + b"\r\n\r\n")
    status, headers, _ = await read_response(reader)
    writer.close()
    assert status == 431 and headers["x-egress-reason"] == "limit_exceeded"
    status, _, _, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert status == 200
    assert any(r["reason"] == "limit_exceeded" for r in egress(svc))


async def test_a_slow_head_is_cut_off_without_holding_up_others(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], head_timeout_s=0.3)
    slow_reader, slow_writer = await open_proxy(svc)
    slow_writer.write(b"CONNECT origin.te")
    await slow_writer.drain()
    status, _, _, reader, writer = await connect_via(svc, f"origin.test:{echo_origin.port}")
    assert status == 200  # served while the slow client dawdles
    writer.close()
    status, headers, _ = await read_response(slow_reader)
    assert status == 408 and headers["x-egress-reason"] == "limit_exceeded"
    assert await asyncio.wait_for(slow_reader.read(), 2) == b""
    slow_writer.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)) + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n",  # origin-form to a proxy
        b"CONNECT origin.test HTTP/1.1\r\n\r\n",  # no port
        b"CONNECT user@origin.test:443 HTTP/1.1\r\n\r\n",
        b"GET http://origin.test/ HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"\x00\xff\xfe garbage \r\n\r\n",
        b"CONNECT origin.test:99999 HTTP/1.1\r\n\r\n",
    ],
    ids=["tls-hello", "origin-form", "connect-without-port", "userinfo", "cl-and-te", "binary", "port-out-of-range"],
)
async def test_garbage_is_a_bad_request_and_the_listener_keeps_serving(
    make_egressd, echo_origin, leak, garbage
) -> None:
    svc = await make_egressd(allow=["origin.test:*"])
    reader, writer = await open_proxy(svc)
    writer.write(garbage)
    status, headers, _ = await read_response(reader)
    writer.close()
    assert status in (400, 501, 505) and headers["x-egress-reason"] == "bad_request"
    assert leak.connections == 0 and echo_origin.connections == 0
    assert egress(svc)[-1]["reason"] == "bad_request"
    status, _, _, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert status == 200


async def test_random_bytes_never_crash_the_listener(make_egressd, echo_origin) -> None:
    import random

    rng = random.Random(1234)
    svc = await make_egressd(allow=["origin.test:*"], head_timeout_s=0.5)
    for _ in range(50):
        reader, writer = await open_proxy(svc)
        writer.write(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000))) + b"\r\n\r\n")
        try:
            await asyncio.wait_for(reader.read(), 3)
        except ConnectionError:
            pass
        writer.close()
    status, _, _, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert status == 200
    assert echo_origin.connections == 1


async def test_a_run_without_credentials_is_refused_when_auth_is_required(make_egressd, echo_origin) -> None:
    svc = await make_egressd(allow=["origin.test:*"], require_auth=True)
    status, headers, body, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert_refused(status, headers, body, "auth_required", code=407)
    assert echo_origin.connections == 0
    assert egress(svc)[-1]["reason"] == "auth_required"


async def test_audit_log_failure_refuses_new_egress(make_egressd, echo_origin) -> None:
    from egressd.audit.log import MemoryAuditSink

    sink = MemoryAuditSink(fail_after=2)  # room for run.start and the tunnel's write-ahead record
    svc = await make_egressd(allow=["origin.test:*"], audit=sink)
    status, _, _, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert status == 200
    await wait_until(lambda: not sink.healthy)  # the tunnel's end record could not be written
    status, headers, _, _, w = await connect_via(svc, f"origin.test:{echo_origin.port}")
    w.close()
    assert status == 503 and headers["x-egress-reason"] == "audit_unavailable"
    assert echo_origin.connections == 1


async def test_an_approval_that_arrives_after_its_run_ended_lets_nothing_out(make_egressd, echo_origin) -> None:
    from egressd.approvals.interface import ApprovalOutcome
    from egressd.vocabulary.reasons import Answer

    release = asyncio.Event()

    class LateAllow:
        async def ask(self, request):  # type: ignore[no-untyped-def]
            await release.wait()
            return ApprovalOutcome(Answer.ALLOW, approval_id="a-1", channel="test", by="someone")

    svc = await make_egressd(approver=LateAllow(), require_auth=True)
    run = svc.runs.create(task="t", allow=[])
    import base64

    creds = base64.b64encode(f"{run.id}:{run.token}".encode()).decode()
    pending = asyncio.create_task(
        connect_via(svc, f"origin.test:{echo_origin.port}", f"Proxy-Authorization: Basic {creds}\r\n")
    )
    await wait_until(lambda: svc.path.recorder.metrics.held_requests == 1)
    svc.runs.end(run.id)
    release.set()
    status, headers, body, _, w = await pending
    w.close()
    assert_refused(status, headers, body, "auth_required", code=407)
    assert echo_origin.connections == 0
