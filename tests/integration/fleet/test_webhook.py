"""A fleet's webhook: one callback URL for the fleet (behind a load balancer), whichever instance gets the callback.

Each instance posts the approvals it holds to the receiver. A signed
callback that reaches another instance (the balancer picked it) is checked
there as its own callback is, then passed through the database to the
instance that holds the approval, which decides, once. Brokers made by the
real assembly from settings, a WebhookReceiver, a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from egressd.approvals.assembly import approver_from_settings
from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.webhook import CALLBACK_PATH
from egressd.audit.log import MemoryAuditSink
from egressd.config.settings import load_settings
from egressd.fleet.store import Store
from egressd.vocabulary.reasons import Answer
from tests.fakes.control import control_server
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import listening_socket, wait_until
from tests.integration.approvals.test_broker import request
from tests.postgres import Postgres


@pytest.fixture
async def fleet_of_hooks(postgres: Postgres, database: str) -> AsyncIterator[Callable[[str], Any]]:
    """``await make(name)`` → (broker, its callback URL); one receiver for all, in ``make.receiver``."""
    dsn = postgres.dsn(database)
    store = await Store.open(dsn)
    await store.migrate()
    await store.close()
    secret, key = make_secret()
    callback_secret, callback_key = make_secret()
    async with contextlib.AsyncExitStack() as stack:
        receiver = await stack.enter_async_context(WebhookReceiver(key, callback_key=callback_key, mode="later"))

        async def make(name: str) -> tuple[ApprovalBroker, str]:
            sock = listening_socket()
            public = f"http://127.0.0.1:{sock.getsockname()[1]}/"
            settings = load_settings({
                "approver": ["webhook"], "webhook_url": receiver.url, "webhook_secret": secret,
                "webhook_callback_secret": callback_secret, "public_url": public, "state": dsn,
            })  # fmt: skip
            broker = approver_from_settings(settings, audit=MemoryAuditSink(), fleet_instance=name)
            assert isinstance(broker, ApprovalBroker)
            await stack.enter_async_context(control_server(broker.routes, sock))
            await broker.start()
            stack.push_async_callback(broker.close)
            return broker, public.rstrip("/") + CALLBACK_PATH

        make.receiver = receiver  # type: ignore[attr-defined]
        yield make


async def test_a_callback_another_instance_gets_is_decided_by_the_holder_once(
    fleet_of_hooks: Callable[[str], Any],
) -> None:
    holder, _ = await fleet_of_hooks("holder")
    _, other_callback = await fleet_of_hooks("other")
    receiver: WebhookReceiver = fleet_of_hooks.receiver  # type: ignore[attr-defined]
    held = asyncio.create_task(holder.ask(request()))
    await wait_until(lambda: receiver.requests, 10)
    [delivery] = receiver.requests  # posted once, by its holder
    approval_id = delivery.payload["id"]
    # Unsigned, at the other instance: refused there, nothing passed on.
    status, _, _ = await receiver.callback(approval_id, "allow", url=other_callback, signed=False)
    assert status == 401 and not held.done()
    status, body, _ = await receiver.callback(approval_id, "deny", by="bob", url=other_callback)
    assert status == 200 and body["decision"] == "deny", body
    outcome = await asyncio.wait_for(held, 15)
    assert outcome.answer is Answer.DENY and outcome.by == "bob" and outcome.channel == "webhook@other", outcome
    # Another answer, through either instance: already settled, decided once.
    status, body, _ = await receiver.callback(approval_id, "allow", url=other_callback)
    assert status == 409, body
    status, body, _ = await receiver.callback(approval_id, "allow")
    assert status == 409, body
