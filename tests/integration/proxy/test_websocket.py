"""WebSocket upgrades: decided on the upgrade request, relayed both ways after the origin's 101.

On an inspected name the upgrade is judged as the method WEBSOCKET: a rule
naming it (or naming no method) lets it through, a GET rule or ``read_only``
does not (once switched, the connection carries anything, uploads
included). Through the explicit proxy, a plain upgrade to an allowed name is
relayed the same way. Real clients: aiohttp's WebSocket client through the
proxy (and a hand-written one for plain HTTP: aiohttp sends its ``ws://``
absolute-form, which no proxy takes), an aiohttp WebSocket origin over TLS
(the test's CA) or plain HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientSession, web

from egressd.cli.wiring.service import EgressService
from egressd.vocabulary.reasons import Answer
from tests.conftest import MakeEgressd
from tests.fakes.tls import Pki, make_pki
from tests.harness import ORIGIN, wait_until
from tests.integration.proxy.test_upload_budget import Reviewer

pytestmark = pytest.mark.timeout(60)


class EchoOrigin:
    """A WebSocket echo origin on ORIGIN (TLS with ``pki``, else plain); ``upgrades`` counts the handshakes."""

    def __init__(self) -> None:
        self.upgrades = 0
        self.received = 0  # binary payload bytes that arrived
        self.port = 0
        self.runner: web.AppRunner | None = None

    async def start(self, pki: Pki | None) -> EchoOrigin:
        async def echo(request: web.Request) -> web.WebSocketResponse:
            socket = web.WebSocketResponse()
            await socket.prepare(request)
            self.upgrades += 1
            async for message in socket:
                if message.type == aiohttp.WSMsgType.TEXT:
                    await socket.send_str(f"echo: {message.data}")
                elif message.type == aiohttp.WSMsgType.BINARY:
                    self.received += len(message.data)
            return socket

        app = web.Application()
        app.router.add_get("/{tail:.*}", echo)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, ORIGIN, 0, ssl_context=pki.server_context() if pki else None).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    (tmp_path / "pki").mkdir()
    return make_pki(tmp_path / "pki", ["origin.test"])


@pytest.fixture
async def wss_origin(pki: Pki) -> AsyncIterator[EchoOrigin]:
    origin = await EchoOrigin().start(pki)
    yield origin
    await origin.close()


@pytest.fixture
async def ws_origin() -> AsyncIterator[EchoOrigin]:
    origin = await EchoOrigin().start(None)
    yield origin
    await origin.close()


async def _run_ca_context(svc: EgressService) -> ssl.SSLContext:
    async with ClientSession() as session, session.get(
        f"{svc.control_address}/runs/default/ca", headers={"Authorization": "Bearer test-token"}
    ) as response:
        assert response.status == 200, await response.text()
        return ssl.create_default_context(cadata=(await response.read()).decode())


async def _talk(svc: EgressService, url: str, context: ssl.SSLContext | None) -> str:
    """Open the WebSocket through the proxy, send one message, return the answer."""
    async with ClientSession() as session, session.ws_connect(
        url, proxy=f"http://127.0.0.1:{svc.proxy_address[1]}", ssl=context if context else False,
        timeout=aiohttp.ClientWSTimeout(ws_close=10),
    ) as socket:
        await socket.send_str("hello")
        message = await socket.receive(timeout=10)
        return str(message.data)


def _egress(svc: EgressService, kind: str) -> list[dict[str, Any]]:
    return [r for r in svc.audit_records if r["event"] == "egress" and r.get("kind") == kind]


async def test_a_websocket_rule_lets_the_upgrade_through_and_the_messages_go_both_ways(
    make_egressd: MakeEgressd, wss_origin: EchoOrigin, pki: Pki
) -> None:
    svc = await make_egressd(
        allow=[f"WEBSOCKET origin.test:{wss_origin.port}/ws/**"], inspect_origin_ca_file=str(pki.ca_pem), ask=False
    )
    answer = await _talk(svc, f"wss://origin.test:{wss_origin.port}/ws/feed", await _run_ca_context(svc))
    assert answer == "echo: hello" and wss_origin.upgrades == 1
    (record,) = _egress(svc, "https")
    assert (record["decision"], record["method"], record["path"]) == ("allow", "WEBSOCKET", "/ws/feed"), record
    await wait_until(lambda: any(r["event"] == "egress.end" and r["id"] == record["id"] for r in svc.audit_records))
    (end,) = [r for r in svc.audit_records if r["event"] == "egress.end" and r["id"] == record["id"]]
    assert end["status"] == 101 and end["bytes_up"] > 0 and end["bytes_down"] > 0, end


@pytest.mark.parametrize("rule", ["GET origin.test:PORT/ws/**", "read_only origin.test:PORT"])
async def test_a_read_rule_does_not_open_a_websocket_and_the_origin_sees_no_upgrade(
    make_egressd: MakeEgressd, wss_origin: EchoOrigin, pki: Pki, rule: str
) -> None:
    svc = await make_egressd(
        allow=[rule.replace("PORT", str(wss_origin.port))], inspect_origin_ca_file=str(pki.ca_pem), ask=False
    )
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await _talk(svc, f"wss://origin.test:{wss_origin.port}/ws/feed", await _run_ca_context(svc))
    assert refused.value.status == 403
    assert wss_origin.upgrades == 0
    (record,) = _egress(svc, "https")
    assert (record["decision"], record["reason"], record["method"]) == ("deny", "not_allowlisted", "WEBSOCKET")


async def test_plain_ws_through_the_proxy_to_an_allowed_name_is_relayed_after_its_101(
    make_egressd: MakeEgressd, ws_origin: EchoOrigin
) -> None:
    """A client that sends its upgrade to the proxy as an absolute-form http:// GET (curl's way, not aiohttp's
    ws://): the head goes on asking for the upgrade, and after the 101 the frames go both ways."""
    svc = await make_egressd(allow=[f"origin.test:{ws_origin.port}"], ask=False)
    reader, writer = await asyncio.open_connection("127.0.0.1", svc.proxy_address[1])
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET http://origin.test:{ws_origin.port}/chat HTTP/1.1\r\nHost: origin.test:{ws_origin.port}\r\n"
            f"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Key: {key}\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 101 ") and b"Upgrade: websocket" in head, head
        mask = os.urandom(4)
        payload = b"hello"
        writer.write(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        frame = await asyncio.wait_for(reader.readexactly(2 + len(b"echo: hello")), 10)
        assert frame == bytes([0x81, len(b"echo: hello")]) + b"echo: hello"
    finally:
        writer.close()
    assert ws_origin.upgrades == 1
    (record,) = _egress(svc, "http")
    assert record["decision"] == "allow"


async def test_a_websocket_past_the_upload_budget_is_paused_and_a_denial_closes_it(
    make_egressd: MakeEgressd, wss_origin: EchoOrigin, pki: Pki
) -> None:
    """The attack: once switched, the socket carries anything; it keeps sending frames past the budget."""
    budget = 64 * 1024
    reviewer = Reviewer()
    svc = await make_egressd(allow=[f"WEBSOCKET origin.test:{wss_origin.port}/ws/**"], approver=reviewer,
                             inspect_origin_ca_file=str(pki.ca_pem), upload_budget_mb=budget / 2**20)  # fmt: skip
    context = await _run_ca_context(svc)
    async with ClientSession() as session, session.ws_connect(
        f"wss://origin.test:{wss_origin.port}/ws/up", proxy=f"http://127.0.0.1:{svc.proxy_address[1]}", ssl=context,
        timeout=aiohttp.ClientWSTimeout(ws_close=5),
    ) as socket:

        async def flood() -> None:
            for _ in range(16384):  # 128 MiB at most: more than the kernel buffers both ways can hold
                await socket.send_bytes(b"u" * 8192)

        sending = asyncio.ensure_future(flood())
        try:
            await _paused_then_denied(reviewer, wss_origin, sending, socket, budget)
        finally:  # an answer whatever happened: a question left open would hold egressd's close
            reviewer.answers.put_nowait(Answer.DENY)
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, aiohttp.ClientError):
                await sending
    assert wss_origin.received <= budget  # nothing more after the denial
    await wait_until(lambda: any(r["event"] == "egress.end" and "upload budget" in (r.get("detail") or "")
                                 for r in svc.audit_records), 10)  # fmt: skip


async def _paused_then_denied(
    reviewer: Reviewer, origin: EchoOrigin, sending: asyncio.Future[None], socket: Any, budget: int
) -> None:
    await wait_until(lambda: len(reviewer.asked) == 1, 10)
    assert reviewer.asked[0].uploaded == budget  # the read that would pass it is cut at its last byte
    await asyncio.sleep(0.5)
    held = origin.received
    assert held <= budget, held  # the messages' bytes within the budget, no more
    assert not sending.done()
    reviewer.answers.put_nowait(Answer.DENY)
    message = await socket.receive(timeout=10)
    assert message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.ERROR)
