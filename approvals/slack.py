"""The Slack channel: a Block Kit message with Allow and Deny buttons, answered by a click.

The buttons: "Allow once" (this connection only), "Allow for this run",
"Allow always" (only when egressd has an allowlist file: the exact
``host:port`` is appended to it) and "Deny"; the scope is the button's
``action_id``. A click whose scope the approval does not offer (a forged or
tampered ``egressd_allow_always``) decides nothing: the clicker is told, the
approval stays open. Who clicked is recorded as ``@Display Name (U…)``, the
display name read with ``users.info`` (the payload's user name if that
fails).

Out: ``chat.postMessage`` to ``--slack-channel`` with link unfurling off
(otherwise Slack itself would fetch the held domain). Nothing the agent
controls is ever Slack markup: it goes into ``plain_text`` objects (where
``*_~``, backticks and ``:emoji:`` are never formatting) or code spans, after
``neutralise`` (visible escapes for invisible characters, Slack's three
control characters as entities, so no link, mention or ``<!channel>``), and
each piece is cut to fit Slack's limits with a visible note, so a long or
escape-heavy command can never make the post fail. Only egressd's own words
are mrkdwn (``verbatim``: Slack links nothing by itself). After the decision
the message is replaced (``chat.update``): "Allowed for this run by @who at
HH:MM for run r-…" (or once, or always with the entry kept), or "Expired —
denied". When every client waiting for it gave up, the
message is updated once to say so, its buttons kept (an answer still
applies to the run's later requests).

Back: ``block_actions`` payloads, through Socket Mode (``--slack-app-token``,
no public URL needed) and/or the HTTP interactivity endpoint
``POST {--public-url}/approvals/slack``, which checks Slack's signature and
timestamp (``--slack-signing-secret``) before reading anything. A click
counts only when (``SlackChannel._click``):

1. its button names this egressd instance (every button's value is
   ``INSTANCE:APPROVAL``): Slack hands a Socket Mode click to any one of the
   instances connected to the app, so another instance's click is answered
   "this approval belongs to another egressd instance", never "too late".
   In a fleet (``serve --state``: ``forward`` is set) it is passed instead to
   the instance that holds the approval, which checks it as its own
   (``forwarded_click``: steps 2 and 3 are the holder's, who posted the
   message) and counts it; so every click counts, whichever instance Slack
   hands it to, and only the holder's message is updated;
2. it comes from the very message (channel and ts) this instance posted for
   that approval, not from a copy elsewhere;
3. the user is in ``--slack-approvers`` (U…/W…) or in a user group named
   there (S…); anyone else gets an ephemeral refusal and the approval stays
   open.

Every Web API call goes through slack-sdk's retry handlers: connection
errors, rate limits (HTTP 429 with Retry-After; not on by default) and 500/
503. The broker bounds each call by the approval's deadline, so a Slack
outage ends in a denial, never an allow. egressd's own Slack traffic ignores
the proxy environment variables.

The messages are built in ``slackblocks`` (pure); ``SlackChannel`` is the shell.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
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
    ApprovalScope,
    ChannelError,
    Choice,
    Notice,
    PendingApproval,
    Route,
    Settlement,
    SetupError,
    settled_text,
)
from .message import bounded
from .slackblocks import (
    ACTIONS,
    FALLBACK_MAX,
    abandoned_blocks,
    code_span,
    fallback_text,
    neutralise,
    notice_blocks,
    parse_button_value,
    request_blocks,
    settled_blocks,
    settled_word,
)
from .slackrelay import SlackRelay

log = logging.getLogger("egressd.approvals.slack")
# slack-sdk logs every retry at INFO unless its logger has a level of its own
# ("logger.level <= DEBUG"); egressd says what matters itself.
_sdk_log = logging.getLogger("egressd.approvals.slack.sdk")
_sdk_log.setLevel(logging.INFO)

INTERACTIVITY_PATH = "/approvals/slack"
# An approver's display name (users.info) is kept this long.
NAME_CACHE_S = 300.0
# One Web API call (each retry included) within this, unless the deadline is nearer.
REQUEST_TIMEOUT_S = 10
# Slack wants an interactivity response within 3 s.
INTERACTION_BUDGET_S = 2.5
# User-group membership is looked up on a click and kept this long.
GROUP_CACHE_S = 60.0
# Interactivity payloads are a few KiB; a button click never needs more.
MAX_PAYLOAD_BYTES = 256 * 1024
# Posted messages remembered (channel, ts) so a click can be checked against
# its message, also after the decision ("too late"); like the ledger's 1000.
REMEMBERED_POSTS = 1000
# An instance name goes into every button value (INSTANCE:APPROVAL), so no colon.
_INSTANCE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _actor(payload: dict[str, Any]) -> tuple[str | None, str | None]:
    user = payload.get("user")
    if not isinstance(user, dict):
        return None, None
    user_id = user.get("id")
    name = user.get("username") or user.get("name")
    return (user_id if isinstance(user_id, str) else None), (name if isinstance(name, str) else None)


def _origin(payload: dict[str, Any]) -> tuple[set[object], set[object]]:
    """Every channel id and message ts a click payload names (container, channel, message)."""

    def part(name: str) -> dict[str, Any]:
        value = payload.get(name)
        return value if isinstance(value, dict) else {}

    container, channel, message = part("container"), part("channel"), part("message")
    channels = {container.get("channel_id"), channel.get("id")} - {None}
    stamps = {container.get("message_ts"), message.get("ts")} - {None}
    return channels, stamps


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
        name_cache_s: float = NAME_CACHE_S,
        ping_interval_s: float = 5.0,
        retry_backoff_s: float = 0.5,
        instance: str | None = None,
    ) -> None:
        if instance is not None and not _INSTANCE.fullmatch(instance):
            raise ValueError(f"instance {instance!r}: 1-64 letters, digits, '.', '_' or '-'")
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
        # Names this egressd in every button, so a click Slack hands to another
        # instance of the same app is told whose it is (module docstring, step 1).
        self.instance = instance or "egressd-" + secrets.token_hex(4)
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
        self._posted: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._group_members: dict[str, tuple[float, frozenset[str]]] = {}
        self._name_cache_s = name_cache_s
        self._names: OrderedDict[str, tuple[float, str]] = OrderedDict()
        # In a fleet (serve --state): passes a click for another instance's approval to the instance that
        # holds it, which checks and counts it as its own (``forwarded_click``); returns why it could not,
        # or None once the holder took it. Set by ``approvals.assembly``.
        self.forward: Callable[[str, dict[str, Any]], Awaitable[str | None]] | None = None
        # In a fleet, with slack_relay: the approvals of instances without Slack, posted and answered here.
        self.relay: SlackRelay | None = None

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
        if self.relay is not None:
            self.relay.start(self._relay_post, self._relay_update)

    async def _relay_post(self, text: str, blocks: list[dict[str, Any]]) -> tuple[str, str]:
        response = await self._post(text, blocks)
        return str(response.get("channel") or self.channel), str(response["ts"])

    async def _relay_update(self, channel: str, ts: str, text: str, blocks: list[dict[str, Any]]) -> None:
        assert self._web is not None
        try:
            await self._web.chat_update(channel=channel, ts=ts, text=text, blocks=blocks, parse="none",
                                        link_names=False)  # fmt: skip
        except SlackApiError as exc:
            raise ChannelError(f"chat.update failed: {_slack_error(exc)}") from None

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
        if self.relay is not None:
            await self.relay.close()
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
        response = await self._post(fallback_text(approval), request_blocks(approval, instance=self.instance))
        self._posted[approval.id] = (str(response.get("channel") or self.channel), str(response["ts"]))
        while len(self._posted) > REMEMBERED_POSTS:
            self._posted.popitem(last=False)

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        posted = self._posted.get(approval.id)  # kept: a late click is still checked against it
        if posted is None or self._web is None:
            return
        channel, ts = posted
        try:
            await self._web.chat_update(
                channel=channel,
                ts=ts,
                text=f"{fallback_text(approval)}: {settled_word(settlement)}",
                blocks=settled_blocks(approval, settlement),
                parse="none",
                link_names=False,
            )
        except SlackApiError as exc:
            raise ChannelError(f"chat.update failed: {_slack_error(exc)}") from None

    async def abandoned(self, approval: PendingApproval) -> None:
        """Update the message once: the client gave up; the buttons stay (a click still counts)."""
        posted = self._posted.get(approval.id)
        if posted is None or self._web is None:
            return
        channel, ts = posted
        try:
            await self._web.chat_update(
                channel=channel,
                ts=ts,
                text=f"{fallback_text(approval)}: the client gave up waiting",
                blocks=abandoned_blocks(approval, instance=self.instance, at=self._clock()),
                parse="none",
                link_names=False,
            )
        except SlackApiError as exc:
            raise ChannelError(f"chat.update failed: {_slack_error(exc)}") from None

    async def notify(self, notice: Notice) -> None:
        """The notice as a message of its own in the approvals channel."""
        if self._web is None:
            raise ChannelError("the Slack channel is not started")
        await self._post(neutralise(notice.text, FALLBACK_MAX), notice_blocks(notice))

    async def _post(self, text: str, blocks: list[dict[str, Any]]) -> Any:
        """Post to the approvals channel with nothing of Slack's own parsing on (no markup, links or unfurls)."""
        assert self._web is not None
        try:
            return await self._web.chat_postMessage(
                channel=self.channel,
                text=text,
                blocks=blocks,
                mrkdwn=False,
                parse="none",
                link_names=False,
                unfurl_links=False,
                unfurl_media=False,
            )
        except SlackApiError as exc:
            raise ChannelError(f"chat.postMessage failed: {_slack_error(exc)}") from None

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
        """A click: check it, pass the answer on, tell the clicker when it did not count."""
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
        channels, stamps = _origin(payload)
        reply_to = next((c for c in channels if isinstance(c, str)), self.channel)
        for action in payload.get("actions") or []:
            if not isinstance(action, dict) or action.get("action_id") not in ACTIONS:
                continue
            value = action.get("value")
            if user_id is None or not isinstance(value, str):
                return
            decision, scope = ACTIONS[action["action_id"]]
            await self._click(value, decision, user_id, name, channels, stamps, reply_to, scope)
            return

    async def _click(
        self,
        value: str,
        decision: Choice,
        user_id: str,
        name: str | None,
        channels: set[object],
        stamps: set[object],
        reply_to: str,
        scope: ApprovalScope = ApprovalScope.RUN,
    ) -> None:
        """Steps 1-3 of the module docstring, then the answer."""
        parsed = parse_button_value(value)
        if parsed is not None and self.relay is not None and self.relay.holds(parsed[1], channels, stamps):
            await self._relayed_click(parsed[1], decision, user_id, name, reply_to, scope)
            return
        if parsed is not None and parsed[0] != self.instance and self.forward is not None:
            click = {"value": value, "decision": decision.value, "user_id": user_id, "name": name,
                     "channels": sorted(map(str, channels)), "stamps": sorted(map(str, stamps)),
                     "reply_to": reply_to, "scope": scope.value}  # fmt: skip
            why = await self.forward(parsed[1], click)
            if why is not None:
                log.warning("Slack click from %s for %s could not be passed to the instance that holds it: %s",
                            bounded(user_id, 40), bounded(parsed[1], 40), why)  # fmt: skip
                await self._ephemeral(reply_to, user_id, f"Your click did not count: {why}")
            return
        if parsed is None or parsed[0] != self.instance:
            owner = parsed[0] if parsed is not None else "an older egressd"
            log.info(
                "Slack click from %s for an approval of another egressd instance (%s); not ours",
                bounded(user_id, 40),
                bounded(owner, 64),
            )
            await self._ephemeral(
                reply_to,
                user_id,
                f"This approval belongs to another egressd instance ({code_span(owner, 80)}), or to this one before "
                f"it restarted, so your click did not count: this instance ({code_span(self.instance, 80)}) cannot "
                "decide it. Slack hands each click to one of the egressd instances connected to the app: click "
                "again, or answer on the instance that owns it (`egressd allow|deny ID`). Each egressd instance "
                "needs a Slack app of its own.",
            )
            return
        approval_id = parsed[1]
        posted = self._posted.get(approval_id)
        if posted is None or channels != {posted[0]} or stamps != {posted[1]}:
            log.warning(
                "Slack click from %s for %s rejected: not from the message egressd posted for it",
                bounded(user_id, 40),
                bounded(approval_id, 40),
            )
            await self._ephemeral(
                reply_to,
                user_id,
                "Your click did not count: it is not from the message egressd posted for this approval "
                "(or the approval is long gone).",
            )
            return
        if not await self._may_answer(user_id):
            log.warning(
                "Slack user %s may not answer approvals; %s stays open",
                bounded(user_id, 40),
                bounded(approval_id, 40),
            )
            await self._ephemeral(
                reply_to,
                user_id,
                "You are not one of egressd's approvers, so your click did not count. "
                "The request stays open for an approver.",
            )
            return
        if self._answerer is None:
            return
        name = await self._display_name(user_id) or name
        if self._answerer is None:
            return
        by = f"@{name} ({user_id})" if name else user_id
        answered = self._answerer.answer(approval_id, decision, channel=self.name, by=by, scope=scope)
        if answered.result is AnswerResult.NOT_OFFERED:
            log.warning(
                "Slack click from %s for %s refused: scope %s is not offered",
                bounded(user_id, 40),
                bounded(approval_id, 40),
                scope.value,
            )
            await self._ephemeral(
                reply_to,
                user_id,
                f"Your click did not count: allowing {scope.value} is not offered for this approval "
                "(egressd has no allow file). The request stays open.",
            )
        elif answered.result is not AnswerResult.ACCEPTED:
            how = settled_text(answered.settlement) if answered.settlement else "it is no longer pending"
            await self._ephemeral(
                reply_to, user_id, f"Too late: this request was already settled ({code_span(how)})."
            )

    async def _relayed_click(self, approval_id: str, decision: Choice, user_id: str, name: str | None,
                             reply_to: str, scope: ApprovalScope) -> None:  # fmt: skip
        """A click on a message relayed here: an approver's is passed to the holder (``approvals.slackrelay``)."""
        assert self.relay is not None
        if not await self._may_answer(user_id):
            await self._ephemeral(reply_to, user_id, "You are not one of egressd's approvers, so your click did not "
                                                     "count. The request stays open for an approver.")  # fmt: skip
            return
        name = await self._display_name(user_id) or name
        why = await self.relay.answer(approval_id, decision, scope, f"@{name} ({user_id})" if name else user_id)
        if why is not None:
            await self._ephemeral(reply_to, user_id, why)

    async def forwarded_click(self, click: dict[str, Any]) -> None:
        """A click another instance of the fleet received for an approval this one holds: checked and counted
        as if Slack had handed it here (steps 1-3 of the module docstring)."""
        try:
            decision, scope = Choice(click["decision"]), ApprovalScope(click["scope"])
            value, user_id, reply_to = str(click["value"]), str(click["user_id"]), str(click["reply_to"])
        except (KeyError, ValueError, TypeError):
            log.warning("a malformed Slack click from another instance of the fleet was ignored")
            return
        name = click.get("name") if isinstance(click.get("name"), str) else None
        channels, stamps = set(click.get("channels") or ()), set(click.get("stamps") or ())
        await self._click(value, decision, user_id, name, channels, stamps, reply_to, scope)

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

    async def _display_name(self, user_id: str) -> str | None:
        """The user's Slack display name (``users.info``), or None; kept ``name_cache_s``."""
        now = self._clock()
        cached = self._names.get(user_id)
        if cached is not None and now - cached[0] < self._name_cache_s:
            return cached[1]
        if self._web is None:
            return None
        try:
            response = await self._web.users_info(user=user_id)
        except (SlackApiError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.info("cannot read the Slack name of %s: %s", bounded(user_id, 40), exc)
            return None
        user = response.get("user")
        if not isinstance(user, dict):
            return None
        profile = user.get("profile")
        if not isinstance(profile, dict):
            profile = {}
        name = next(
            (
                text
                for text in (profile.get("display_name"), profile.get("real_name"), user.get("real_name"))
                if isinstance(text, str) and text.strip()
            ),
            None,
        )
        if name is None:
            return None
        name = bounded(name.strip(), 80)
        self._names[user_id] = (now, name)
        while len(self._names) > REMEMBERED_POSTS:
            self._names.popitem(last=False)
        return name

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
