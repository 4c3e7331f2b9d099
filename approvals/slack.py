"""The Slack channel: a Block Kit message with Allow and Deny buttons, answered by a click.

Out: ``chat.postMessage`` to ``--slack-channel`` with link unfurling off
(otherwise Slack itself would fetch the held domain) and every piece of
agent-controlled text escaped for mrkdwn (``&``, ``<``, ``>``: no links,
mentions or ``<!channel>`` pings can be smuggled in). After the decision the
message is replaced (``chat.update``): "Allowed by @who at HH:MM for run
r-…", or "Expired — denied".

Back: ``block_actions`` payloads, through Socket Mode (``--slack-app-token``,
no public URL needed) and/or the HTTP interactivity endpoint
``POST {--public-url}/approvals/slack``, which checks Slack's signature and
timestamp (``--slack-signing-secret``) before reading anything. Only the
user ids in ``--slack-approvers`` (U…/W…) or members of the user groups
named there (S…) may answer; anyone else gets an ephemeral refusal and the
approval stays open.

Every Web API call goes through slack-sdk's retry handlers: connection
errors, rate limits (HTTP 429 with Retry-After; not on by default) and 500/
503. The broker bounds each call by the approval's deadline, so a Slack
outage ends in a denial, never an allow. egressd's own Slack traffic ignores
the proxy environment variables.

The message builders at the top are pure; ``SlackChannel`` is the shell.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_async_handlers import (
    AsyncConnectionErrorRetryHandler,
    AsyncRateLimitErrorRetryHandler,
    AsyncServerErrorRetryHandler,
)
from slack_sdk.http_retry.builtin_interval_calculators import BackoffRetryIntervalCalculator
from slack_sdk.signature import Clock, SignatureVerifier
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.socket_mode.async_client import AsyncBaseSocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.socket_mode.response import SocketModeResponse
from slack_sdk.web.async_client import AsyncWebClient

from .interface import (
    Answerer,
    AnswerResult,
    ChannelError,
    Decision,
    PendingApproval,
    Route,
    Settlement,
    SetupError,
)
from .message import bounded, settled_text

log = logging.getLogger("egressd.approvals.slack")
# slack-sdk logs every retry at INFO unless its logger has a level of its own
# ("logger.level <= DEBUG"); egressd says what matters itself.
_sdk_log = logging.getLogger("egressd.approvals.slack.sdk")
_sdk_log.setLevel(logging.INFO)

INTERACTIVITY_PATH = "/approvals/slack"
ALLOW_ACTION = "egressd_allow"
DENY_ACTION = "egressd_deny"
_ACTIONS = {ALLOW_ACTION: Decision.ALLOW, DENY_ACTION: Decision.DENY}
# One Web API call (each retry included) within this, unless the deadline is nearer.
REQUEST_TIMEOUT_S = 10
# Slack wants an interactivity response within 3 s.
INTERACTION_BUDGET_S = 2.5
# User-group membership is looked up on a click and kept this long.
GROUP_CACHE_S = 60.0
# Interactivity payloads are a few KiB; a button click never needs more.
MAX_PAYLOAD_BYTES = 256 * 1024
_USER_ID = re.compile(r"\(([UW][A-Z0-9]{2,})\)$|^([UW][A-Z0-9]{2,})$")


# -- pure: text and blocks --------------------------------------------------------------


def escape_mrkdwn(text: str) -> str:
    """Slack's three control characters as entities (Slack's "Escaping text" rules)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _clock_text(at: float) -> str:
    """HH:MM in the reader's own time zone, with a UTC fallback for old clients."""
    fallback = time.strftime("%H:%M UTC", time.gmtime(at))
    return f"<!date^{int(at)}^{{time}}|{fallback}>"


def _who(settlement: Settlement) -> str:
    by = settlement.by or "someone"
    match = _USER_ID.search(by) if settlement.channel == "slack" else None
    if match:
        return f"<@{match.group(1) or match.group(2)}>"
    return f"{escape_mrkdwn(by)} (via {escape_mrkdwn(settlement.channel or '?')})"


def fallback_text(approval: PendingApproval) -> str:
    """The notification text (shown where blocks are not)."""
    return escape_mrkdwn(f"egressd: run {approval.request.run_id} asks to reach {approval.message.domain}")


def _message_text(approval: PendingApproval, *, closing: bool) -> str:
    lines = []
    for kind, text in approval.message.lines:
        shown = escape_mrkdwn(text)
        if kind == "domain":
            lines.append(f"*{shown}*")
        elif kind == "unrelated":
            lines.append(f":warning: *{shown}*")
        elif kind == "closing" and not closing:
            continue
        else:
            lines.append(shown)
    return "\n".join(lines)


