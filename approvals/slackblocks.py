"""The Slack channel's messages as Block Kit, and its buttons (pure).

``request_blocks`` is the approval with its buttons (one per offered scope, and
Deny; every value ``INSTANCE:APPROVAL``: ``button_value``), ``settled_blocks``
and ``abandoned_blocks`` replace it, ``notice_blocks`` posts a notice. Nothing the
agent controls is ever Slack markup (``neutralise``, ``plain``), and every piece
is cut to Slack's limits with a visible note. ``egressd.approvals.slack`` posts
them and reads the clicks.
"""

from __future__ import annotations

import re
import time
from typing import Any

from egressd.names.shown import escape, escape_mrkdwn
from egressd.vocabulary.reasons import Answer

from .interface import ApprovalScope, Choice, Notice, PendingApproval, Settlement
from .message import ABANDONED_TEXT

ALLOW_ONCE_ACTION = "egressd_allow_once"
ALLOW_ACTION = "egressd_allow"  # for this run: the button older egressd versions posted
ALLOW_ALWAYS_ACTION = "egressd_allow_always"
DENY_ACTION = "egressd_deny"
# What each button does: its action_id read back from a click.
ACTIONS: dict[str, tuple[Choice, ApprovalScope]] = {
    ALLOW_ONCE_ACTION: (Choice.ALLOW, ApprovalScope.ONCE),
    ALLOW_ACTION: (Choice.ALLOW, ApprovalScope.RUN),
    ALLOW_ALWAYS_ACTION: (Choice.ALLOW, ApprovalScope.ALWAYS),
    DENY_ACTION: (Choice.DENY, ApprovalScope.RUN),
}
# Each offered scope's button: its action and its label (egressd's own words).
_SCOPE_BUTTONS = {
    ApprovalScope.ONCE: (ALLOW_ONCE_ACTION, "Allow once"),
    ApprovalScope.RUN: (ALLOW_ACTION, "Allow for this run"),
    ApprovalScope.ALWAYS: (ALLOW_ALWAYS_ACTION, "Allow always"),
}

# Who answered, read back from a settlement's "by" (@Display Name (U…)) to mention them.
_USER_ID = re.compile(r"\(([UW][A-Z0-9]{2,})\)$|^([UW][A-Z0-9]{2,})$")

# Slack's limits (Block Kit reference: text object, section, button;
# chat.postMessage), counted in UTF-16 code units, the strictest reading.
TEXT_MAX = 3000  # one text object, a section's text included
BUTTON_VALUE_MAX = 2000
# Each line's own budget, so that all of them together stay far inside the
# undocumented total Slack allows a message's blocks (msg_blocks_too_long
# near 13,000 characters: slackapi/bolt-js#2509). The command gets the most.
LINE_BUDGETS = {"domain": 1000, "command": 2900, "task": 1500, "allowed": 1500, "scope": 600}
OTHER_LINE_BUDGET = 600
# A message's top-level text is only its notification: short.
FALLBACK_MAX = 400
# Who answered and which run, inside the outcome line.
SHORT_MAX = 200
# The cut note needs this much room.
MIN_LIMIT = 60
# Lines made of egressd's own words, shown as mrkdwn with emphasis; every
# other kind (domain, command, task, allowed, scope, and any kind added
# later) is plain_text.
_EMPHASIS = {"intro": "*{}*", "unrelated": ":warning: *{}*", "closing": "{}"}
# Text that is inert in mrkdwn as it stands: words and plain punctuation, no
# ":emoji:" pair.
_INERT = re.compile(r"[A-Za-z0-9 ,.;:'()/-]*")
_EMOJI_CODE = re.compile(r":[^\s:]+:")
# A backtick would end a code span; this look-alike cannot.
_BACKTICK_STANDIN = "\u02cb"


def _units(text: str) -> int:
    """Length in UTF-16 code units (a character outside the BMP counts twice)."""
    return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)


def _cut_note(left_out: int) -> str:
    return f"… [cut for Slack: {left_out} more characters]"


