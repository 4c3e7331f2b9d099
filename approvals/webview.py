"""What the approvals page shows: JSON for its script, HTML for the first view. Pure: no I/O, no clock.

Everything that came from a sandbox (a command, a task, a host name, a run's
entries, who answered) reaches the page only through ``esc`` (HTML escaping
of ``& < > " '``), on top of the escaping of invisible and bidi characters
every channel uses (``egressd.names.shown.escape``: the approval's message
has it already; ``run_row``, ``tail_row`` and ``decision_row`` apply it to
what the runs table, the egress tail and the history show). The page's
script adds text with ``textContent`` only, so it needs no escaping of its own.

An approval is shown as a card of fields (``approval_event``): the domain as
a heading with its registered domain emphasised, the unrelated warning and
punycode as badges, then the message's lines as labelled fields (domain,
request, command, task, allowed domains) with the run, the client and when
it was held, then the warning, the closing and what a deny covers. Every
line of the one message every channel renders is on the card, in its
order (DESIGN.md, "The new-domain approval message"). The fields and their
labels are decided here once; the script lays out what it is sent.

The page's URLs are relative (``answer``, ``revoke``, ``events``,
``app.js``): it is served under a random per-instance path, and so is every
link it holds.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from egressd.audit.records import rfc3339
from egressd.names.shown import escape

from .control import Scope
from .interface import PendingApproval, Settlement, settled_text
from .message import ABANDONED_TEXT
from .webpage import MAX_NAME_CHARS, Session


def esc(text: object) -> str:
    """``text`` as HTML text or a quoted attribute value: ``& < > " '`` escaped."""
    return html.escape(str(text), quote=True)


