"""The webhook channel: a signed POST per approval, the answer in the response or a signed callback.

Out (DESIGN.md, "Channels"): ``POST --webhook-url`` with the approval as JSON
(``type: approval.requested``, id, run, host, port, command, task, allowed,
unrelated, message, expires_at, callback_url, then ``scopes``: the scopes an
allow may choose, ``["once", "run"]`` plus ``"always"`` when egressd has an
allowlist file), signed the Standard Webhooks
way with ``--webhook-secret``. Retried with exponential backoff (and the same
``webhook-id``, re-signed with a fresh timestamp) on network errors, 5xx, 408,
425 and 429, until the approval expires; any other 4xx means the receiver
refuses: delivery failed.

Back, either way:

- at once: a 2xx response whose JSON body is ``{"decision": "allow"|"deny"}``
  (optionally ``"by"`` and ``"scope"``); any other 2xx means "delivered, the
  answer comes later";
- later: ``POST {--public-url}/approvals/webhook`` with ``{"id", "decision",
  "by", "scope"}``, signed with ``--webhook-callback-secret`` (a separate key) and a
  fresh ``webhook-id``. Unsigned, badly signed, stale and replayed callbacks
  are refused (401/409) and logged.

``scope`` is ``once|run|always`` (missing or null: ``run``); any other value
is no answer (400 on the callback), and one the approval does not offer
(``always`` without ``--allow-file``) decides nothing (422 on the callback;
logged and ignored in a response): the approval stays open. The route answers POST only: nothing is
  decided by a GET (link previewers open links).

When every client waiting for an approval gave up, one best-effort
``approval.abandoned`` event is POSTed (the approval stays answerable); when
the approval is settled, one best-effort ``approval.settled`` event is
POSTed too, so the receiver can close its own prompt; a notice (a run
stopped asking) is one best-effort ``run.stopped_asking`` event.

The answer in the response is not signed (Standard Webhooks signs requests
only), so it counts only when nobody on the wire could have written it:
over https, or plain http to a loopback address (``egressd.config.settings.
protected_url``). Settings refuse any other URL unless
``unsafe_webhook_http`` is set; with it, such answers are ignored and only
the signed callback (or the control API) can answer.

egressd's own traffic never takes the proxy settings from the environment
(``trust_env=False``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from egressd.audit.records import rfc3339
from egressd.config.settings import protected_url
from egressd.vocabulary.egress import Decision

from .interface import (
    Answerer,
    AnswerResult,
    ApprovalScope,
    ChannelError,
    Choice,
    Elsewhere,
    Notice,
    PendingApproval,
    Route,
    Settlement,
    SetupError,
    parse_scope,
)
from .message import ABANDONED_TEXT, bounded
from .signing import ReplayGuard, VerifyError, signed_headers, verify

log = logging.getLogger("egressd.approvals.webhook")

CALLBACK_PATH = "/approvals/webhook"
# Backoff between attempts: 1 s doubling to 30 s, so a receiver that comes
# back is reached within half a minute while the approval is still open.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# One attempt may take this long (an immediate answer may need a person).
ATTEMPT_TIMEOUT_S = 30.0
# Statuses worth retrying: the receiver is busy or briefly broken (RFC 9110 §15.5.9, §15.6; RFC 8470 §5.2; RFC 6585 §4).
_RETRY_STATUSES = frozenset({408, 425, 429})
# Responses and callbacks are small JSON objects, sent at once.
MAX_BODY_BYTES = 64 * 1024
BODY_TIMEOUT_S = 10.0


def new_message_id() -> str:
    return "msg_" + secrets.token_urlsafe(18)


def request_payload(approval: PendingApproval, callback_url: str | None) -> dict[str, Any]:
    """The ``approval.requested`` body (DESIGN.md): raw values, plus the rendered, escaped message."""
    payload = {"type": "approval.requested", **approval.fields(), "callback_url": callback_url}
    payload["scopes"] = payload.pop("scopes")  # after the design's keys: the scopes an answer may choose
    return payload


def settled_payload(approval: PendingApproval, settlement: Settlement) -> dict[str, Any]:
    return {
        "type": "approval.settled",
        "id": approval.id,
        "run": approval.request.run_id,
        "decision": Decision.ALLOW if settlement.reason is None else Decision.DENY,
        "reason": settlement.reason.value if settlement.reason is not None else None,
        "channel": settlement.channel,
        "by": settlement.by,
        "at": rfc3339(settlement.at),
        "scope": settlement.scope.value if settlement.scope is not None else None,
        "entry": settlement.entry,
    }


def abandoned_payload(approval: PendingApproval, at: float) -> dict[str, Any]:
    """The ``approval.abandoned`` body: every waiting client gave up; an answer still applies to the run."""
    request = approval.request
    return {
        "type": "approval.abandoned",
        "id": approval.id,
        "run": request.run_id,
        "host": request.host,
        "port": request.port,
        "message": ABANDONED_TEXT,
        "waited_s": round(max(0.0, at - approval.created_at), 3),
        "at": rfc3339(at),
        "expires_at": rfc3339(approval.expires_at),
    }


def parse_answer(body: bytes) -> tuple[Choice, str | None, ApprovalScope] | None:
    """``{"decision": "allow"|"deny", "by"?: str, "scope"?: "once"|"run"|"always"}`` → (decision, by, scope).

    None when the body holds no answer, or a scope that is not one of the
    three (garbage never decides anything); a missing or null scope is
    ``run``; a denial's scope is not looked at.
    """
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        decision = Choice(data.get("decision"))
    except ValueError:
        return None
    scope = ApprovalScope.RUN
    if decision is Choice.ALLOW and data.get("scope") is not None:
        parsed = parse_scope(data["scope"])
        if parsed is None:
            return None
        scope = parsed
    by = data.get("by")
    return decision, by if isinstance(by, str) and by.strip() else None, scope


class WebhookChannel:
    """The module docstring, as a ``Channel``."""

    name = "webhook"

    def __init__(
        self,
        *,
        url: str,
        secret: bytes,
        callback_secret: bytes | None = None,
        public_url: str | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_message_id,
        backoff_first_s: float = BACKOFF_FIRST_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        attempt_timeout_s: float = ATTEMPT_TIMEOUT_S,
    ) -> None:
        if callback_secret is not None and callback_secret == secret:
            raise SetupError("bad setting webhook_callback_secret: must differ from webhook_secret")
        self.url = url
        self.answers_in_response = protected_url(url)
        self._secret = secret
        self._callback_secret = callback_secret
        self.callback_url = (
            public_url.rstrip("/") + CALLBACK_PATH if public_url is not None and callback_secret is not None else None
        )
        self._clock = clock
        self._new_id = new_id
        self._backoff_first_s = backoff_first_s
        self._backoff_max_s = backoff_max_s
        self._attempt_timeout_s = attempt_timeout_s
        self._replays = ReplayGuard()
        self._session: aiohttp.ClientSession | None = None
        self._answerer: Answerer | None = None
        # In a fleet (serve --state): a callback for an approval another instance holds (one callback URL
        # for the fleet, behind a load balancer) is passed to that instance, which decides. Set by assembly.
        self.elsewhere: Elsewhere | None = None

    async def start(self, answerer: Answerer) -> None:
        self._answerer = answerer
        self._session = aiohttp.ClientSession(trust_env=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def routes(self) -> Sequence[Route]:
        if self._callback_secret is None:
            return []
        return [Route("POST", CALLBACK_PATH, self._callback, public=True)]

    # -- out ----------------------------------------------------------------------

    async def deliver(self, approval: PendingApproval) -> None:
        """POST until a 2xx (an answer in it is passed on), a refusal, or the broker's deadline."""
        body = json.dumps(request_payload(approval, self.callback_url)).encode()
        msg_id = self._new_id()
        delay = self._backoff_first_s
        attempt = 0
        # Whether any attempt may have reached the receiver (it answered, or a
        # POST was cut off waiting): then the deadline is a timeout. Only when
        # every attempt failed to connect did the delivery fail for certain
        # (DESIGN.md: that, and only that, is no_approver).
        reached = False
        loop = asyncio.get_running_loop()
        while True:
            attempt += 1
            status, answer_body, retry_after, sent = await self._post(msg_id, body, approval.deadline)
            reached = reached or sent
            if status is not None and 200 <= status < 300:
                self._take_answer(approval, answer_body)
                return
            if status is not None and 400 <= status < 500 and status not in _RETRY_STATUSES:
                raise ChannelError(f"the receiver refused the approval with HTTP {status}")
            wait = min(self._backoff_max_s, max(delay, retry_after or 0.0))
            if not reached and loop.time() + wait >= approval.deadline:
                raise ChannelError("the receiver could not be reached before the approval expired")
            log.info(
                "approval %s: webhook attempt %d failed (%s); retrying in %.1fs",
                approval.id,
                attempt,
                status if status is not None else "no response",
                wait,
            )
            await asyncio.sleep(wait)
            delay = min(self._backoff_max_s, delay * 2)

    async def _post(self, msg_id: str, body: bytes, deadline: float) -> tuple[int | None, bytes, float | None, bool]:
        """One signed attempt: (status or None, response body, Retry-After seconds, maybe reached).

        "Maybe reached" is False only when the connection itself failed.
        """
        if self._session is None:
            raise ChannelError("the webhook channel is closed")
        headers = signed_headers(self._secret, msg_id, int(self._clock()), body)
        headers["content-type"] = "application/json"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(min(deadline, loop.time() + self._attempt_timeout_s)):
                async with self._session.post(self.url, data=body, headers=headers, allow_redirects=False) as resp:
                    answer = await resp.content.read(MAX_BODY_BYTES)
                    retry_after = resp.headers.get("Retry-After", "")
                    return resp.status, answer, float(retry_after) if retry_after.isdigit() else None, True
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            connected = not isinstance(exc, (aiohttp.ClientConnectorError, ConnectionRefusedError))
            if loop.time() >= deadline:
                if not connected:
                    raise ChannelError(f"the receiver could not be reached: {exc}") from exc
                raise
            log.debug("webhook POST failed: %s", exc)
            return None, b"", None, connected

    def _take_answer(self, approval: PendingApproval, body: bytes) -> None:
        answer = parse_answer(body) if body else None
        if answer is None or self._answerer is None:
            return
        if not self.answers_in_response:
            log.warning(
                "approval %s: ignoring the answer in the webhook's response: it came over plain http "
                "off loopback, where anyone on the path could have written it; answer by the callback",
                approval.id,
            )
            return
        decision, by, scope = answer
        answered = self._answerer.answer(approval.id, decision, channel=self.name, by=by or "webhook", scope=scope)
        if answered.result is AnswerResult.NOT_OFFERED:
            log.warning(
                "approval %s: the webhook's answer asked for scope %s, which is not offered; it stays open",
                approval.id,
                scope.value,
            )
        elif answered.result is not AnswerResult.ACCEPTED:
            log.info("approval %s: the webhook's answer came too late (%s)", approval.id, answered.result.value)

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        """One signed ``approval.settled`` POST; failures only logged (the broker bounds it)."""
        body = json.dumps(settled_payload(approval, settlement)).encode()
        status, _, _, _ = await self._post(
            self._new_id(), body, asyncio.get_running_loop().time() + self._attempt_timeout_s
        )
        if status is None or not 200 <= status < 300:
            log.info("approval %s: the webhook did not take the settlement (%s)", approval.id, status)

    async def abandoned(self, approval: PendingApproval) -> None:
        """One signed ``approval.abandoned`` POST; failures only logged (the broker bounds it)."""
        body = json.dumps(abandoned_payload(approval, self._clock())).encode()
        status, _, _, _ = await self._post(
            self._new_id(), body, asyncio.get_running_loop().time() + self._attempt_timeout_s
        )
        if status is None or not 200 <= status < 300:
            log.info("approval %s: the webhook did not take the abandoned event (%s)", approval.id, status)

    async def notify(self, notice: Notice) -> None:
        """One signed notice event (``run.stopped_asking``); failures only logged (the broker bounds it)."""
        body = json.dumps(notice.fields()).encode()
        status, _, _, _ = await self._post(
            self._new_id(), body, asyncio.get_running_loop().time() + self._attempt_timeout_s
        )
        if status is None or not 200 <= status < 300:
            log.info("the webhook did not take the %s notice (%s)", notice.kind.value, status)

    # -- back ---------------------------------------------------------------------

    async def _callback(self, request: web.Request) -> web.Response:
        """The signed callback: verify, refuse replays, then answer once."""
        assert self._callback_secret is not None
        peer = request.remote or "-"
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                body = await request.content.read(MAX_BODY_BYTES + 1)
        except TimeoutError:
            return web.json_response({"error": "body too slow"}, status=408)
        if len(body) > MAX_BODY_BYTES:
            return web.json_response({"error": "body too large"}, status=413)
        now = self._clock()
        try:
            msg_id = verify(self._callback_secret, request.headers, body, now=now)
        except VerifyError as exc:
            log.warning("webhook callback from %s rejected: %s", peer, exc.reason)
            return web.json_response({"error": f"rejected: {exc.reason}"}, status=401)
        if not self._replays.first_sighting(msg_id, now=now):
            log.warning("webhook callback from %s rejected: replayed webhook-id %s", peer, bounded(msg_id, 80))
            return web.json_response({"error": "rejected: replayed webhook-id"}, status=409)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        answer = parse_answer(body)
        if not isinstance(data, dict) or not isinstance(data.get("id"), str) or answer is None:
            return web.json_response(
                {"error": 'expected {"id", "decision": "allow"|"deny", "by", "scope"?: "once"|"run"|"always"}'},
                status=400,
            )
        if self._answerer is None:
            return web.json_response({"error": "not started"}, status=503)
        decision, by, scope = answer
        answered = self._answerer.answer(data["id"], decision, channel=self.name, by=by or "webhook", scope=scope)
        if answered.result is AnswerResult.UNKNOWN and self.elsewhere is not None:
            try:
                if await self.elsewhere.run_of(data["id"]) is not None:
                    answered = await self.elsewhere.answer(data["id"], decision, channel=self.name,
                                                           by=by or "webhook", scope=scope, auth=None)  # fmt: skip
            except ChannelError as exc:
                return web.json_response({"error": str(exc)}, status=503)
            if answered.result is AnswerResult.NOT_APPLIED:
                return web.json_response({"error": "another instance of the fleet holds it and did not take the "
                                                   "answer in time: nothing was decided; send it again"},
                                         status=503)  # fmt: skip
        if answered.result is AnswerResult.NOT_OFFERED:
            log.warning(
                "webhook callback from %s for %s refused: scope %s is not offered",
                peer,
                bounded(data["id"], 80),
                scope.value,
            )
            return web.json_response({"error": f"scope {scope.value} is not offered for this approval"}, status=422)
        if answered.result is AnswerResult.UNKNOWN:
            return web.json_response({"error": "no such pending approval"}, status=404)
        if answered.result is AnswerResult.SETTLED:
            log.warning("webhook callback from %s for %s refused: already settled", peer, bounded(data["id"], 80))
            return web.json_response({"error": "already settled"}, status=409)
        settlement = answered.settlement
        return web.json_response(
            {
                "id": data["id"],
                "decision": decision.value,
                "scope": settlement.scope.value if settlement is not None and settlement.scope is not None else None,
            }
        )