def request_blocks(approval: PendingApproval) -> list[dict[str, Any]]:
    """The approval message with its Allow and Deny buttons."""
    run = escape_mrkdwn(bounded(approval.request.run_id, 64))
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": _message_text(approval, closing=True)}},
        {
            "type": "context",
            "elements": [
                {
                    "type": "mrkdwn",
                    "text": f"approval `{approval.id}` · run `{run}` · expires at {_clock_text(approval.expires_at)}",
                }
            ],
        },
        {
            "type": "actions",
            "block_id": f"egressd:{approval.id}",
            "elements": [
                {
                    "type": "button",
                    "action_id": ALLOW_ACTION,
                    "text": {"type": "plain_text", "text": "Allow (this run only)"},
                    "style": "primary",
                    "value": approval.id,
                },
                {
                    "type": "button",
                    "action_id": DENY_ACTION,
                    "text": {"type": "plain_text", "text": "Deny"},
                    "style": "danger",
                    "value": approval.id,
                },
            ],
        },
    ]


def outcome_text(approval: PendingApproval, settlement: Settlement) -> str:
    """The line that replaces the buttons."""
    run = escape_mrkdwn(bounded(approval.request.run_id, 64))
    at = _clock_text(settlement.at)
    if settlement.channel is not None:
        verb = "Allowed" if settlement.reason is None else "Denied"
        return f"*{verb}* by {_who(settlement)} at {at} for run `{run}`"
    if settlement.reason == "approval_timeout":
        return f"*Expired — denied* at {at} (run `{run}`)"
    return f"*Denied* at {at}: nobody could answer (egressd stopped, or no channel could deliver) (run `{run}`)"


def settled_blocks(approval: PendingApproval, settlement: Settlement) -> list[dict[str, Any]]:
    """The message as it stays after the decision: no buttons, the outcome instead."""
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": _message_text(approval, closing=False)}},
        {"type": "section", "text": {"type": "mrkdwn", "text": outcome_text(approval, settlement)}},
        {"type": "context", "elements": [{"type": "mrkdwn", "text": f"approval `{approval.id}`"}]},
    ]


def _actor(payload: dict[str, Any]) -> tuple[str | None, str | None]:
    user = payload.get("user")
    if not isinstance(user, dict):
        return None, None
    user_id = user.get("id")
    name = user.get("username") or user.get("name")
    return (user_id if isinstance(user_id, str) else None), (name if isinstance(name, str) else None)


class _InjectedClock(Clock):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def now(self) -> float:
        return self._clock()


# -- the shell ---------------------------------------------------------------------------


