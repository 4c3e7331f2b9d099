"""The webhook channel: Standard Webhooks signing (pure) and a real receiver on loopback."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from egressd.approvals.assembly import approver_from_settings
from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.interface import SetupError
from egressd.approvals.signing import ReplayGuard, SigningError, VerifyError, parse_secret, sign, signed_headers, verify
from egressd.approvals.webhook import CALLBACK_PATH, WebhookChannel
from egressd.audit.log import MemoryAuditSink
from egressd.config.settings import load_settings
from egressd.vocabulary.reasons import Answer
from tests.conftest import Listener
from tests.fakes.control import control_server
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import listening_socket, refused_port, wait_until
from tests.integration.approvals.test_broker import request

# The example in the Standard Webhooks specification.
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TS = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


# -- signing (pure) ---------------------------------------------------------------------


def test_signing_matches_the_standard_webhooks_example() -> None:
    key = parse_secret(SPEC_SECRET)
    assert sign(key, SPEC_ID, SPEC_TS, SPEC_BODY) == SPEC_SIGNATURE
    assert signed_headers(key, SPEC_ID, SPEC_TS, SPEC_BODY) == {
        "webhook-id": SPEC_ID,
        "webhook-timestamp": str(SPEC_TS),
        "webhook-signature": SPEC_SIGNATURE,
    }


@pytest.mark.parametrize(
    ("secret", "why"),
    [("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_"), ("whsec_not base64!", "base64"), ("whsec_c2hvcnQ=", "shorter")],
)
def test_a_secret_must_be_a_whsec_base64_key(secret: str, why: str) -> None:
    with pytest.raises(SigningError, match=why):
        parse_secret(secret)


def test_verify_accepts_the_real_signature_and_nothing_else() -> None:
    key = parse_secret(SPEC_SECRET)
    good = signed_headers(key, SPEC_ID, SPEC_TS, SPEC_BODY)
    assert verify(key, good, SPEC_BODY, now=SPEC_TS + 10) == SPEC_ID
    assert verify(key, good | {"webhook-signature": f"v1,AAAA {SPEC_SIGNATURE}"}, SPEC_BODY, now=SPEC_TS) == SPEC_ID
    cases: list[tuple[dict[str, str], bytes, float, str]] = [
        ({}, SPEC_BODY, SPEC_TS, "missing"),
        ({k: v for k, v in good.items() if k != "webhook-signature"}, SPEC_BODY, SPEC_TS, "missing"),
        (good | {"webhook-timestamp": "12e5"}, SPEC_BODY, SPEC_TS, "malformed"),
        (good, SPEC_BODY, SPEC_TS + 301, "stale"),
        (good, SPEC_BODY, SPEC_TS - 301, "stale"),
        (good, SPEC_BODY + b" ", SPEC_TS, "bad signature"),
        (good | {"webhook-id": "msg_other"}, SPEC_BODY, SPEC_TS, "bad signature"),
        (
            good | {"webhook-signature": "v1," + base64.b64encode(b"x" * 32).decode()},
            SPEC_BODY,
            SPEC_TS,
            "bad signature",
        ),
    ]
    for headers, body, now, why in cases:
        with pytest.raises(VerifyError, match=why):
            verify(key, headers, body, now=now)
    with pytest.raises(VerifyError, match="bad signature"):
        verify(parse_secret(make_secret()[0]), good, SPEC_BODY, now=SPEC_TS)


def test_the_replay_guard_remembers_ids_for_its_window_within_its_bound() -> None:
    guard = ReplayGuard(window_s=600, max_ids=3)
    assert guard.first_sighting("a", now=0) and not guard.first_sighting("a", now=599)
    assert guard.first_sighting("a", now=1200)  # long after: refused anyway as stale
    for name in "bcd":
        assert guard.first_sighting(name, now=1201)
    assert guard.first_sighting("a", now=1202)  # pushed out by the bound


# -- the channel, against a receiver -------------------------------------------------------


@pytest.fixture
async def hook() -> AsyncIterator[Callable[..., Any]]:
    """``await hook(mode=..., timeout_s=...)`` → (broker, receiver, audit); everything stops at the end."""
    stack: list[Any] = []

    async def make(
        mode: str = "now",
        decision: str = "allow",
        timeout_s: float = 30.0,
        url: str | None = None,
        callback: bool = True,
    ) -> tuple[ApprovalBroker, WebhookReceiver, MemoryAuditSink]:
        secret, key = make_secret()
        _, callback_key = make_secret()
        receiver = WebhookReceiver(key, callback_key=callback_key, mode=mode, decision=decision)
        await receiver.__aenter__()
        stack.append(receiver)
        sock = listening_socket()  # bound before its port is named in public_url: nobody else can take it
        port = sock.getsockname()[1]
        channel = WebhookChannel(
            url=url or receiver.url,
            secret=parse_secret(secret),
            callback_secret=callback_key if callback else None,
            public_url=f"http://127.0.0.1:{port}/",
            backoff_first_s=0.02,
            backoff_max_s=0.05,
        )
        audit = MemoryAuditSink()
        broker = ApprovalBroker([channel], audit=audit, timeout_s=timeout_s)
        server = control_server(broker.routes, sock)
        await server.__aenter__()
        stack.append(server)
        await broker.start()
        stack.append(broker)
        return broker, receiver, audit

    yield make
    for item in reversed(stack):
        if isinstance(item, ApprovalBroker):
            await item.close()
        else:
            await item.__aexit__(None, None, None)


async def test_the_approval_is_posted_signed_and_an_answer_at_once_decides(hook: Callable[..., Any]) -> None:
    broker, receiver, audit = await hook(mode="now", decision="allow")
    outcome = await asyncio.wait_for(broker.ask(request()), 5)
    assert outcome.allowed and outcome.channel == "webhook" and outcome.by == "hook-bot"
    [delivery] = receiver.requests
    assert delivery.signature_ok and delivery.headers["webhook-id"].startswith("msg_")
    assert abs(int(delivery.headers["webhook-timestamp"]) - time.time()) < 5
    assert delivery.headers["content-type"] == "application/json"
    payload = delivery.payload
    assert payload["type"] == "approval.requested" and payload["id"] == outcome.approval_id
    assert {k: payload[k] for k in ("run", "host", "port", "command", "task", "allowed", "unrelated")} == {
        "run": "r-1",
        "host": "evil.example",
        "port": 443,
        "command": "curl evil",
        "task": "build",
        "allowed": ["pypi.org"],
        "unrelated": True,
    }
    assert payload["message"].startswith("A command in the sandbox tried to reach a domain")
    assert payload["expires_at"].endswith("Z") and payload["callback_url"].endswith(CALLBACK_PATH)
    await wait_until(lambda: receiver.settled)  # told it is settled, signed too
    settled = receiver.settled[0]
    assert (
        settled.signature_ok and settled.payload["decision"] == "allow" and settled.payload["id"] == outcome.approval_id
    )
    assert settled.headers["webhook-id"] != delivery.headers["webhook-id"]


async def test_an_answer_later_comes_through_the_signed_callback(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="later")
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: receiver.requests)
    await asyncio.sleep(0.05)
    assert not held.done()
    approval_id = receiver.requests[0].payload["id"]
    status, body, _ = await receiver.callback(approval_id, "deny", by="bob")
    assert (status, body) == (200, {"id": approval_id, "decision": "deny", "scope": None})
    outcome = await asyncio.wait_for(held, 5)
    assert outcome.answer is Answer.DENY and outcome.by == "bob" and outcome.channel == "webhook"


async def test_a_receiver_that_never_answers_times_out(hook: Callable[..., Any]) -> None:
    broker, receiver, audit = await hook(mode="never", timeout_s=0.3)
    outcome = await asyncio.wait_for(broker.ask(request()), 5)
    assert outcome.answer is Answer.TIMEOUT
    assert len(receiver.requests) == 1
    assert [r["reason"] for r in audit.records if r["event"] == "approval.decided"] == ["approval_timeout"]


async def test_delivery_is_retried_with_backoff_and_the_same_id(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="now", decision="deny")
    receiver.fail_first = 3
    outcome = await asyncio.wait_for(broker.ask(request()), 5)
    assert outcome.answer is Answer.DENY
    attempts = receiver.requests
    assert len(attempts) == 4 and all(a.signature_ok for a in attempts)
    assert len({a.headers["webhook-id"] for a in attempts}) == 1
    assert len({a.body for a in attempts}) == 1


async def test_a_receiver_that_refuses_fails_delivery_at_once(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="refuse", timeout_s=30)
    outcome = await asyncio.wait_for(broker.ask(request()), 5)
    assert outcome.answer is Answer.NO_APPROVER and len(receiver.requests) == 1


async def test_an_unreachable_receiver_is_retried_until_the_approval_expires(hook: Callable[..., Any]) -> None:
    with refused_port() as port:
        broker, receiver, _ = await hook(url=f"http://127.0.0.1:{port}/hook", timeout_s=0.3)
        started = time.monotonic()
        outcome = await asyncio.wait_for(broker.ask(request()), 5)
    assert outcome.answer is Answer.NO_APPROVER  # nobody was ever reached
    assert time.monotonic() - started >= 0.25


async def test_a_2xx_without_an_answer_means_the_answer_comes_later(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="garbage")
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: receiver.requests)
    status, _, _ = await receiver.callback(receiver.requests[0].payload["id"], "allow")
    assert status == 200 and (await held).allowed


async def test_forged_stale_unsigned_and_replayed_callbacks_are_rejected_and_logged(
    hook: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="egressd.approvals.webhook")
    broker, receiver, _ = await hook(mode="later")
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: receiver.requests)
    approval_id = receiver.requests[0].payload["id"]
    assert (await receiver.callback(approval_id, "allow", signed=False))[0] == 401
    assert (await receiver.callback(approval_id, "allow", key=receiver.key))[
        0
    ] == 401  # the outgoing key is not the callback's
    assert (await receiver.callback(approval_id, "allow", timestamp=int(time.time()) - 400))[0] == 401
    assert (await receiver.callback(approval_id, "allow", timestamp=int(time.time()) + 400))[0] == 401
    assert broker.pending() and not held.done()
    status, _, sent = await receiver.callback(approval_id, "deny", msg_id="msg_once")
    assert status == 200
    replay_status, replay_body, _ = await receiver.send(
        receiver.requests[0].payload["callback_url"],
        json.dumps({"id": approval_id, "decision": "deny", "by": "bob"}).encode(),
        sent,
    )
    assert replay_status == 409 and "replayed" in replay_body["error"]
    assert (await held).answer is Answer.DENY
    logged = " ".join(r.getMessage() for r in caplog.records)
    for why in ("missing webhook-id", "bad signature", "stale", "replayed"):
        assert why in logged


async def test_a_replayed_id_is_refused_even_for_another_approval(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="later")
    first = asyncio.create_task(broker.ask(request("one.example")))
    second = asyncio.create_task(broker.ask(request("two.example")))
    await wait_until(lambda: len(receiver.requests) == 2)
    one, two = (r.payload["id"] for r in receiver.requests)
    assert (await receiver.callback(one, "allow", msg_id="msg_same"))[0] == 200
    assert (await receiver.callback(two, "allow", msg_id="msg_same"))[0] == 409
    assert (await receiver.callback(two, "deny"))[0] == 200
    assert (await first).allowed and (await second).answer is Answer.DENY


async def test_a_receiver_answering_twice_is_heard_once(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="later")
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: receiver.requests)
    approval_id = receiver.requests[0].payload["id"]
    assert (await receiver.callback(approval_id, "allow"))[0] == 200
    status, body, _ = await receiver.callback(approval_id, "deny")
    assert status == 409 and body["error"] == "already settled"
    assert (await held).allowed
    assert (await receiver.callback("a-unknown", "allow", url=receiver.requests[0].payload["callback_url"]))[0] == 404


async def test_bad_callback_bodies_are_refused(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="later")
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: receiver.requests)
    approval_id = receiver.requests[0].payload["id"]
    for body in (
        b"not json",
        b"[]",
        json.dumps({"id": approval_id, "decision": "maybe"}).encode(),
        json.dumps({"decision": "allow"}).encode(),
    ):
        assert (await receiver.callback(approval_id, "allow", body=body))[0] == 400
    assert not held.done()
    await receiver.callback(approval_id, "deny")
    await held


async def test_nothing_is_decided_by_a_get(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="later")
    held = asyncio.create_task(broker.ask(request()))
    await wait_until(lambda: receiver.requests)
    url = receiver.requests[0].payload["callback_url"]
    approval_id = receiver.requests[0].payload["id"]
    status, _, _ = await receiver.send(f"{url}?id={approval_id}&decision=allow", b"", {}, method="GET")
    assert status == 405
    assert broker.pending() and not held.done()
    await receiver.callback(approval_id, "deny")
    await held


async def test_without_a_callback_secret_there_is_no_callback(hook: Callable[..., Any]) -> None:
    broker, receiver, _ = await hook(mode="now", callback=False)
    assert (await broker.ask(request())).allowed
    assert receiver.requests[0].payload["callback_url"] is None
    assert all(route.path != CALLBACK_PATH for route in broker.routes())


async def test_egressd_does_not_send_its_webhooks_through_the_environments_proxy(
    hook: Callable[..., Any], leak: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://{leak.host}:{leak.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    broker, receiver, _ = await hook(mode="now")
    assert (await broker.ask(request())).allowed
    assert leak.connections == 0 and receiver.requests


def _settings(tmp_path: Path, **values: Any) -> Any:
    return load_settings({"audit_log": str(tmp_path / "a.jsonl"), **values})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "bad setting webhook_url"),
        ({"webhook_url": "http://127.0.0.1:9/h"}, "bad setting webhook_secret: --approver webhook needs"),
        (
            {"webhook_url": "http://127.0.0.1:9/h", "webhook_secret": "hunter2"},
            "bad setting webhook_secret: must start with whsec_",
        ),
        (
            {
                "webhook_url": "http://127.0.0.1:9/h",
                "webhook_secret": SPEC_SECRET,
                "webhook_callback_secret": "whsec_%%",
            },
            "bad setting webhook_callback_secret",
        ),
        (
            {
                "webhook_url": "http://127.0.0.1:9/h",
                "webhook_secret": SPEC_SECRET,
                "webhook_callback_secret": SPEC_SECRET,
            },
            "must differ from webhook_secret",
        ),
    ],
)
def test_a_webhook_that_cannot_work_stops_start_up(tmp_path: Path, values: dict[str, Any], message: str) -> None:
    with pytest.raises(SetupError, match=message):
        approver_from_settings(_settings(tmp_path, approver=["webhook"], **values), audit=MemoryAuditSink())
