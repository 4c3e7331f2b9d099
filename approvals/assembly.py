"""From settings to an approver: the one place in this package that knows every channel.

``approver_from_settings`` reads the approval settings (``--approver``,
the channel options, ``approval_timeout``, ``max_pending_approvals``,
``max_approvals_per_run``):

1. no approver named → ``NoApprover`` (every new domain: ``no_approver``);
2. ``deny`` → ``DenyApprover`` (alone: with a channel beside it nobody
   could ever answer, so that is a setting error);
3. otherwise an ``ApprovalBroker`` over the named channels, each checked
   here for what it needs (a webhook secret that is a ``whsec_`` key, a
   Slack channel and approvers, ...), with ``allow_file``, where *always*
   answers go (without one, *always* is not offered). Whether the Slack tokens work is
   checked when the broker starts (``auth.test``).

Any problem is a ``SetupError`` naming the setting. Only ``cli`` calls this;
the broker and the channels never import each other, only this module sees
both.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable

from egressd.audit.log import AuditSink
from egressd.config.allowfile import Approved
from egressd.config.settings import Settings, token_path

from .broker import ApprovalBroker
from .commandoutput import TerminalOutput
from .deny import DenyApprover, NoApprover
from .fleetchannel import FleetChannel
from .interface import Approver, Channel, PendingApproval, Settlement, SetupError
from .signing import SigningError, parse_secret
from .slack import SlackChannel
from .slackrelay import SlackRelay
from .terminal import TerminalChannel
from .web import WebChannel
from .webhook import WebhookChannel


def web_inbox(settings: Settings) -> bool:
    """Whether the approvals page holds what comes while nobody has it open: ``web_inbox``, else on
    when the page is the only approver (with another channel attached, that one is asked meanwhile)."""
    return settings.web_inbox if settings.web_inbox is not None else list(settings.approver) == ["web"]


def _secret(settings: Settings, name: str) -> str | None:
    value = getattr(settings, name)
    return value.get_secret_value() if value is not None else None


def _webhook(settings: Settings, clock: Callable[[], float]) -> WebhookChannel:
    if settings.webhook_url is None:
        raise SetupError("bad setting webhook_url: --approver webhook needs --webhook-url")
    secret = _secret(settings, "webhook_secret")
    if secret is None:
        raise SetupError("bad setting webhook_secret: --approver webhook needs --webhook-secret (a whsec_ key)")
    try:
        key = parse_secret(secret)
    except SigningError as exc:
        raise SetupError(f"bad setting webhook_secret: {exc}") from None
    callback_key = None
    callback = _secret(settings, "webhook_callback_secret")
    if callback is not None:
        try:
            callback_key = parse_secret(callback)
        except SigningError as exc:
            raise SetupError(f"bad setting webhook_callback_secret: {exc}") from None
    return WebhookChannel(
        url=settings.webhook_url,
        secret=key,
        callback_secret=callback_key,
        public_url=settings.public_url,
        clock=clock,
    )


def _slack(settings: Settings, clock: Callable[[], float]) -> SlackChannel:
    token = _secret(settings, "slack_bot_token")
    if token is None:
        raise SetupError("bad setting slack_bot_token: --approver slack needs a bot token (xoxb-…)")
    if not settings.slack_channel:
        raise SetupError("bad setting slack_channel: --approver slack needs the channel id the messages go to")
    return SlackChannel(
        bot_token=token,
        channel=settings.slack_channel,
        approvers=settings.slack_approvers,
        app_token=_secret(settings, "slack_app_token"),
        signing_secret=_secret(settings, "slack_signing_secret"),
        api_url=settings.slack_api_url,
        clock=clock,
    )


def approver_from_settings(
    settings: Settings,
    *,
    audit: AuditSink,
    clock: Callable[[], float] = time.time,
    tty_path: str = "/dev/tty",
    terminal_output: TerminalOutput | None = None,
    fleet_instance: str | None = None,
    keep: Callable[[Approved], None] | None = None,
    share_denial: Callable[[PendingApproval, Settlement], Awaitable[None]] | None = None,
) -> Approver:
    """Steps 1-3 of the module docstring. A returned broker is not started yet.

    ``terminal_output`` is what else is relayed to the terminal (a sandboxed
    command's output): the terminal channel holds it back while it prompts.
    ``fleet_instance``: this egressd's id in its fleet (``serve --state``):
    the fleet is one more channel, and the control API lists and answers
    what the other instances hold; with no other channel, the fleet's people
    answer. ``keep``: where *always* answers are kept instead of the allow
    file (the fleet's rules); ``share_denial``: told each settlement the fleet
    listed (a denial shared with a task or group).
    """
    names = list(settings.approver)
    fleet = None
    if fleet_instance is not None and settings.state is not None and "deny" not in names:
        fleet = FleetChannel(settings.state.get_secret_value(), fleet_instance)
        fleet.shared = share_denial
    if not names and fleet is None:
        return NoApprover()
    if "deny" in names:
        if len(names) > 1:
            others = ", ".join(n for n in names if n != "deny")
            raise SetupError(
                f"bad setting approver: deny answers every request at once, so {others} could never answer"
            )
        return DenyApprover(audit=audit, clock=clock)
    channels: list[Channel] = []
    for name in names:
        if name == "terminal":
            channels.append(TerminalChannel(tty_path=tty_path, clock=clock, output=terminal_output))
        elif name == "slack":
            channels.append(_slack(settings, clock))
        elif name == "webhook":
            channels.append(_webhook(settings, clock))
        elif name == "web":
            written = settings.control_token is None and settings.control_token_file is None
            channels.append(WebChannel(public_url=settings.public_url, clock=clock, inbox=web_inbox(settings),
                                       token_file=str(token_path(settings)) if written else None))
        else:
            raise SetupError(f"bad setting approver: unknown approver {name!r}")
    if fleet is not None:
        channels.append(fleet)
        # Without Slack here, each row carries the message for the instance that relays Slack (slack_relay).
        fleet.stores_slack = not any(isinstance(c, SlackChannel) for c in channels)
        for channel in channels:
            if isinstance(channel, SlackChannel):  # a click Slack hands to this instance for another's approval
                channel.forward = functools.partial(fleet.forward, "slack")
                fleet.handlers["slack"] = channel.forwarded_click
                if settings.slack_relay:
                    channel.relay = SlackRelay(fleet)
            elif isinstance(channel, WebChannel):  # the page shows and answers what the others hold too
                channel.elsewhere = fleet
            elif isinstance(channel, WebhookChannel):  # a callback for another instance's approval goes to it
                channel.elsewhere = fleet
    return ApprovalBroker(
        channels,
        audit=audit,
        timeout_s=settings.approval_timeout,
        max_pending_per_run=settings.max_pending_approvals,
        max_requests_per_run=settings.max_approvals_per_run,
        clock=clock,
        allow_file=settings.allow_file,
        keep=keep,
        elsewhere=fleet,
    )
