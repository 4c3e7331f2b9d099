"""A fake Slack on loopback: the Web API methods egressd calls, and a Socket Mode websocket.

Usage::

    async with FakeSlack() as slack:
        channel = SlackChannel(bot_token=slack.bot_token, app_token=slack.app_token,
                               api_url=slack.api_url, channel="C0APPROVE", approvers=["U0ALICE"])
        ...
        await slack.click(slack.posted[0], "allow", user="U0ALICE")  # over Socket Mode

Web API (``POST``/``GET {api_url}<method>``, token in ``Authorization``):
``auth.test``, ``apps.connections.open`` (answers with the websocket URL),
``chat.postMessage``, ``chat.update``, ``chat.postEphemeral``,
``usergroups.users.list``, ``users.info`` (``names``: user id → display
name; a user not named there has none). Every call is recorded in ``calls`` as
(method, arguments). Knobs: ``rate_limit`` (the next N calls get HTTP 429
with ``Retry-After: 0``), ``down`` (every chat.* call fails with HTTP 503),
``groups`` (user-group id → member ids).

Every message egressd posts or updates is checked against Slack's limits
(``limit_problems``): a message past one is refused the way Slack refuses
it (``invalid_blocks``, ``msg_too_long``, ``msg_blocks_too_long``) and kept
in ``rejected``, so a test fails where real Slack would.

Socket Mode: the websocket at ``/socket`` says ``hello`` and delivers
``interactive`` envelopes with real-shaped ``block_actions`` payloads built
from the buttons of a posted message; ``acks`` collects the envelope ids
egressd acknowledged. Several egressd instances may connect with the same
app token, as with real Slack; ``sockets`` lists them in connection order
and ``click(..., socket=i)`` picks which one gets the click (Slack picks
at random). ``interaction_request`` builds the same payload as a
signed HTTP interactivity request (Slack's v0 signature, computed here).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import WSMsgType, web

BOT_TOKEN = "xoxb-0000-fake-bot"
APP_TOKEN = "xapp-1-fake-app"
SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TEAM = "T0EGRESS"

# Slack's limits (Block Kit reference, chat.postMessage), counted the
# strictest way: in UTF-16 code units, entities as sent.
TEXT_MAX = 3000  # any text object, a section's text included
FIELD_MAX = 2000  # one of a section's fields
HEADER_MAX = 150
BUTTON_TEXT_MAX = 75
BUTTON_VALUE_MAX = 2000
ID_MAX = 255  # block_id, action_id
BLOCKS_MAX = 50
CONTEXT_ELEMENTS_MAX = 10
ACTIONS_ELEMENTS_MAX = 25
# Undocumented: Slack answers msg_blocks_too_long near 13,000 characters of
# block text in all (slackapi/bolt-js#2509); 12,000 is the markdown block's
# documented limit, so that is the bound here.
BLOCKS_TEXT_TOTAL_MAX = 12_000
# Slack's advice for a message's top-level text (past 40,000 it truncates).
MESSAGE_TEXT_MAX = 4000


def units(text: str) -> int:
    """Length in UTF-16 code units (a character outside the BMP counts twice)."""
    return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)


def _text_problems(where: str, obj: Any, limit: int) -> tuple[list[str], int]:
    if not isinstance(obj, dict) or obj.get("type") not in ("plain_text", "mrkdwn"):
        return [f"{where}: not a text object"], 0
    text = obj.get("text")
    if not isinstance(text, str) or not text:
        return [f"{where}: text must be a non-empty string"], 0
    problems = []
    if units(text) > limit:
        problems.append(f"{where}: text is {units(text)} characters, more than {limit}")
    if obj["type"] == "mrkdwn" and "emoji" in obj:
        problems.append(f"{where}: emoji is for plain_text only")
    if obj["type"] == "plain_text" and "verbatim" in obj:
        problems.append(f"{where}: verbatim is for mrkdwn only")
    return problems, units(text)


def limit_problems(args: dict[str, Any]) -> list[str]:
    """Where a chat.postMessage/chat.update call breaks one of Slack's limits (empty: it fits)."""
    problems: list[str] = []
    text = args.get("text")
    if isinstance(text, str) and units(text) > MESSAGE_TEXT_MAX:
        problems.append(f"msg_too_long: text is {units(text)} characters")
    blocks = args.get("blocks")
    if blocks is None:
        return problems
    if isinstance(blocks, str):
        blocks = json.loads(blocks)
    if not isinstance(blocks, list) or len(blocks) > BLOCKS_MAX:
        return [*problems, f"invalid_blocks: blocks must be a list of at most {BLOCKS_MAX}"]
    total = 0

    def check(where: str, obj: Any, limit: int) -> None:
        nonlocal total
        found, length = _text_problems(where, obj, limit)
        problems.extend(f"invalid_blocks: {p}" for p in found)
        total += length

    for i, block in enumerate(blocks):
        kind = block.get("type")
        if len(block.get("block_id", "")) > ID_MAX:
            problems.append(f"invalid_blocks: block {i}: block_id too long")
        if kind == "section":
            if "text" in block:
                check(f"block {i} text", block["text"], TEXT_MAX)
            for j, field in enumerate(block.get("fields") or []):
                check(f"block {i} field {j}", field, FIELD_MAX)
            if "text" not in block and not block.get("fields"):
                problems.append(f"invalid_blocks: block {i}: a section needs text or fields")
        elif kind == "header":
            check(f"block {i} header", block.get("text"), HEADER_MAX)
            if block.get("text", {}).get("type") != "plain_text":
                problems.append(f"invalid_blocks: block {i}: a header is plain_text")
        elif kind == "context":
            elements = block.get("elements") or []
            if not 1 <= len(elements) <= CONTEXT_ELEMENTS_MAX:
                problems.append(f"invalid_blocks: block {i}: 1 to {CONTEXT_ELEMENTS_MAX} context elements")
            for j, element in enumerate(elements):
                check(f"block {i} element {j}", element, TEXT_MAX)
        elif kind == "actions":
            elements = block.get("elements") or []
            if not 1 <= len(elements) <= ACTIONS_ELEMENTS_MAX:
                problems.append(f"invalid_blocks: block {i}: 1 to {ACTIONS_ELEMENTS_MAX} actions")
            for j, element in enumerate(elements):
                check(f"block {i} button {j}", element.get("text"), BUTTON_TEXT_MAX)
                if element.get("text", {}).get("type") != "plain_text":
                    problems.append(f"invalid_blocks: block {i} button {j}: button text is plain_text")
                if units(str(element.get("value", ""))) > BUTTON_VALUE_MAX:
                    problems.append(f"invalid_blocks: block {i} button {j}: value too long")
                if len(element.get("action_id", "")) > ID_MAX:
                    problems.append(f"invalid_blocks: block {i} button {j}: action_id too long")
        elif kind != "divider":
            problems.append(f"invalid_blocks: block {i}: unexpected block type {kind!r}")
    if total > BLOCKS_TEXT_TOTAL_MAX:
        problems.append(f"msg_blocks_too_long: {total} characters of block text")
    return problems