def neutralise(text: str, limit: int = TEXT_MAX) -> str:
    """``text`` made inert and visible for any Slack text field, cut to ``limit`` UTF-16 units.

    1. every invisible or control character becomes a visible escape
       (``egressd.names.shown.escape``): nothing hidden, and no line break, so nothing
       can start a quote or a list;
    2. Slack's three control characters become entities (``&amp; &lt;
       &gt;``): no link, mention, ``<!channel>`` or date token;
    3. past ``limit`` the text is cut between two of its characters (never
       inside an escape or an entity) and ends with "… [cut for Slack: N
       more characters]".

    ``*_~``, backticks and ``:emoji:`` stay as they are: the result goes
    into ``plain_text`` (``plain``), where they are never formatting, or into
    a code span (``_code``).
    """
    if limit < MIN_LIMIT:
        raise ValueError(f"limit must be at least {MIN_LIMIT}")
    whole = escape_mrkdwn(escape(text))
    if _units(whole) <= limit:
        return whole
    # The longest prefix of the text whose shown form fits with the note.
    # A shown prefix only grows with the prefix, so bisect on its length.
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        shown = escape_mrkdwn(escape(text[:middle]))
        if _units(shown) + _units(_cut_note(len(text) - middle)) <= limit:
            low = middle
        else:
            high = middle - 1
    return escape_mrkdwn(escape(text[:low])) + _cut_note(len(text) - low)


def plain(text: str, limit: int = TEXT_MAX) -> dict[str, Any]:
    """A ``plain_text`` object: Slack shows it as it stands, no markup and no emoji codes."""
    return {"type": "plain_text", "text": neutralise(text, limit) or "(empty)", "emoji": False}


def _mrkdwn(text: str) -> dict[str, Any]:
    """A mrkdwn object for egressd's own text; ``verbatim``, so Slack links and mentions nothing by itself."""
    return {"type": "mrkdwn", "text": text, "verbatim": True}


def code_span(text: str, limit: int = SHORT_MAX) -> str:
    """``text`` as an inline code span inside egressd's mrkdwn: no formatting, and no way out of it."""
    return "`" + (neutralise(text, limit - 2).replace("`", _BACKTICK_STANDIN) or " ") + "`"


def _inert(text: str) -> bool:
    """Whether text is inert in mrkdwn as it stands (words and plain punctuation)."""
    return bool(_INERT.fullmatch(text)) and not _EMOJI_CODE.search(text)


def button_value(instance: str, approval_id: str) -> str:
    """What a button carries: the instance that owns the approval, and the approval."""
    return f"{instance}:{approval_id}"


def parse_button_value(value: str) -> tuple[str, str] | None:
    """``INSTANCE:APPROVAL`` → (instance, approval id); None for anything else (an older egressd's button)."""
    instance, sep, approval_id = value.partition(":")
    if not sep or not instance or not approval_id:
        return None
    return instance, approval_id


def _clock_text(at: float) -> str:
    """HH:MM in the reader's own time zone, with a UTC fallback for old clients."""
    fallback = time.strftime("%H:%M UTC", time.gmtime(at))
    return f"<!date^{int(at)}^{{time}}|{fallback}>"


def _who(settlement: Settlement) -> str:
    by = settlement.by or "someone"
    match = _USER_ID.search(by) if settlement.channel == "slack" else None
    if match:
        return f"<@{match.group(1) or match.group(2)}>"
    channel = settlement.channel or "?"
    via = channel if re.fullmatch(r"[a-z]{1,20}", channel) else code_span(channel, 40)
    return f"{code_span(by)} (via {via})"


def fallback_text(approval: PendingApproval) -> str:
    """The notification text (shown where blocks are not)."""
    return neutralise(f"egressd: run {approval.request.run_id} asks to reach {approval.message.domain}", FALLBACK_MAX)


def _line_blocks(approval: PendingApproval, *, closing: bool) -> list[dict[str, Any]]:
    """One section per line of the message; lines of one emphasised kind in a row share one."""
    blocks: list[dict[str, Any]] = []
    previous = None
    for kind, text in approval.message.lines:
        if not closing and kind in ("closing", "scope"):
            continue
        if kind in _EMPHASIS and _inert(text):
            shown = _EMPHASIS[kind].format(text)
            if previous == kind:
                blocks[-1]["text"]["text"] += "\n" + shown
            else:
                blocks.append({"type": "section", "text": _mrkdwn(shown)})
        else:
            blocks.append({"type": "section", "text": plain(text, LINE_BUDGETS.get(kind, OTHER_LINE_BUDGET))})
        previous = kind
    return blocks


