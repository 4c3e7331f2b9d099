"""The approvals page's pure parts: sessions, sign-in limits, the Host rule, and the HTML.

No I/O, no clock, no randomness of its own: ``now`` and new secrets are
passed in. ``egressd.approvals.web`` is the asyncio shell around them.

Everything that came from a sandbox (a command, a task, a host name, a run's
entries, who answered) reaches the page only through ``esc`` (HTML escaping
of ``& < > " '``), on top of the escaping of invisible and bidi characters
every channel uses (``egressd.names.shown.escape``: the approval's message
has it already; ``run_row`` and ``tail_row`` apply it to what the runs table
and the egress tail show). The page's script adds text with ``textContent``
only, so it needs no escaping of its own.

The page's URLs are relative (``answer``, ``events``, ``app.js``): it is
served under a random per-instance path (``page_path``), and so is every
link it holds.
"""

from __future__ import annotations

import hmac
import html
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from egressd.audit.records import rfc3339
from egressd.names.shown import escape

from .control import Scope
from .interface import PendingApproval

# How long a session lives without a request from its browser (an open page
# keeps it alive); and at most, whatever it does: a stolen cookie ends.
SESSION_IDLE_S = 3600.0
SESSION_MAX_S = 12 * 3600.0
# Sessions held at once, per scope (the global token's; each run's own), so
# that sign-ins with one token never push out another's: more browsers than
# one person uses. Past it the one seen longest ago *without an open page* is
# signed out; when every one has its page open, the sign-in is refused.
MAX_SESSIONS_PER_SCOPE = 16
# Event streams (open pages) one session may hold at once: a few tabs.
MAX_STREAMS_PER_SESSION = 4
# Failed sign-ins per client address (an IPv6 client by its /64) within a
# window, never in all: an attacker's addresses must not lock out the
# operator's. A 256-bit token cannot be guessed anyway; this keeps the log
# and the CPU quiet.
FAILED_SIGNINS_PER_ADDRESS = 5
FAILED_SIGNIN_WINDOW_S = 60.0
# Client addresses remembered by the limiter; the oldest is forgotten first.
MAX_LIMITED_ADDRESSES = 4096
# A name typed at sign-in, shown to others as who answered.
MAX_NAME_CHARS = 64

# The session is two cookies, both needed: its id, and a key scoped to the
# page's random path. Cookies are not isolated by port, and a page on another
# port of the host is same-site: the key never reaches any path but the
# page's own, which such a page does not know. Over https the id cookie
# carries the ``__Host-`` prefix (Secure, this host only; the prefix demands
# ``Path=/``) and the key ``__Secure-``.
SESSION_COOKIE = "egressd_session"
KEY_COOKIE = "egressd_key"
SECURE_SESSION_COOKIE = "__Host-egressd_session"
SECURE_KEY_COOKIE = "__Secure-egressd_key"
# Every page lives under /web/<random>: ``page_path``.
PREFIX = "/web"
# Fetch Metadata (W3C): what a browser says of who made a request. Only the
# page itself ("same-origin") and a person typing or following a bookmark
# ("none") may read the page with its CSRF token; only the page may change
# anything. Another port of the host is "same-site": refused.
PAGE_SITES = frozenset({"same-origin", "none"})
CHANGE_SITES = frozenset({"same-origin"})


def page_path(secret: str) -> str:
    """The page's own path: ``/web/`` and a random secret (printed with its URL at start)."""
    return f"{PREFIX}/{secret}"


def cookie_names(secure: bool) -> tuple[str, str]:
    """The session's (id, key) cookie names, over https or not."""
    return (SECURE_SESSION_COOKIE, SECURE_KEY_COOKIE) if secure else (SESSION_COOKIE, KEY_COOKIE)