class FakeSlack:
    def __init__(self) -> None:
        self.bot_token = BOT_TOKEN
        self.app_token = APP_TOKEN
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.rate_limit = 0
        self.rate_limited = 0
        self.down = False
        self.groups: dict[str, list[str]] = {}
        self.names: dict[str, str] = {}
        self.acks: list[str] = []
        self.rejected: list[tuple[str, list[str]]] = []
        self.sockets: list[web.WebSocketResponse] = []
        self._changed: asyncio.Condition | None = None
        self._ts = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/"

    def called(self, method: str) -> list[dict[str, Any]]:
        return [args for name, args in self.calls if name == method]

    @property
    def posted(self) -> list[dict[str, Any]]:
        return self.called("chat.postMessage")

    async def __aenter__(self) -> FakeSlack:
        self._changed = asyncio.Condition()
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._api)
        app.router.add_get("/socket", self._socket)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ws in list(self.sockets):
            await ws.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- Web API --------------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        args: dict[str, Any] = dict(request.query)
        if request.content_type == "application/json":
            args.update(await request.json())
        elif request.can_read_body:
            args.update(dict(await request.post()))
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.calls.append((method, args))
        if self.rate_limit > 0:
            self.rate_limit -= 1
            self.rate_limited += 1
            return web.json_response({"ok": False, "error": "ratelimited"}, status=429, headers={"Retry-After": "0"})
        if method == "apps.connections.open":
            if token != self.app_token:
                return web.json_response({"ok": False, "error": "invalid_auth"})
            return web.json_response({"ok": True, "url": f"ws://127.0.0.1:{self.port}/socket?ticket={uuid.uuid4()}"})
        if token != self.bot_token:
            return web.json_response({"ok": False, "error": "invalid_auth"})
        if method.startswith("chat.") and self.down:
            return web.json_response({"ok": False, "error": "service_unavailable"}, status=503)
        if method in ("chat.postMessage", "chat.update", "chat.postEphemeral"):
            problems = limit_problems(args)
            if problems:
                self.rejected.append((method, problems))
                error = problems[0].partition(":")[0]
                return web.json_response({"ok": False, "error": error, "errors": problems})
        if method == "auth.test":
            return web.json_response({"ok": True, "user_id": "U0BOT", "team_id": TEAM, "user": "egressd"})
        if method == "chat.postMessage":
            ts = f"{int(time.time())}.{next(self._ts):06d}"
            args["ts"] = ts
            return web.json_response(
                {"ok": True, "channel": args["channel"], "ts": ts, "message": {"text": args.get("text")}}
            )
        if method in ("chat.update", "chat.postEphemeral"):
            return web.json_response({"ok": True, "channel": args.get("channel"), "ts": args.get("ts", "1.1")})
        if method == "usergroups.users.list":
            group = args.get("usergroup", "")
            if group not in self.groups:
                return web.json_response({"ok": False, "error": "no_such_subteam"})
            return web.json_response({"ok": True, "users": self.groups[group]})
        if method == "users.info":
            user = args.get("user", "")
            display = self.names.get(user, "")
            return web.json_response(
                {
                    "ok": True,
                    "user": {
                        "id": user,
                        "name": user.lower(),
                        "real_name": "",
                        "profile": {"display_name": display, "real_name": ""},
                    },
                }
            )
        return web.json_response({"ok": False, "error": "unknown_method"}, status=404)

    # -- Socket Mode ----------------------------------------------------------------------

    async def _socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        self.sockets.append(ws)
        await self._notify()
        await ws.send_json(
            {
                "type": "hello",
                "num_connections": 1,
                "debug_info": {"host": "fake"},
                "connection_info": {"app_id": "A0EGRESS"},
            }
        )
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    data = json.loads(msg.data)
                    if "envelope_id" in data:
                        self.acks.append(data["envelope_id"])
                        await self._notify()
        finally:
            self.sockets.remove(ws)
        return ws

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        assert self._changed is not None
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(predicate)

    async def wait_connected(self, timeout_s: float = 5.0) -> None:
        await self._until(lambda: bool(self.sockets), timeout_s)

    async def wait_sockets(self, count: int, timeout_s: float = 5.0) -> None:
        await self._until(lambda: len(self.sockets) >= count, timeout_s)

    async def click(
        self,
        message: dict[str, Any],
        action: str,
        *,
        user: str,
        username: str | None = None,
        socket: int = -1,
        timeout_s: float = 5.0,
    ) -> str:
        """Deliver a click on a posted message's button over Socket Mode; wait for egressd's ack.

        ``socket`` picks the connection that gets it (default: the newest).
        """
        payload = block_actions(message, action, user=user, username=username)
        return await self.interact(payload, socket=socket, timeout_s=timeout_s)

    async def interact(self, payload: dict[str, Any], *, socket: int = -1, timeout_s: float = 5.0) -> str:
        """Deliver any interactive payload over Socket Mode connection ``socket``; wait for the ack."""
        await self.wait_connected()
        envelope_id = str(uuid.uuid4())
        await self.sockets[socket].send_json(
            {"envelope_id": envelope_id, "type": "interactive", "accepts_response_payload": False, "payload": payload}
        )
        await self._until(lambda: envelope_id in self.acks, timeout_s)
        return envelope_id


