"""A webhook receiver on loopback, as a customer would write one, for the webhook channel's tests.

It checks every POST's Standard Webhooks signature with its own code (not
egressd's), records what arrived, and answers the way ``mode`` says:

- ``"now"``     200 ``{"decision": decision, "by": "hook-bot"}``
- ``"later"``   202; the test answers later with ``callback(...)``
- ``"never"``   202, and nobody ever calls back
- ``"refuse"``  403
- ``"garbage"`` 200 with a body that holds no answer
- ``"hang"``    never answers the POST at all (held until the receiver stops)

``fail_first=N`` answers the first N requests 503 (a receiver briefly down).
``approval.settled`` events are acknowledged with 200 and recorded.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web


def make_secret() -> tuple[str, bytes]:
    """A fresh ``whsec_`` secret and its key bytes."""
    key = secrets.token_bytes(24)
    return "whsec_" + base64.b64encode(key).decode(), key


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    payload: dict[str, Any]
    signature_ok: bool


class WebhookReceiver:
    def __init__(
        self, key: bytes, *, callback_key: bytes | None = None, mode: str = "now", decision: str = "allow"
    ) -> None:
        self.key = key
        self.callback_key = callback_key
        self.mode = mode
        self.decision = decision
        # The scope an immediate answer asks for (None: no "scope" field, so "run").
        self.scope: str | None = None
        self.fail_first = 0
        self.received: list[Received] = []
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()
        self.url = ""

    @property
    def requests(self) -> list[Received]:
        """The approval.requested deliveries (retries included)."""
        return [r for r in self.received if r.payload.get("type") == "approval.requested"]

    @property
    def settled(self) -> list[Received]:
        return [r for r in self.received if r.payload.get("type") == "approval.settled"]

    async def __aenter__(self) -> WebhookReceiver:
        app = web.Application()
        app.router.add_post("/hook", self._hook)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/hook"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _hook(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        expected = signature(self.key, headers.get("webhook-id", ""), int(headers.get("webhook-timestamp", "0")), body)
        ok = expected in headers.get("webhook-signature", "").split()
        payload = json.loads(body)
        self.received.append(Received(headers, body, payload, ok))
        if not ok:
            return web.Response(status=401)
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.Response(status=503, headers={"Retry-After": "0"})
        if payload.get("type") == "approval.settled":
            return web.json_response({})
        if self.mode == "now":
            answer = {"decision": self.decision, "by": "hook-bot"}
            if self.scope is not None:
                answer["scope"] = self.scope
            return web.json_response(answer)
        if self.mode == "refuse":
            return web.Response(status=403)
        if self.mode == "garbage":
            return web.Response(status=200, text="thanks!")
        if self.mode == "hang":
            await self._stopping.wait()
        return web.Response(status=202)

    async def callback(
        self,
        approval_id: str,
        decision: str,
        *,
        by: str = "bob",
        key: bytes | None = None,
        msg_id: str | None = None,
        timestamp: int | None = None,
        signed: bool = True,
        body: bytes | None = None,
        url: str | None = None,
        scope: object = None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """POST an answer to the approval's callback_url; returns (status, JSON body, headers sent).

        ``scope`` (anything JSON, garbage included) goes in the answer's ``scope`` field unless None.
        """
        target = url or next(r.payload["callback_url"] for r in self.requests if r.payload["id"] == approval_id)
        answer: dict[str, Any] = {"id": approval_id, "decision": decision, "by": by}
        if scope is not None:
            answer["scope"] = scope
        data = body if body is not None else json.dumps(answer).encode()
        msg_id = msg_id or "msg_" + secrets.token_hex(8)
        timestamp = int(time.time()) if timestamp is None else timestamp
        headers = {"content-type": "application/json"}
        if signed:
            signing_key = key if key is not None else self.callback_key
            assert signing_key is not None
            headers |= {
                "webhook-id": msg_id,
                "webhook-timestamp": str(timestamp),
                "webhook-signature": signature(signing_key, msg_id, timestamp, data),
            }
        return await self.send(target, data, headers)

    @staticmethod
    async def send(
        url: str, data: bytes, headers: dict[str, str], method: str = "POST"
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.request(method, url, data=data, headers=headers) as resp:
                try:
                    answer = await resp.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError):
                    answer = {}
                return resp.status, answer if isinstance(answer, dict) else {}, headers