def request_blocks(approval: PendingApproval, *, instance: str) -> list[dict[str, Any]]:
    """The approval message with a button per offered scope and Deny, all naming ``instance``."""
    value = button_value(instance, approval.id)
    allow_buttons: list[dict[str, Any]] = [
        {
            "type": "button",
            "action_id": action,
            "text": {"type": "plain_text", "text": label, "emoji": False},
            "value": value,
        }
        for scope, (action, label) in _SCOPE_BUTTONS.items()
        if approval.offers(scope)
    ]
    for button in allow_buttons:
        if button["action_id"] == ALLOW_ACTION:
            button["style"] = "primary"  # the default answer, as before
    return [
        *_line_blocks(approval, closing=True),
        {
            "type": "context",
            "elements": [
                plain(f"approval {approval.id} · run {approval.request.run_id} · egressd {instance}", 300),
                _mrkdwn(f"expires at {_clock_text(approval.expires_at)}"),
            ],
        },
        {
            "type": "actions",
            "block_id": f"egressd:{approval.id}",
            "elements": [
                *allow_buttons,
                {
                    "type": "button",
                    "action_id": DENY_ACTION,
                    "text": {"type": "plain_text", "text": "Deny", "emoji": False},
                    "style": "danger",
                    "value": value,
                },
            ],
        },
    ]


def abandoned_blocks(approval: PendingApproval, *, instance: str, at: float) -> list[dict[str, Any]]:
    """The approval message with its buttons, and a line saying the client gave up (at ``at``)."""
    blocks = request_blocks(approval, instance=instance)
    note = {"type": "section", "text": _mrkdwn(f":hourglass: *The client gave up waiting* at {_clock_text(at)}.")}
    rest = {"type": "section", "text": plain(ABANDONED_TEXT)}
    return [*blocks[:-1], note, rest, blocks[-1]]


def outcome_text(approval: PendingApproval, settlement: Settlement) -> str:
    """The line that replaces the buttons."""
    run = code_span(approval.request.run_id, 80)
    at = _clock_text(settlement.at)
    if settlement.channel is not None:
        if settlement.reason is not None:
            return f"*Denied* by {_who(settlement)} at {at} for run {run}"
        scope = settlement.scope
        if scope is ApprovalScope.ONCE:
            verb, after = "Allowed once", " (this connection only: the next one asks again)"
        elif scope is ApprovalScope.ALWAYS:
            verb, after = "Allowed always", f": {code_span(settlement.entry or '?')} added to the allow file"
        else:
            verb, after = "Allowed", " (this run only)"
            if settlement.scope_error:
                after = f" (this run only, not always: {code_span(settlement.scope_error, 400)})"
        return f"*{verb}* by {_who(settlement)} at {at} for run {run}{after}"
    if settlement.answer is Answer.TIMEOUT:
        return f"*Expired — denied* at {at} (run {run})"
    return f"*Denied* at {at}: nobody could answer (egressd stopped, or no channel could deliver) (run {run})"


def settled_blocks(approval: PendingApproval, settlement: Settlement) -> list[dict[str, Any]]:
    """The message as it stays after the decision: no buttons, the outcome instead."""
    return [
        *_line_blocks(approval, closing=False),
        {"type": "section", "text": _mrkdwn(outcome_text(approval, settlement))},
        {"type": "context", "elements": [plain(f"approval {approval.id}", 300)]},
    ]


def settled_word(settlement: Settlement) -> str:
    if settlement.reason is None:
        scope = settlement.scope
        return {ApprovalScope.ONCE: "allowed once", ApprovalScope.ALWAYS: "allowed always"}.get(
            scope if scope is not None else ApprovalScope.RUN, "allowed for this run"
        )
    return "expired (denied)" if settlement.answer is Answer.TIMEOUT else "denied"


def notice_blocks(notice: Notice) -> list[dict[str, Any]]:
    """A notice (a run stopped asking): egressd's heading, the rendered text as it stands."""
    return [
        {"type": "section", "text": _mrkdwn(":no_entry: *egressd stopped asking*")},
        {"type": "section", "text": plain(notice.text)},
    ]