def _button(message: dict[str, Any], action: str) -> tuple[dict[str, Any], str]:
    blocks = message["blocks"]
    if isinstance(blocks, str):
        blocks = json.loads(blocks)
    for block in blocks:
        if block.get("type") == "actions":
            for element in block["elements"]:
                if element["action_id"].endswith(action):
                    return element, block["block_id"]
    raise AssertionError(f"no {action} button in the message")


def block_actions(
    message: dict[str, Any],
    action: str,
    *,
    user: str,
    username: str | None = None,
    channel: str | None = None,
    ts: str | None = None,
) -> dict[str, Any]:
    """A ``block_actions`` payload, shaped like Slack's, for a click on ``action`` (allow|deny).

    ``channel`` and ``ts`` say where the clicked message is (default: where
    ``message`` was posted); a different one is a click on a copy elsewhere.
    """
    button, block_id = _button(message, action)
    name = username or user.lower()
    channel = channel or message["channel"]
    ts = ts or message["ts"]
    return {
        "type": "block_actions",
        "user": {"id": user, "username": name, "name": name, "team_id": TEAM},
        "api_app_id": "A0EGRESS",
        "token": "legacy-verification-token",
        "container": {
            "type": "message",
            "message_ts": ts,
            "channel_id": channel,
            "is_ephemeral": False,
        },
        "trigger_id": "1.2.3",
        "team": {"id": TEAM, "domain": "egressd-test"},
        "enterprise": None,
        "is_enterprise_install": False,
        "channel": {"id": channel, "name": "egress-approvals"},
        "message": {
            "type": "message",
            "ts": ts,
            "text": message.get("text"),
            "blocks": message.get("blocks"),
        },
        "state": {"values": {}},
        "response_url": "https://hooks.slack.com/actions/T0EGRESS/1/fake",
        "actions": [
            {
                "action_id": button["action_id"],
                "block_id": block_id,
                "text": button["text"],
                "value": button["value"],
                "style": button.get("style"),
                "type": "button",
                "action_ts": f"{time.time():.6f}",
            }
        ],
    }


def interaction_request(
    payload: dict[str, Any], *, secret: str = SIGNING_SECRET, timestamp: int | None = None
) -> tuple[bytes, dict[str, str]]:
    """The HTTP interactivity request Slack would send: form-encoded ``payload``, v0 signature."""
    body = urllib.parse.urlencode({"payload": json.dumps(payload)}).encode()
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    mac = hmac.new(secret.encode(), b"v0:" + stamp.encode() + b":" + body, hashlib.sha256).hexdigest()
    return body, {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": f"v0={mac}",
    }
