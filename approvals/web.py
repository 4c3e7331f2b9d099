"""The web channel: the approvals page of the control server (``--approver web``).

Routes (all under the page's own path ``P`` = ``/web/<random>``, 128 bits
drawn when egressd starts and printed with the page's URL; public to the
control API's bearer check, each guarded here instead; nothing answers at
``/web/`` itself):

- ``GET  P/``          the page, or the sign-in form without a session
- ``POST P/signin``    ``token`` (the control token) and ``name``: the session cookies, 303 to the page
- ``POST P/signout``   ``csrf``: the session ends, the cookies are cleared
- ``POST P/answer``    ``csrf``, ``id``, ``decision`` (once|allow|always|deny): answered through the
                       ``Answerer`` with channel ``web``, ``by`` the name given at sign-in and
                       ``auth`` naming the session and the token it signed in with
- ``POST P/revoke``    ``csrf``, ``entry`` and ``run``: take back the run's approval for a host
                       (a session of that run's scope); without ``run``: an *always* entry
                       (a session of the global token only), as ``PATCH /runs/ID`` does
- ``GET  P/events``    server-sent events: the waiting approvals, their settlements,
                       the recent decisions, the runs, the *always* entries,
                       and the egress records as they happen
- ``GET  P/app.js``, ``P/style.css``  the page's only script and style (shipped in the package)

Who may sign in: the global control token (every run), or a run's own
control token, narrowed to that run like the control API's ``Scope`` (its
approvals, its runs row, its egress; the session ends with the run). A run's
session is never offered *always* and is refused it (403): it outlives the
run. The token is compared in constant time; failed sign-ins are limited per
client address (429), never in all, so nobody's failures lock out the
operator. A session is server-side (``webpage.SessionStore``): the browser
holds two cookies, both needed, its 256-bit random id and its 256-bit key
(``webpage.cookie_names``), HttpOnly, SameSite=Strict, ``Path=P`` (the id's
``Path=/`` over https, where it carries the ``__Host-`` prefix). Cookies are
not isolated by port and a page on another port of the host is same-site:
the key reaches no path but ``P``, which such a page does not know. A
session ends after an hour unused or twelve hours in all, at sign-out, or
when egressd stops. Sessions are capped per scope (``MAX_SESSIONS_PER_SCOPE``:
one token's sign-ins never push out another's; past the cap the one seen
longest ago without an open page goes, and when all have their page open the
sign-in is refused, 503); event streams per session (``MAX_STREAMS_PER_SESSION``,
503 past it).

Every state change (sign-in, sign-out, an answer) is a POST whose ``Origin``
must be the page's own and whose ``Sec-Fetch-Site``, when sent, is
``same-origin``; all but the sign-in also carry the session's CSRF token (256
random bits, drawn with the session, compared in constant time): anything
else is 403 and changes nothing. The page with its CSRF token, and the event
stream, are served to a session only when ``Sec-Fetch-Site`` is
``same-origin`` or ``none`` (a typed address) and any ``Origin`` is the
page's own: another origin's page carrying the cookies gets 403 and no
token. A GET never decides anything. Every request's Host must
name the control server itself (``webpage.host_allowed``), else 421: a
rebound DNS name cannot reach the page. Every response carries a strict
Content-Security-Policy (no inline script or style; the script and style
are ``'self'``), ``nosniff``, ``frame-ancestors 'none'`` and a referrer
policy. ``Referrer-Policy`` is ``same-origin``, not ``no-referrer``: under
``no-referrer`` a browser sends ``Origin: null`` with the page's own form
posts (the Fetch standard), which the Origin check must refuse; a referrer
still never leaves the page's origin.

When the channel is attached: the broker starts it like any channel, but
it delivers only while someone may answer: a live session whose scope covers
the approval's run has the page open (an event stream now, or one that
closed less than ``PRESENCE_GRACE_S`` ago, a reconnect). Otherwise
``deliver`` fails at once, so with ``--approver web`` alone and nobody
watching, a new domain is refused ``no_approver`` as with any unattached
channel, unless the page is an *inbox* (``web_inbox``, on by default when web
is the only approver): then every approval is held up to its deadline and
shown to whoever opens the page meanwhile. An approval shown stays answerable
until its deadline even if the page is closed (and through ``egressd allow|deny``).

The egress tail comes from the recorder's observers (every egress record as it
is written, the same records ``GET /runs/ID/events`` returns), subscribed
only while an event stream is open; a new stream starts with the last
records of each run's event window.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

from egressd.audit.records import rfc3339
from egressd.names.shown import escape

from .control import Scope
from .interface import (
    Answerer,
    ApprovalScope,
    ChannelUnavailable,
    Choice,
    Elsewhere,
    Notice,
    PendingApproval,
    Route,
    Settlement,
    parse_scope,
    settled_text,
)
from .message import ABANDONED_TEXT
from .webanswer import answer_elsewhere, answer_flash, runs_elsewhere, waiting_elsewhere
from .webcontrol import CONTROL_VIEW, Bound, RevokeError
from .webpage import (
    CHANGE_SITES,
    MAX_NAME_CHARS,
    MAX_STREAMS_PER_SESSION,
    PAGE_SITES,
    Session,
    SessionStore,
    SignInLimiter,
    cookie_names,
    expected_origin,
    fetch_site_ok,
    host_allowed,
    page_path,
    public_https,
)
from .webview import DECISIONS, approval_event, decision_row, message_html, page_html, signin_html, tail_row

log = logging.getLogger("egressd.approvals.web")

CHANNEL = "web"
# A page that lost its event stream reconnects within seconds (``retry``
# below); for this long it still counts as open, so a blip is not no_approver.
PRESENCE_GRACE_S = 30.0
# The browser's reconnect delay, sent at the start of every stream.
RETRY_MS = 2000
# A stream with nothing to say sends a comment this often: a closed page is
# noticed, and the runs' rows are refreshed when they changed.
KEEPALIVE_S = 5.0
# In a fleet, how often an open page looks again for what the other instances hold.
FLEET_POLL_S = 1.0
# Events queued for one stream; a page that does not read them is cut off
# (it reconnects and starts from a fresh snapshot).
STREAM_QUEUE = 1024
# Egress records a new stream starts with (and a page keeps).
TAIL_BACKLOG = 100
# What a page is told of an approval that stopped waiting without this channel being told how.
NO_LONGER_WAITING = "no longer waiting (answered elsewhere, or expired)"
# Decisions the page's history keeps (every run's together; a session sees its scope's).
HISTORY = 50
# Sign-in and answer forms are a few short fields.
MAX_FORM_BYTES = 8192

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}




def _static(name: str) -> bytes:
    return resources.files("egressd.approvals").joinpath("web-static", name).read_bytes()


@dataclass(eq=False, slots=True)
class _Stream:
    """One open event stream: whose, what it may see, what is queued for it."""

    sid: str
    scope: Scope
    queue: asyncio.Queue[tuple[str, Any] | None] = field(default_factory=lambda: asyncio.Queue(STREAM_QUEUE))

    def put(self, event: str, data: Any) -> bool:
        try:
            self.queue.put_nowait((event, data))
        except asyncio.QueueFull:
            return False
        return True


def _redirect(location: str, status: int = 303) -> web.Response:
    """303 See Other after a POST (RFC 9110 §15.4.4): the browser GETs the page again."""
    return web.Response(status=status, headers={"Location": location})


def _frame(event: str, data: Any) -> bytes:
    """One server-sent event (HTML Living Standard §9.2): JSON on one ``data`` line."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class WebChannel:
    """The approvals page as an approval channel (module docstring)."""

    name = CHANNEL

    def __init__(
        self,
        *,
        public_url: str | None = None,
        clock: Callable[[], float] = time.time,
        new_secret: Callable[[], str] = lambda: secrets.token_urlsafe(32),
        path_secret: str | None = None,
        sessions: SessionStore | None = None,
        limiter: SignInLimiter | None = None,
        presence_grace_s: float = PRESENCE_GRACE_S,
        keepalive_s: float = KEEPALIVE_S,
        inbox: bool = False,
        token_file: str | None = None,
    ) -> None:
        self._public_url = public_url
        self.token_file = token_file  # said on the sign-in page (None: the token was given, not written)
        self.inbox = inbox  # hold what comes while nobody watches (module docstring)
        # The page's own path, drawn per instance (module docstring): 128 bits.
        self.prefix = page_path(path_secret or secrets.token_urlsafe(16))
        self._clock = clock
        self._sessions = sessions or SessionStore(new_secret=new_secret)
        self._limiter = limiter or SignInLimiter()
        self._grace_s = presence_grace_s
        self._keepalive_s = keepalive_s
        self._answerer: Answerer | None = None
        self._streams: set[_Stream] = set()
        self._closed = False
        self._history: deque[tuple[str, dict[str, Any]]] = deque(maxlen=HISTORY)  # (run, row), newest last
        # A fleet's other instances (serve --state): their approvals shown and answered here too; set by
        # approvals.assembly.
        self.elsewhere: Elsewhere | None = None
        self._script = _static("app.js")
        self._style = _static("style.css")

    # -- the Channel ------------------------------------------------------------------

    def _signin_page(self, error: str | None = None) -> str:
        return signin_html(error, token_file=self.token_file)

    async def start(self, answerer: Answerer) -> None:
        self._answerer = answerer

    def attached_for(self, run_id: str) -> bool:
        """Whether someone who may answer for ``run_id`` has the page open (module docstring)."""
        now = self._clock()
        return any(s.scope.covers(run_id) and s.present(now, self._grace_s) for s in self._sessions.live(now))

    async def deliver(self, approval: PendingApproval) -> None:
        if self._closed or not (self.inbox or self.attached_for(approval.request.run_id)):
            raise ChannelUnavailable("nobody who may answer has the approvals page open")
        self._publish("approval", approval, approval.request.run_id)

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        self._publish("settled", {"id": approval.id, "text": settled_text(settlement)}, approval.request.run_id)
        row = decision_row(approval, settlement)
        self._history.append((approval.request.run_id, row))
        self._publish("decided", row, approval.request.run_id)

    def history(self, scope: Scope) -> list[dict[str, Any]]:
        """The recent decisions ``scope`` may see, newest first."""
        return [row for run_id, row in reversed(self._history) if scope.covers(run_id)]

    async def abandoned(self, approval: PendingApproval) -> None:
        self._publish("abandoned", {"id": approval.id, "text": ABANDONED_TEXT}, approval.request.run_id)

    async def notify(self, notice: Notice) -> None:
        self._publish("notice", {"run": notice.run_id, "text": notice.text, "at": rfc3339(notice.at)}, notice.run_id)

    async def close(self) -> None:
        self._closed = True
        for stream in list(self._streams):
            with contextlib.suppress(asyncio.QueueFull):
                stream.queue.put_nowait(None)
        self._sessions.clear()

    def routes(self) -> Sequence[Route]:
        prefix = self.prefix
        guarded = [
            ("GET", prefix, self._to_page),
            ("GET", f"{prefix}/", self._page),
            ("POST", f"{prefix}/signin", self._signin),
            ("POST", f"{prefix}/signout", self._signout),
            ("POST", f"{prefix}/answer", self._answer),
            ("POST", f"{prefix}/revoke", self._revoke),
            ("GET", f"{prefix}/events", self._events),
            ("GET", f"{prefix}/app.js", self._app_js),
            ("GET", f"{prefix}/style.css", self._style_css),
        ]
        # Public to the bearer check: the cookies, the CSRF token and the Host rule are this page's credentials.
        return [
            Route(method, path, self._guard(handler), public=True, page=path == f"{prefix}/")
            for method, path, handler in guarded
        ]

    # -- the event streams ---------------------------------------------------------------

    def _publish(self, event: str, data: Any, run_id: str | None) -> None:
        """``data`` to every stream whose scope covers ``run_id``; an approval as that scope sees it."""
        for stream in list(self._streams):
            if run_id is None or stream.scope.covers(run_id):
                shown = approval_event(data, stream.scope) if isinstance(data, PendingApproval) else data
                if not stream.put(event, shown):
                    self._cut(stream)

    def _cut(self, stream: _Stream) -> None:
        """A stream that fell behind is ended; its page reconnects and starts again from a snapshot."""
        while not stream.queue.empty():
            stream.queue.get_nowait()
        stream.queue.put_nowait(None)

    # -- guards ------------------------------------------------------------------------

    def _guard(self, handler: Callable[[web.Request], Any]) -> Callable[[web.Request], Any]:
        async def guarded(request: web.Request) -> web.StreamResponse:
            local = None
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            if isinstance(sockname, tuple) and len(sockname) >= 2:
                local = (str(sockname[0]), int(sockname[1]))
            elif isinstance(sockname, str):
                local = ("127.0.0.1", 80)  # a unix socket: only its owner can connect; browsers call it localhost
            if not host_allowed(request.headers.get("Host"), local=local, public_url=self._public_url):
                response: web.StreamResponse = self._html(
                    421, "Misdirected request", "This page answers only to the control server's own address."
                )
            else:
                try:
                    response = await handler(request)
                except web.HTTPException as exc:
                    response = self._html(exc.status, exc.reason, exc.text or exc.reason)
            if not response.prepared:
                response.headers.update(SECURITY_HEADERS)
            return response

        return guarded

    def _secure(self, request: web.Request) -> bool:
        return request.secure or public_https(request.headers.get("Host"), self._public_url)

    def _origin_ok(self, request: web.Request, *, required: bool = True) -> bool:
        """A request from the page itself: ``Origin`` equal to the page's own origin (or absent, if not ``required``).

        A state change requires it, with ``Sec-Fetch-Site`` (when sent) ``same-origin``.
        """
        origin = request.headers.get("Origin")
        if origin is None:
            return not required
        host = request.headers.get("Host", "")
        want = expected_origin(host, secure=self._secure(request), public_url=self._public_url)
        return hmac.compare_digest(origin.strip().lower().encode(), want.encode())

    def _change_ok(self, request: web.Request) -> bool:
        """A state change: from the page itself (``Origin``, ``Sec-Fetch-Site``)."""
        return self._origin_ok(request) and fetch_site_ok(request.headers.get("Sec-Fetch-Site"), CHANGE_SITES)

    def _read_ok(self, request: web.Request, sites: frozenset[str]) -> bool:
        """A GET that hands a session's page (its CSRF token) or stream out: not made by another origin's page."""
        return self._origin_ok(request, required=False) and fetch_site_ok(request.headers.get("Sec-Fetch-Site"), sites)

    def _session_id(self, request: web.Request) -> str | None:
        return request.cookies.get(cookie_names(self._secure(request))[0])

    def _session(self, request: web.Request) -> Session | None:
        """The request's session: its id cookie and its key cookie, both, or None."""
        key = request.cookies.get(cookie_names(self._secure(request))[1])
        if not key:
            return None
        session = self._sessions.get(self._session_id(request), self._clock(), key=key)
        if session is None:
            return None
        if session.scope.run_id is not None and not self._view(request).sign_in_alive(session.scope.run_id):
            self._sessions.close(self._session_id(request))
            return None
        return session

    @staticmethod
    def _view(request: web.Request) -> Bound:
        view = request.app.get(CONTROL_VIEW)
        if view is None:
            raise web.HTTPServiceUnavailable(text="the approvals page is not wired to the control server")
        return Bound(view)

    @staticmethod
    def _html(status: int, title: str, text: str) -> web.Response:
        return web.Response(status=status, text=message_html(title, text), content_type="text/html", charset="utf-8")

    async def _form(self, request: web.Request) -> dict[str, str] | None:
        if request.content_length is not None and request.content_length > MAX_FORM_BYTES:
            return None
        raw = b""
        while len(raw) <= MAX_FORM_BYTES:  # read() gives what has arrived: one chunk at a time
            chunk = await request.content.read(MAX_FORM_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
        if len(raw) > MAX_FORM_BYTES:
            return None
        try:
            pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, max_num_fields=16)
        except (UnicodeDecodeError, ValueError):
            return None
        return dict(pairs)

    def _csrf_ok(self, session: Session, form: dict[str, str]) -> bool:
        given = form.get("csrf", "")
        return bool(given) and hmac.compare_digest(given.encode(), session.csrf.encode())

    # -- handlers ----------------------------------------------------------------------

    async def _to_page(self, request: web.Request) -> web.StreamResponse:
        return _redirect(f"{self.prefix}/", 302)

    async def _app_js(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self._script, content_type="text/javascript", charset="utf-8")

    async def _style_css(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self._style, content_type="text/css", charset="utf-8")

    async def _page(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        if session is None:
            return web.Response(text=self._signin_page(), content_type="text/html", charset="utf-8")
        if not self._read_ok(request, PAGE_SITES):
            # Another origin's page (another port of this host is same-site) sent the cookies: no CSRF token.
            return self._html(403, "Refused", "Open the approvals page from its own address.")
        view = self._view(request)
        scope = session.scope
        answerer = self._answerer
        approvals = [
            approval_event(a, scope) for a in (answerer.pending() if answerer else ()) if scope.covers(a.request.run_id)
        ] + await waiting_elsewhere(self.elsewhere, scope)
        flash, session.flash = session.flash, None
        body = page_html(
            session=session,
            approvals=approvals,
            runs=view.runs(scope) + await runs_elsewhere(self.elsewhere, scope),
            tail=view.recent(scope, TAIL_BACKLOG),
            now=self._clock(),
            flash=flash,
            history=self.history(scope),
            always=view.always(scope),
        )
        return web.Response(text=body, content_type="text/html", charset="utf-8")

    async def _signin(self, request: web.Request) -> web.StreamResponse:
        if not self._change_ok(request):
            return self._html(403, "Refused", "A sign-in must come from this page (its Origin did not match).")
        address = request.remote or "?"
        now = self._clock()
        if not self._limiter.allowed(address, now):
            return web.Response(
                status=429, text=self._signin_page("Too many failed sign-ins: wait a minute."), content_type="text/html"
            )
        form = await self._form(request)
        token = (form or {}).get("token", "").strip()
        scope = self._view(request).view.sign_in(token) if token else None
        if scope is None:
            self._limiter.failed(address, now)
            log.warning("approvals page: a failed sign-in from %s", address)
            wrong = self._signin_page("That is not a control token.")
            return web.Response(status=401, text=wrong, content_type="text/html")
        name = escape(" ".join((form or {}).get("name", "").split())[:MAX_NAME_CHARS]) or CHANNEL
        live_runs = {str(r.get("id")) for r in self._view(request).view.runs()}
        self._sessions.drop_runs(live_runs.__contains__)
        opened = self._sessions.open(name, scope, now)
        if opened is None:
            log.warning(
                "approvals page: a sign-in from %s refused: every session of its token has its page open", address
            )
            return web.Response(
                status=503,
                text=self._signin_page("Too many open pages signed in with this token: close one first."),
                content_type="text/html",
            )
        sid, session = opened
        log.info(
            "approvals page: %s signed in from %s (%s)",
            name,
            address,
            "every run" if scope.run_id is None else f"run {scope.run_id}",
        )
        response = _redirect(f"{self.prefix}/")
        secure = self._secure(request)
        id_name, key_name = cookie_names(secure)
        # Over https the id's __Host- prefix demands Path=/; the key stays on the page's own path.
        cookies = ((id_name, sid, "/" if secure else self.prefix), (key_name, session.key, self.prefix))
        for cookie, value, path in cookies:
            response.set_cookie(
                cookie,
                value,
                path=path,
                httponly=True,
                samesite="Strict",
                secure=secure,
                max_age=int(self._sessions.max_s),
            )
        return response

    async def _signout(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        form = await self._form(request)
        if session is None or form is None or not self._change_ok(request) or not self._csrf_ok(session, form):
            return self._html(403, "Refused", "Sign-out needs this page's session and its CSRF token.")
        self._sessions.close(self._session_id(request))
        response = _redirect(f"{self.prefix}/")
        secure = self._secure(request)
        id_name, key_name = cookie_names(secure)
        response.del_cookie(id_name, path="/" if secure else self.prefix)
        response.del_cookie(key_name, path=self.prefix)
        return response

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        form = await self._form(request)
        if session is None or form is None or not self._change_ok(request) or not self._csrf_ok(session, form):
            return self._html(403, "Refused", "An answer needs this page's session and its CSRF token.")
        approval_id = form.get("id", "")
        decided = DECISIONS.get(form.get("decision", ""))
        if decided is None or not approval_id:
            return self._html(400, "Bad answer", "An answer names an approval and once, allow, always or deny.")
        choice = Choice.ALLOW if decided[0] else Choice.DENY
        scope = parse_scope(decided[1]) or ApprovalScope.RUN
        if choice is Choice.ALLOW and scope is ApprovalScope.ALWAYS and not session.scope.outlives_runs:
            return self._html(
                403, "Refused", "Allow always outlives this run: it needs a session signed in with the global token."
            )
        shown_id = escape(approval_id)  # shown back in a flash: no invisible or bidi characters
        answerer = self._answerer
        if answerer is None:
            return self._html(503, "Not ready", "The approvals page is not started.")
        if approval_id not in {a.id for a in answerer.pending()}:
            passed = await answer_elsewhere(self.elsewhere, approval_id, choice, scope, session=session.scope,
                                            by=session.name, auth=session.auth, shown_id=shown_id, channel=CHANNEL)
            if passed is not None:  # another instance of the fleet holds it, and decided (or not: said)
                if not passed[0]:
                    return self._html(403, "Refused", passed[1])
                session.flash = passed[1]
                return _redirect(f"{self.prefix}/")
        if session.scope.run_id is not None:
            # As the control API: a run's session answers its own run's approvals only (no await until answer()).
            runs = {a.id: a.request.run_id for a in answerer.pending()}
            if runs.get(approval_id, session.scope.run_id) != session.scope.run_id:
                return self._html(403, "Refused", f"This session acts on run {session.scope.run_id} only.")
            if approval_id not in runs:
                session.flash = f"No pending approval {shown_id}."
                return _redirect(f"{self.prefix}/")
        held = next((a.request for a in answerer.pending() if a.id == approval_id), None)
        # The flash names what was answered: the domain a person recognises, the id after it.
        what = f"{escape(held.host)}:{held.port} (approval {shown_id})" if held is not None else f"Approval {shown_id}"
        answered = answerer.answer(
            approval_id, choice, channel=CHANNEL, by=session.name, scope=scope, auth=session.auth
        )
        session.flash = answer_flash(answered, choice, scope, shown_id, what)
        return _redirect(f"{self.prefix}/")

    async def _revoke(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        form = await self._form(request)
        if session is None or form is None or not self._change_ok(request) or not self._csrf_ok(session, form):
            return self._html(403, "Refused", "A revoke needs this page's session and its CSRF token.")
        entry, run_id = form.get("entry", "").strip(), form.get("run") or None
        if not entry:
            return self._html(400, "Bad revoke", "A revoke names an entry (and the run, for a run's approval).")
        if run_id is None and not session.scope.outlives_runs:
            return self._html(403, "Refused", "An always entry is every run's: it needs the global token's session.")
        if run_id is not None and not session.scope.covers(run_id):
            return self._html(403, "Refused", f"This session acts on run {session.scope.run_id} only.")
        view = self._view(request).view
        if view.revoke is None:
            return self._html(503, "Not ready", "The approvals page is not wired to revoke.")
        what = escape(entry) + (f" in run {escape(run_id)}" if run_id else " (always)")
        try:
            view.revoke(run_id, [entry], session.name, session.auth)
        except RevokeError as exc:
            session.flash = f"Not revoked: {what}: {escape(str(exc))}."
        else:
            session.flash = f"Revoked {what}: asked again from its next request."
            log.info("approvals page: %s revoked %s", session.name, what)
        return _redirect(f"{self.prefix}/")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        if session is None:
            # 204 stops an EventSource from reconnecting; the page then reloads into the sign-in form.
            return web.Response(status=204)
        if not self._read_ok(request, CHANGE_SITES):
            return web.Response(status=403, text="the event stream is the page's own")
        if session.streams >= MAX_STREAMS_PER_SESSION or self._closed:
            return web.Response(status=503, text="too many open pages")
        bound = self._view(request)
        sid = self._session_id(request) or ""
        scope = session.scope
        stream = _Stream(sid, scope)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **SECURITY_HEADERS})

        def on_egress(record: dict[str, Any]) -> None:
            # Called inside the recorder, for every egress record: never raises into it.
            try:
                run = record.get("run")
                if isinstance(run, str) and scope.covers(run) and not stream.put("egress", tail_row(record)):
                    self._cut(stream)
            except Exception:
                log.exception("approvals page: an egress record could not be shown")

        # Counted before the first await: concurrent requests cannot all pass the cap.
        self._streams.add(stream)
        session.streams += 1
        bound.view.observers.append(on_egress)
        try:
            await response.prepare(request)
            await response.write(f"retry: {RETRY_MS}\n\n".encode())
            answerer = self._answerer
            shown: set[str] = set()  # the approvals this page shows as waiting
            for approval in answerer.pending() if answerer else ():
                if scope.covers(approval.request.run_id):
                    await response.write(_frame("approval", approval_event(approval, scope)))
                    shown.add(approval.id)
            for held in await waiting_elsewhere(self.elsewhere, scope):
                await response.write(_frame("approval", held))
                shown.add(held["id"])
            tick = min(self._keepalive_s, FLEET_POLL_S) if self.elsewhere is not None else self._keepalive_s
            # The latest records again: one written between the page's first view and this stream is not lost
            # (the page shows each record once, by its id).
            for row in bound.recent(scope, TAIL_BACKLOG):
                await response.write(_frame("egress", row))
            await response.write(_frame("history", self.history(scope)))
            runs, always = bound.runs(scope) + await runs_elsewhere(self.elsewhere, scope), bound.always(scope)
            await response.write(_frame("runs", runs))
            if always is not None:
                await response.write(_frame("always", always))
            await response.write(_frame("ready", {}))
            while True:
                try:
                    async with asyncio.timeout(tick):
                        item = await stream.queue.get()
                except TimeoutError:
                    item = ("", None)
                if item is None:
                    break
                current = self._sessions.get(sid, self._clock())
                if current is None or (scope.run_id is not None and not bound.sign_in_alive(scope.run_id)):
                    await response.write(_frame("ended", {}))
                    break
                event, data = item
                if event:
                    await response.write(_frame(event, data))
                    if event == "approval":
                        shown.add(data["id"])
                    elif event == "settled":
                        shown.discard(data["id"])
                    continue
                # Settled where this channel was not told (it could not deliver when it was asked):
                # gone from the pending list, so marked on the page all the same.
                waiting = {a.id for a in answerer.pending()} if answerer else set()
                # A fleet's other instances: what they hold now shown, what they no longer hold marked below.
                for held in await waiting_elsewhere(self.elsewhere, scope):
                    waiting.add(held["id"])
                    if held["id"] not in shown:
                        await response.write(_frame("approval", held))
                        shown.add(held["id"])
                for gone in sorted(shown - waiting):
                    shown.discard(gone)
                    await response.write(_frame("settled", {"id": gone, "text": NO_LONGER_WAITING}))
                now_runs = bound.runs(scope) + await runs_elsewhere(self.elsewhere, scope)
                now_always = bound.always(scope)
                if now_runs != runs:
                    runs = now_runs
                    await response.write(_frame("runs", runs))
                if now_always != always:
                    always = now_always
                    await response.write(_frame("always", always))
                await response.write(b": keep-alive\n\n")
        except (ConnectionError, RuntimeError):
            pass  # the page went away
        finally:
            with contextlib.suppress(ValueError):
                bound.view.observers.remove(on_egress)
            self._streams.discard(stream)
            session.streams -= 1
            session.stream_ended = self._clock()
        return response