class SlackChannel:
    """The module docstring, as a ``Channel``."""

    name = "slack"

    def __init__(
        self,
        *,
        bot_token: str,
        channel: str,
        approvers: Sequence[str],
        app_token: str | None = None,
        signing_secret: str | None = None,
        api_url: str | None = None,
        clock: Callable[[], float] = time.time,
        request_timeout_s: int = REQUEST_TIMEOUT_S,
        group_cache_s: float = GROUP_CACHE_S,
        ping_interval_s: float = 5.0,
        retry_backoff_s: float = 0.5,
    ) -> None:
        if not approvers:
            raise SetupError(
                "bad setting slack_approvers: name the Slack user ids (U…) or user groups (S…) who may answer"
            )
        bad = [a for a in approvers if not re.fullmatch(r"[UWS][A-Z0-9]{2,}", a)]
        if bad:
            raise SetupError(
                f"bad setting slack_approvers: {', '.join(map(repr, bad))} is not a user (U…/W…) or user-group (S…) id"
            )
        if app_token is None and signing_secret is None:
            raise SetupError(
                "bad setting slack_app_token: Slack answers need slack_app_token (Socket Mode) "
                "or slack_signing_secret (the HTTP interactivity endpoint)"
            )
        self.channel = channel
        self._bot_token = bot_token
        self._app_token = app_token
        self._users = frozenset(a for a in approvers if a[0] in "UW")
        self._groups = tuple(a for a in approvers if a[0] == "S")
        self._api_url = api_url or AsyncWebClient.BASE_URL
        self._clock = clock
        self._request_timeout_s = request_timeout_s
        self._group_cache_s = group_cache_s
        self._ping_interval_s = ping_interval_s
        self._retry_backoff_s = retry_backoff_s
        self._verifier = SignatureVerifier(signing_secret, clock=_InjectedClock(clock)) if signing_secret else None
        self._session: aiohttp.ClientSession | None = None
        self._web: AsyncWebClient | None = None
        self._socket: SocketModeClient | None = None
        self._answerer: Answerer | None = None
        self._posted: dict[str, tuple[str, str]] = {}
        self._group_members: dict[str, tuple[float, frozenset[str]]] = {}

    # -- lifetime -----------------------------------------------------------------

    async def start(self, answerer: Answerer) -> None:
        """Check the bot token (``auth.test``) and connect Socket Mode; SetupError when Slack refuses."""
        try:
            await self._start(answerer)
        except BaseException:
            await self.close()
            raise

    async def _start(self, answerer: Answerer) -> None:
        self._answerer = answerer
        self._session = aiohttp.ClientSession(
            trust_env=False, timeout=aiohttp.ClientTimeout(total=self._request_timeout_s)
        )
        backoff = BackoffRetryIntervalCalculator(backoff_factor=self._retry_backoff_s)
        self._web = AsyncWebClient(
            token=self._bot_token,
            base_url=self._api_url,
            session=self._session,
            timeout=self._request_timeout_s,
            logger=_sdk_log,
            # Rate limits wait Retry-After; the others back off from retry_backoff_s.
            retry_handlers=[
                AsyncConnectionErrorRetryHandler(max_retry_count=2, interval_calculator=backoff),
                AsyncRateLimitErrorRetryHandler(max_retry_count=5),
                AsyncServerErrorRetryHandler(max_retry_count=2, interval_calculator=backoff),
            ],
        )
        # slack-sdk reads HTTPS_PROXY and friends when no proxy is given;
        # egressd's own traffic must not go through whatever proxy the
        # environment names (possibly egressd itself).
        self._web.proxy = None
        try:
            await self._web.auth_test()
        except SlackApiError as exc:
            raise SetupError(f"bad setting slack_bot_token: Slack refused it ({_slack_error(exc)})") from None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SetupError(f"bad setting slack_api_url: cannot reach Slack at {self._api_url}: {exc}") from None
        if self._app_token is not None:
            await self._connect_socket_mode(self._app_token)

    async def _connect_socket_mode(self, app_token: str) -> None:
        assert self._web is not None
        socket = SocketModeClient(
            app_token=app_token, web_client=self._web, ping_interval=self._ping_interval_s, logger=_sdk_log
        )
        socket.proxy = None  # as for the Web API client
        socket.socket_mode_request_listeners.append(self._on_socket_request)
        self._socket = socket
        try:
            socket.wss_uri = await socket.issue_new_wss_url()
        except SlackApiError as exc:
            raise SetupError(f"bad setting slack_app_token: Slack refused it ({_slack_error(exc)})") from None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise SetupError(f"bad setting slack_app_token: cannot open Socket Mode: {exc}") from None
        await socket.connect()

    async def close(self) -> None:
        if self._socket is not None:
            await self._socket.close()
            self._socket = None
            await asyncio.sleep(0)  # let the client's cancelled tasks finish
        if self._session is not None:
            await self._session.close()
            self._session = None

    def routes(self) -> Sequence[Route]:
        if self._verifier is None:
            return []
        return [Route("POST", INTERACTIVITY_PATH, self._interactivity, public=True)]

    # -- the Channel --------------------------------------------------------------

    async def deliver(self, approval: PendingApproval) -> None:
        if self._web is None:
            raise ChannelError("the Slack channel is not started")
        try:
            response = await self._web.chat_postMessage(
                channel=self.channel,
                text=fallback_text(approval),
                blocks=request_blocks(approval),
                unfurl_links=False,
                unfurl_media=False,
            )
        except SlackApiError as exc:
            raise ChannelError(f"chat.postMessage failed: {_slack_error(exc)}") from None
        self._posted[approval.id] = (str(response.get("channel") or self.channel), str(response["ts"]))

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        posted = self._posted.pop(approval.id, None)
        if posted is None or self._web is None:
            return
        channel, ts = posted
        try:
            await self._web.chat_update(
                channel=channel,
                ts=ts,
                text=f"{fallback_text(approval)}: {escape_mrkdwn(settled_text(settlement))}",
                blocks=settled_blocks(approval, settlement),
            )
        except SlackApiError as exc:
            raise ChannelError(f"chat.update failed: {_slack_error(exc)}") from None

    # -- clicks -------------------------------------------------------------------

    async def _on_socket_request(self, client: AsyncBaseSocketModeClient, request: SocketModeRequest) -> None:
        # Acknowledge first: Slack retries an envelope that is not acknowledged within 3 s.
        await client.send_socket_mode_response(SocketModeResponse(envelope_id=request.envelope_id))
        if request.type == "interactive":
            await self._on_interaction(request.payload)

    async def _interactivity(self, request: web.Request) -> web.Response:
        """The HTTP interactivity endpoint: Slack's signature first, then the payload."""
        assert self._verifier is not None
        try:
            async with asyncio.timeout(INTERACTION_BUDGET_S):
                body = await request.content.read(MAX_PAYLOAD_BYTES + 1)
        except TimeoutError:
            return web.Response(status=408)
        if len(body) > MAX_PAYLOAD_BYTES:
            return web.Response(status=413)
        try:
            valid = self._verifier.is_valid_request(body, dict(request.headers))
        except (ValueError, UnicodeDecodeError):
            valid = False
        if not valid:
            log.warning("Slack interactivity request from %s rejected: bad or stale signature", request.remote or "-")
            return web.Response(status=401, text="bad signature")
        try:
            form = urllib.parse.parse_qs(body.decode("utf-8"))
            payload = json.loads(form["payload"][0])
        except (KeyError, IndexError, UnicodeDecodeError, json.JSONDecodeError):
            return web.Response(status=400, text="no payload")
        if isinstance(payload, dict):
            await self._on_interaction(payload)
        return web.Response(status=200)

    async def _on_interaction(self, payload: dict[str, Any]) -> None:
        """A click: check who, pass the answer on, tell the clicker when it did not count."""
        try:
            async with asyncio.timeout(INTERACTION_BUDGET_S):
                await self._handle(payload)
        except Exception:
            # Fail closed: a click we could not handle answers nothing.
            log.exception("Slack interaction could not be handled")

    async def _handle(self, payload: dict[str, Any]) -> None:
        if payload.get("type") != "block_actions" or self._answerer is None:
            return
        user_id, name = _actor(payload)
        where = payload.get("channel") if isinstance(payload.get("channel"), dict) else {}
        channel_id = where.get("id") if isinstance(where.get("id"), str) else self.channel
        for action in payload.get("actions") or []:
            if not isinstance(action, dict) or action.get("action_id") not in _ACTIONS:
                continue
            approval_id = action.get("value")
            if user_id is None or not isinstance(approval_id, str):
                return
            if not await self._may_answer(user_id):
                log.warning(
                    "Slack user %s may not answer approvals; %s stays open",
                    bounded(user_id, 40),
                    bounded(approval_id, 40),
                )
                await self._ephemeral(
                    channel_id,
                    user_id,
                    "You are not one of egressd's approvers, so your click did not count. "
                    "The request stays open for an approver.",
                )
                return
            by = f"@{name} ({user_id})" if name else user_id
            answered = self._answerer.answer(approval_id, _ACTIONS[action["action_id"]], channel=self.name, by=by)
            if answered.result is not AnswerResult.ACCEPTED:
                how = settled_text(answered.settlement) if answered.settlement else "it is no longer pending"
                await self._ephemeral(
                    channel_id, user_id, f"Too late: this request was already settled ({escape_mrkdwn(how)})."
                )
            return

    async def _may_answer(self, user_id: str) -> bool:
        if user_id in self._users:
            return True
        for group in self._groups:
            if user_id in await self._members(group):
                return True
        return False

    async def _members(self, group: str) -> frozenset[str]:
        now = self._clock()
        cached = self._group_members.get(group)
        if cached is not None and now - cached[0] < self._group_cache_s:
            return cached[1]
        if self._web is None:
            return frozenset()
        try:
            response = await self._web.usergroups_users_list(usergroup=group)
            members = frozenset(u for u in response.get("users") or [] if isinstance(u, str))
        except (SlackApiError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("cannot read the members of Slack user group %s: %s", group, exc)
            return frozenset()  # fail closed: nobody from this group
        self._group_members[group] = (now, members)
        return members

    async def _ephemeral(self, channel: str, user: str, text: str) -> None:
        if self._web is None:
            return
        try:
            await self._web.chat_postEphemeral(channel=channel, user=user, text=text)
        except (SlackApiError, aiohttp.ClientError, OSError) as exc:
            log.warning("cannot send an ephemeral message to %s: %s", bounded(user, 40), exc)


def _slack_error(exc: SlackApiError) -> str:
    response = getattr(exc, "response", None)
    try:
        error = response.get("error") if response is not None else None
    except (AttributeError, TypeError):
        error = None
    return str(error or exc)