def clock_text(epoch: float) -> str:
    """``16:42:05 UTC``: when a request was held or a decision made, for people."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%S UTC")


# -- an approval -----------------------------------------------------------------------

# The card's fields, in order: the message line's kind each comes from (its text after
# "Label: "), and the label the page gives it (the message's own).
MESSAGE_FIELDS = (
    ("domain", "Domain"), ("request", "Request"), ("command", "Command"), ("task", "Task"),
    ("allowed", "Allowed domains"),
)  # fmt: skip
# The notes under the fields, in the message's order: the event's key, and the class it is shown with.
NOTES = (("unrelated", "warning"), ("closing", "hint"), ("scope_note", "scope-note"))


def approval_event(approval: PendingApproval, scope: Scope) -> dict[str, Any]:
    """An approval as the page shows it: the domain, the badges, the fields in order, the answers offered.

    ``fields``: ``[class, label, text]`` in the order shown. ``scopes``: the
    answers offered to a session of ``scope``; *always* outlives the run, so a
    run's own session is never offered it.
    """
    message, request = approval.message, approval.request
    lines = dict(message.lines)
    site = message.registered_domain
    host = message.host
    sub = host[: -len(site)] if site and host.endswith(site) and host != site else ""
    fields: list[list[str]] = []
    for kind, label in MESSAGE_FIELDS:
        if kind in lines:
            fields.append([kind, label, lines[kind].partition(": ")[2]])
    fields.append(["run", "Run", escape(request.run_id)])
    if request.client is not None:
        fields.append(["client", "Client", escape(request.client)])
    fields.append(["held", "Held since", clock_text(approval.created_at)])
    offered = [s.value for s in approval.scopes if scope.outlives_runs or s.value != "always"]
    return {
        "id": approval.id,
        "run": request.run_id,
        "intro": lines.get("intro", ""),
        # The domain as three parts, the registered domain emphasised: "api." "github.com" ":443".
        "domain": [sub, host[len(sub) :], f":{message.port}"],
        "punycode": message.unicode_host is not None,
        "unrelated": lines.get("unrelated"),
        "fields": fields,
        "closing": " ".join(text for kind, text in message.lines if kind == "closing"),
        "scope_note": lines.get("scope"),
        "created_at": approval.created_at,
        "expires_at": approval.expires_at,
        "abandoned": ABANDONED_TEXT if approval.abandoned else None,
        "scopes": offered,
        # For the page's own uses (a desktop notification's title), never as HTML.
        "host": request.host,
        "port": request.port,
    }


# The answer buttons, in order: the ``decision`` value each posts, and its label. An allow's
# value is its scope (``allow`` is this run's); ``always`` is shown only when it is offered.
ANSWERS: tuple[tuple[str, str], ...] = (
    ("once", "Allow once"),
    ("allow", "Allow for this run"),
    ("always", "Allow always"),
    ("deny", "Deny"),
)
# What each button's value asks for: (allow?, the scope it names).
DECISIONS: dict[str, tuple[bool, str | None]] = {
    "once": (True, "once"),
    "allow": (True, "run"),
    "always": (True, "always"),
    "deny": (False, None),
}


def offered_answers(scopes: Sequence[str]) -> list[tuple[str, str]]:
    """The buttons an approval offering ``scopes`` shows (Deny always)."""
    return [(value, label) for value, label in ANSWERS if (DECISIONS[value][1] or "run") in scopes or value == "deny"]


def countdown(seconds_left: float) -> str:
    """``expires in 9:05`` (minutes:seconds), or ``expired``."""
    left = int(seconds_left)
    if left <= 0:
        return "expired"
    return f"expires in {left // 60}:{left % 60:02d}"


# Allow always outlives the run and writes the allow file: styled as the risky choice it is.
_BUTTON_CLASS = {"deny": "deny", "always": "allow risky"}


def _hidden(csrf: str, **values: str) -> str:
    return f'<input type="hidden" name="csrf" value="{esc(csrf)}">' + "".join(
        f'<input type="hidden" name="{name}" value="{esc(value)}">' for name, value in values.items()
    )


def answer_form(approval_id: str, csrf: str, scopes: Sequence[str] = ("once", "run")) -> str:
    """The answer buttons (``ANSWERS``, those ``scopes`` offers) in one POST form, with the CSRF token and the id.

    ``buildForm`` in app.js builds the same form for an approval that arrives live.
    """
    buttons = "".join(
        f'<button type="submit" name="decision" value="{value}" class="{_BUTTON_CLASS.get(value, "allow")}">'
        f"{label}</button>"
        for value, label in offered_answers(scopes)
    )
    return f'<form class="answer" method="post" action="answer">{_hidden(csrf, id=approval_id)}{buttons}</form>'


def approval_html(event: Mapping[str, Any], csrf: str, now: float) -> str:
    """One waiting approval, as ``addApproval`` in app.js lays out the same event."""
    sub, site, port = event["domain"]
    badges = '<span class="badge unrelated">unrelated</span>' if event["unrelated"] else ""
    badges += '<span class="badge idn">punycode</span>' if event["punycode"] else ""
    fields = "".join(
        f'<dt>{esc(label)}</dt><dd class="field {esc(kind)}">{esc(text)}</dd>' for kind, label, text in event["fields"]
    )
    notes = "".join(f'<p class="{cls}">{esc(event[key])}</p>' for key, cls in NOTES if event.get(key))
    return (
        f'<li class="approval" id="approval-{esc(event["id"])}" data-id="{esc(event["id"])}">'
        f'<p class="intro">{esc(event["intro"])}</p>'
        f'<h3 class="domain"><span class="sub">{esc(sub)}</span><strong class="site">{esc(site)}</strong>'
        f'<span class="port">{esc(port)}</span>{badges}</h3>'
        f'<dl class="fields">{fields}</dl>{notes}'
        f'<p class="countdown" data-expires="{event["expires_at"]:.3f}">{countdown(event["expires_at"] - now)}</p>'
        f'<p class="state">{esc(event["abandoned"] or "")}</p>'
        f"{answer_form(str(event['id']), csrf, event.get('scopes', ('once', 'run')))}"
        "</li>"
    )


# -- decisions, runs, the egress tail -------------------------------------------------------

# The history's columns: the field of ``decision_row`` and its heading.
HISTORY_COLUMNS = (("at", "When"), ("domain", "Domain"), ("run", "Run"), ("text", "Decision"))


def decision_row(approval: PendingApproval, settlement: Settlement) -> dict[str, Any]:
    """A settled approval as a row of the page's history: when, what, in which run, and who decided how."""
    request = approval.request
    return {
        "id": approval.id,
        "run": escape(request.run_id),
        "domain": f"{escape(request.host)}:{request.port}",
        "allowed": settlement.reason is None,
        "at": clock_text(settlement.at),
        "text": settled_text(settlement),
    }


def history_html(rows: Sequence[Mapping[str, Any]]) -> str:
    """The recent decisions, newest first."""
    return "".join(
        f'<tr class="{"allow" if r["allowed"] else "deny"}">'
        + "".join(f'<td class="{name}">{esc(r[name])}</td>' for name, _ in HISTORY_COLUMNS)
        + "</tr>"
        for r in rows
    )


# The fields of an egress record the tail shows.
TAIL_FIELDS = ("ts", "run", "kind", "host", "port", "decision", "reason")