def fetch_site_ok(sec_fetch_site: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Sec-Fetch-Site`` is one of ``allowed``; a client that sends none passes.

    Every browser this page supports sends it; a client without it (curl)
    is no other page's tool: ``Origin``, the CSRF token and the cookie's
    path are the checks that still hold for it.
    """
    return sec_fetch_site is None or sec_fetch_site.strip().lower() in allowed


def esc(text: object) -> str:
    """``text`` as HTML text or a quoted attribute value: ``& < > " '`` escaped."""
    return html.escape(str(text), quote=True)


# -- sessions ------------------------------------------------------------------


@dataclass(slots=True)
class Session:
    """One signed-in browser: who (``name``), what it may see (``scope``), its CSRF token, its times.

    ``streams``: event streams open now; ``stream_ended``: when the last one
    closed (epoch seconds), for ``present``.
    """

    name: str
    scope: Scope
    csrf: str
    created: float
    seen: float
    key: str = ""
    streams: int = 0
    stream_ended: float | None = None
    flash: str | None = None

    def expired(self, now: float, idle_s: float = SESSION_IDLE_S, max_s: float = SESSION_MAX_S) -> bool:
        if now - self.created >= max_s:
            return True
        return self.streams == 0 and now - self.seen >= idle_s

    @property
    def auth(self) -> str:
        """The credential, as ``approval.decided`` names it: this session, and the token it signed in with."""
        return f'page session "{self.name}" ({self.scope.auth})'

    def present(self, now: float, grace_s: float) -> bool:
        """Someone has the page open: an event stream now, or one that closed within ``grace_s`` (a reconnect)."""
        if self.streams > 0:
            return True
        return self.stream_ended is not None and now - self.stream_ended <= grace_s


@dataclass(slots=True)
class SessionStore:
    """Server-side sessions by id. Ids, keys and CSRF tokens come from ``new_secret`` (256 random bits).

    The browser holds only the id and the key (two cookies); everything else
    stays here, so signing out or expiring ends the session wherever its
    cookies are. ``limit`` is per scope (``MAX_SESSIONS_PER_SCOPE``).
    """

    new_secret: Callable[[], str]
    idle_s: float = SESSION_IDLE_S
    max_s: float = SESSION_MAX_S
    limit: int = MAX_SESSIONS_PER_SCOPE
    _sessions: dict[str, Session] = field(default_factory=dict)

    def open(self, name: str, scope: Scope, now: float) -> tuple[str, Session] | None:
        """A new session, or None when its scope is full of sessions with their page open.

        Past ``limit`` sessions of the same scope, the one of them seen
        longest ago with no open stream is dropped first; sessions of other
        scopes are never touched, nor one whose page is open.
        """
        self.sweep(now)
        same = [sid for sid, s in self._sessions.items() if s.scope == scope]
        while len(same) >= self.limit:
            idle = [sid for sid in same if self._sessions[sid].streams == 0]
            if not idle:
                return None
            oldest = min(idle, key=lambda sid: self._sessions[sid].seen)
            del self._sessions[oldest]
            same.remove(oldest)
        sid = self.new_secret()
        session = Session(name=name, scope=scope, csrf=self.new_secret(), created=now, seen=now, key=self.new_secret())
        self._sessions[sid] = session
        return sid, session

    def get(self, sid: str | None, now: float, *, key: str | None = None, touch: bool = True) -> Session | None:
        """The live session with this id (its idle clock restarted), or None.

        ``key``: the session's key as the browser sent it; given, it must
        match (compared in constant time).
        """
        if not sid:
            return None
        session = self._sessions.get(sid)
        if session is None:
            return None
        if key is not None and not hmac.compare_digest(key.encode(), session.key.encode()):
            return None
        if session.expired(now, self.idle_s, self.max_s):
            del self._sessions[sid]
            return None
        if touch:
            session.seen = now
        return session

    def close(self, sid: str | None) -> None:
        if sid:
            self._sessions.pop(sid, None)

    def drop_runs(self, alive: Callable[[str], bool]) -> None:
        """Sign out every session of a run that ended (its token died with it): their slots are free again."""
        for sid in [s for s, v in self._sessions.items() if v.scope.run_id is not None and not alive(v.scope.run_id)]:
            del self._sessions[sid]

    def sweep(self, now: float) -> None:
        for sid in [s for s, v in self._sessions.items() if v.expired(now, self.idle_s, self.max_s)]:
            del self._sessions[sid]

    def live(self, now: float) -> list[Session]:
        self.sweep(now)
        return list(self._sessions.values())

    def clear(self) -> None:
        self._sessions.clear()

    def __len__(self) -> int:
        return len(self._sessions)


def client_key(address: str) -> str:
    """Who a failed sign-in is counted against: the address, an IPv6 one by its /64 (one host's many)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(slots=True)
class SignInLimiter:
    """Failed sign-ins within a sliding window, per client (``client_key``); never in all.

    A count in all would let one attacker's addresses lock out everyone,
    the operator with the right token too. Memory is bounded by forgetting
    the client seen longest ago (``MAX_LIMITED_ADDRESSES``).
    """

    per_address: int = FAILED_SIGNINS_PER_ADDRESS
    window_s: float = FAILED_SIGNIN_WINDOW_S
    _failures: dict[str, list[float]] = field(default_factory=dict)

    def _recent(self, now: float) -> None:
        for address in list(self._failures):
            times = [t for t in self._failures[address] if now - t < self.window_s]
            if times:
                self._failures[address] = times
            else:
                del self._failures[address]

    def allowed(self, address: str, now: float) -> bool:
        """Whether a sign-in from ``address`` may be tried now."""
        self._recent(now)
        return len(self._failures.get(client_key(address), ())) < self.per_address

    def failed(self, address: str, now: float) -> None:
        self._recent(now)
        key = client_key(address)
        if key not in self._failures and len(self._failures) >= MAX_LIMITED_ADDRESSES:
            del self._failures[next(iter(self._failures))]
        self._failures.setdefault(key, []).append(now)


# -- the Host and Origin rules ---------------------------------------------------


def _split_host(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` of a Host header (RFC 9110 §7.2), the host lower-cased, brackets kept off; None if malformed."""
    value = value.strip().lower()
    if not value or any(c in value for c in " /\\@?#"):
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_raw = value.rpartition(":")
        if not sep:
            host, port_text_raw = value, ""
        port_text = port_text_raw if sep else None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        return host, int(port_text)
    return host, None


def host_allowed(host_header: str | None, *, local: tuple[str, int] | None, public_url: str | None) -> bool:
    """Whether a request's Host names the control server itself (DNS rebinding defence).

    A page of another site can make a browser send requests here under a
    name of its own that it points at this address; the Host header still
    carries that name. Accepted:

    1. the netloc of ``--public-url`` (the name a reverse proxy serves us as);
    2. the address the request arrived on (``local``: the socket's own
       address), spelled as an IP literal with its port (an address, not a
       name: nothing to rebind);
    3. ``localhost`` with that port, when that address is a loopback one.

    Any other name, or another port, is refused.
    """
    if not host_header:
        return False
    given = _split_host(host_header)
    if given is None:
        return False
    if public_url:
        parts = urlsplit(public_url)
        if parts.hostname:
            default = 443 if parts.scheme == "https" else 80
            if (given[0].strip("[]"), given[1] or default) == (parts.hostname.lower(), parts.port or default):
                return True
    if local is None:
        return False
    local_host, local_port = local
    if given[1] is not None and given[1] != local_port:
        return False
    if given[1] is None and local_port != 80:
        return False
    try:
        ours = ipaddress.ip_address(local_host.split("%")[0])
    except ValueError:
        return False
    if isinstance(ours, ipaddress.IPv6Address) and ours.ipv4_mapped is not None:
        ours = ours.ipv4_mapped
    if given[0] == "localhost":
        return ours.is_loopback
    try:
        asked = ipaddress.ip_address(given[0])
    except ValueError:
        return False
    return asked == ours


def expected_origin(host_header: str, *, secure: bool, public_url: str | None) -> str:
    """The page's own origin as a browser names it in ``Origin`` for a request sent to ``host_header``."""
    if public_url:
        parts = urlsplit(public_url)
        if parts.hostname and parts.netloc.lower() == host_header.strip().lower():
            return f"{parts.scheme}://{parts.netloc.lower()}"
    return f"{'https' if secure else 'http'}://{host_header.strip().lower()}"


def public_https(host_header: str | None, public_url: str | None) -> bool:
    """Whether the browser reached us over ``--public-url``'s https (a TLS-terminating proxy in front)."""
    if not host_header or not public_url:
        return False
    parts = urlsplit(public_url)
    return parts.scheme == "https" and parts.netloc.lower() == host_header.strip().lower()


# -- what the page shows (JSON for the script, HTML for the first view) ----------------


def approval_event(approval: PendingApproval, scope: Scope) -> dict[str, Any]:
    """An approval as the page's script gets it: the message's lines as rendered for every channel.

    ``scopes``: the answers offered to a session of ``scope``; *always*
    outlives the run, so a run's own session is never offered it.
    """
    offered = [s.value for s in approval.scopes if scope.outlives_runs or s.value != "always"]
    return {
        "id": approval.id,
        "run": approval.request.run_id,
        "lines": [[kind, text] for kind, text in approval.message.lines],
        "expires_at": approval.expires_at,
        "abandoned": approval.abandoned,
        "scopes": offered,
        # For the page's own uses (a desktop notification's title), never as HTML.
        "host": approval.request.host,
        "port": approval.request.port,
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


def countdown(seconds_left: float) -> str:
    """``expires in 9:05`` (minutes:seconds), or ``expired``."""
    left = int(seconds_left)
    if left <= 0:
        return "expired"
    return f"expires in {left // 60}:{left % 60:02d}"


# Allow always outlives the run and writes the allow file: styled as the risky choice it is.
_BUTTON_CLASS = {"deny": "deny", "always": "allow risky"}


def answer_form(approval_id: str, csrf: str, scopes: Sequence[str] = ("once", "run")) -> str:
    """The answer buttons (``ANSWERS``, those ``scopes`` offers) in one POST form, with the CSRF token and the id.

    ``buildForm`` in app.js builds the same form for an approval that arrives live.
    """
    buttons = "".join(
        f'<button type="submit" name="decision" value="{value}" class="{_BUTTON_CLASS.get(value, "allow")}">'
        f"{label}</button>"
        for value, label in offered_answers(scopes)
    )
    return (
        '<form class="answer" method="post" action="answer">'
        f'<input type="hidden" name="csrf" value="{esc(csrf)}">'
        f'<input type="hidden" name="id" value="{esc(approval_id)}">'
        f"{buttons}</form>"
    )


def approval_html(event: Mapping[str, Any], csrf: str, now: float) -> str:
    """One waiting approval: the message line by line, the countdown, the buttons."""
    lines = "".join(f'<div class="line {esc(kind)}">{esc(text)}</div>' for kind, text in event["lines"])
    state = "The client gave up waiting; an answer still applies to the run." if event["abandoned"] else ""
    return (
        f'<li class="approval" id="approval-{esc(event["id"])}" data-id="{esc(event["id"])}">'
        f'<div class="meta">run <span class="run">{esc(event["run"])}</span> · approval '
        f'<span class="id">{esc(event["id"])}</span></div>'
        f'<div class="message">{lines}</div>'
        f'<p class="countdown" data-expires="{event["expires_at"]:.3f}">{countdown(event["expires_at"] - now)}</p>'
        f'<p class="state">{esc(state)}</p>'
        f"{answer_form(str(event['id']), csrf, event.get('scopes', ('once', 'run')))}"
        "</li>"
    )


def _entries(values: Iterable[object] | None) -> str:
    items = list(values or ())
    if not items:
        return '<span class="none">(none)</span>'
    return "".join(f"<code>{esc(v)}</code> " for v in items)


def runs_html(runs: Sequence[Mapping[str, Any]]) -> str:
    if not runs:
        return '<p class="none">No run is live.</p>'
    rows = "".join(
        f'<tr data-run="{esc(r["id"])}"><td>{esc(r["id"])}</td><td>{esc(r.get("task") or "")}</td>'
        f"<td>{esc(r.get('command') or '')}</td>"
        + "".join(f"<td>{_entries(r.get(name))}</td>" for name in LIST_COLUMNS)
        + "</tr>"
        for r in runs
    )
    return (
        '<table class="runs"><thead><tr><th>Run</th><th>Task</th><th>Command</th><th>Allowed</th>'
        f"<th>Approved</th><th>Denied</th><th>Deny entries</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def tail_html(rows: Sequence[Mapping[str, Any]]) -> str:
    return "".join(
        f'<tr class="{esc(r.get("decision") or "")}" data-id="{esc(r.get("id") or "")}">'
        + "".join(f'<td class="{name}">{esc("" if r.get(name) is None else r.get(name))}</td>' for name in TAIL_FIELDS)
        + "</tr>"
        for r in rows
    )


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
) -> str:
    """The signed-in page as first served; the script keeps it current from the event stream."""
    who = f"{session.name} · " + ("every run" if session.scope.run_id is None else f"run {session.scope.run_id}")
    cards = "".join(approval_html(a, session.csrf, now) for a in approvals)
    note = f'<p class="flash" role="status">{esc(flash)}</p>' if flash else ""
    body = (
        '<header><h1>egressd approvals</h1><span class="who">signed in as '
        f"{esc(who)}</span>"
        f'<form method="post" action="signout"><input type="hidden" name="csrf" value="{esc(session.csrf)}">'
        '<button type="submit">Sign out</button></form>'
        '<button type="button" id="notify" hidden>Notify me of new requests</button></header>'
        f'<p id="status" class="status">Live updates: connecting…</p>{note}'
        "<section><h2>Waiting approvals</h2>"
        f'<p id="nothing-waiting" class="none"{" hidden" if approvals else ""}>Nothing is waiting.</p>'
        f'<ul id="approvals">{cards}</ul></section>'
        f'<section><h2>Runs</h2><div id="runs">{runs_html(runs)}</div></section>'
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