def shown(value: object) -> object:
    """Sandbox text as the page shows it: every invisible or bidi character a visible escape (as the card's)."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, list | tuple):
        return [shown(v) for v in value]
    return value


def tail_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """An egress record as a row of the live tail (``ts`` as RFC 3339; ``id``, the record's, to show it once)."""
    row = {name: shown(record.get(name)) for name in ("id", *TAIL_FIELDS)}
    ts = record.get("ts")
    row["ts"] = rfc3339(ts) if isinstance(ts, int | float) else row["ts"]
    return row


# The fields of a run (``GET /runs``) the page shows: its allowlist and what was approved or refused in it.
RUN_FIELDS = tuple("id task command allow deny approved denied learn".split())
# Its lists, in the order of the table's columns (Allowed, Approved, Denied, Deny entries).
LIST_COLUMNS = tuple("allow approved denied deny".split())


def run_row(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run as the page shows it, its texts escaped as the approval card's (``shown``)."""
    return {name: shown(run.get(name)) for name in RUN_FIELDS}


def revoke_form(csrf: str, entry: str, run: str | None = None) -> str:
    """A Revoke button for an approved host of ``run``, or (no run) for an *always* entry.

    ``revokeForm`` in app.js builds the same form for a row that arrives live.
    """
    where = {"run": run} if run is not None else {}
    return (
        f'<form class="revoke" method="post" action="revoke">{_hidden(csrf, entry=entry, **where)}'
        f'<button type="submit" title="Revoke {esc(entry)}">Revoke</button></form>'
    )


def _entries(values: Iterable[object] | None, revoke: tuple[str, str] | None = None) -> str:
    """A cell of entries; ``revoke`` (csrf, run) gives each its Revoke button."""
    items = list(values or ())
    if not items:
        return '<span class="none">(none)</span>'
    if revoke is None:
        return "".join(f"<code>{esc(v)}</code> " for v in items)
    csrf, run = revoke
    return "".join(f'<span class="entry"><code>{esc(v)}</code>{revoke_form(csrf, str(v), run)}</span>' for v in items)


def _on(run: Mapping[str, Any]) -> str:
    """Where a run of another instance of the fleet lives, after its id."""
    return f' <span class="instance">on {esc(run["instance"])}</span>' if run.get("instance") else ""


def _revoking(run: Mapping[str, Any], column: str, csrf: str) -> tuple[str, str] | None:
    """A cell's Revoke buttons: the approved hosts of this instance's own runs, for a session that may."""
    return (csrf, str(run["id"])) if column == "approved" and csrf and not run.get("instance") else None


def runs_html(runs: Sequence[Mapping[str, Any]], csrf: str = "") -> str:
    if not runs:
        return '<p class="none">No run is live.</p>'
    # A fleet's other instances' runs (``instance``) are shown, not revoked here: they are theirs.
    rows = "".join(
        f'<tr data-run="{esc(r["id"])}"><td>{esc(r["id"])}{_on(r)}</td><td>{esc(r.get("task") or "")}</td>'
        f"<td>{esc(r.get('command') or '')}</td>"
        + "".join(f"<td>{_entries(r.get(name), _revoking(r, name, csrf))}</td>" for name in LIST_COLUMNS)
        + "</tr>"
        for r in runs
    )
    return (
        '<table class="runs"><thead><tr><th>Run</th><th>Task</th><th>Command</th><th>Allowed</th>'
        f"<th>Approved</th><th>Denied</th><th>Deny entries</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def always_row(answer: Mapping[str, Any]) -> dict[str, Any]:
    """A standing *always* answer of the allow file (``GET /always``), as the page shows it."""
    return {name: shown(answer.get(name) or "") for name in ("entry", "at", "by", "channel", "run")}


def always_html(rows: Sequence[Mapping[str, Any]], csrf: str) -> str:
    if not rows:
        return '<p class="none">No always entry stands.</p>'
    body = "".join(
        f'<tr><td><code>{esc(r["entry"])}</code></td><td>{esc(r["by"])} via {esc(r["channel"])}</td>'
        f'<td>{esc(r["at"])}</td><td>{revoke_form(csrf, str(r["entry"]))}</td></tr>'
        for r in rows
    )
    return ('<table class="always"><thead><tr><th>Entry</th><th>Given by</th><th>At</th><th></th></tr></thead>'
            f"<tbody>{body}</tbody></table>")  # fmt: skip


def tail_html(rows: Sequence[Mapping[str, Any]]) -> str:
    return "".join(
        f'<tr class="{esc(r.get("decision") or "")}" data-id="{esc(r.get("id") or "")}">'
        + "".join(f'<td class="{name}">{esc("" if r.get(name) is None else r.get(name))}</td>' for name in TAIL_FIELDS)
        + "</tr>"
        for r in rows
    )


# -- whole pages ---------------------------------------------------------------------------


def _document(title: str, body: str, csrf: str | None = None) -> str:
    meta = f'<meta name="csrf" content="{esc(csrf)}">' if csrf is not None else ""
    script = '<script src="app.js" defer></script>' if csrf is not None else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title>{meta}"
        f'<link rel="stylesheet" href="style.css">{script}</head>'
        f"<body>{body}</body></html>"
    )


def signin_html(error: str | None = None, token_file: str | None = None) -> str:
    """The sign-in form: the control token (global, or a run's own), and a name to answer as; where the
    global token is (``token_file``, when egressd wrote one), so a new user need not look it up."""
    note = f'<p class="error" role="alert">{esc(error)}</p>' if error else ""
    where = (f"<p>The global control token is in <code>{esc(token_file)}</code> on egressd's host "
             f"(<code>cat {esc(token_file)}</code>).</p>") if token_file else ""  # fmt: skip
    return _document(
        "egressd approvals: sign in",
        '<main class="signin"><h1>egressd approvals</h1>'
        f"{note}"
        '<form method="post" action="signin">'
        '<label>Control token <input type="password" name="token" autocomplete="off" required autofocus></label>'
        f'<label>Your name (shown as who answered) <input type="text" name="name" maxlength="{MAX_NAME_CHARS}">'
        "</label>"
        '<button type="submit">Sign in</button></form>'
        "<p>The global control token shows every run; a run's own control token shows that run only.</p>"
        f"{where}</main>",
    )


def page_html(
    *,
    session: Session,
    approvals: Sequence[Mapping[str, Any]],
    runs: Sequence[Mapping[str, Any]],
    tail: Sequence[Mapping[str, Any]],
    now: float,
    flash: str | None = None,
    history: Sequence[Mapping[str, Any]] = (),
    always: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The signed-in page as first served; the script keeps it current from the event stream.

    ``always``: the standing *always* entries, for a session that may revoke them (None: not shown).
    """
    who = f"{session.name} · " + ("every run" if session.scope.run_id is None else f"run {session.scope.run_id}")
    cards = "".join(approval_html(a, session.csrf, now) for a in approvals)
    note = f'<p class="flash" role="status">{esc(flash)}</p>' if flash else ""
    lasting = (
        f'<section><h2>Allowed always</h2><div id="always">{always_html(always, session.csrf)}</div></section>'
        if always is not None else ""
    )  # fmt: skip
    body = (
        '<header><h1>egressd approvals</h1><span class="who">signed in as '
        f"{esc(who)}</span>"
        f'<form method="post" action="signout"><input type="hidden" name="csrf" value="{esc(session.csrf)}">'
        '<button type="submit">Sign out</button></form>'
        '<button type="button" id="notify" hidden>Notify me of new requests</button>'
        '<label class="sound"><input type="checkbox" id="sound"> Sound</label></header>'
        f'<p id="status" class="status">Live updates: connecting…</p>{note}'
        "<section><h2>Waiting approvals</h2>"
        f'<p id="nothing-waiting" class="none"{" hidden" if approvals else ""}>Nothing is waiting.</p>'
        f'<ul id="approvals">{cards}</ul></section>'
        "<section><h2>Recent decisions</h2>"
        f'<p id="no-history" class="none"{" hidden" if history else ""}>No decision yet.</p>'
        f'<table class="history" id="history-table"{"" if history else " hidden"}><thead><tr>'
        + "".join(f"<th>{label}</th>" for _, label in HISTORY_COLUMNS)
        + f'</tr></thead><tbody id="history">{history_html(history)}</tbody></table></section>'
        f'<section><h2>Runs</h2><div id="runs">{runs_html(runs, session.csrf)}</div></section>'
        f"{lasting}"
        '<section><h2>Egress, live</h2><form id="filters" class="filters">'
        '<label>Run <input type="text" name="run"></label>'
        '<label>Decision <select name="decision"><option value="">any</option><option value="allow">allow</option>'
        '<option value="deny">deny</option></select></label>'
        '<label>Host <input type="text" name="host"></label></form>'
        '<table class="tail"><thead><tr>'
        + "".join(f"<th>{name}</th>" for name in TAIL_FIELDS)
        + f'</tr></thead><tbody id="tail">{tail_html(tail)}</tbody></table></section>'
    )
    return _document("egressd approvals", body, csrf=session.csrf)


def message_html(title: str, text: str) -> str:
    """A short page for a refusal (no session, bad CSRF token, wrong Host)."""
    return _document(title, f'<main><h1>{esc(title)}</h1><p>{esc(text)}</p><p><a href="./">Back</a></p></main>')
