"""The approvals page's pure guards: sessions, sign-in limits, the Host and Origin rules.

No I/O, no clock, no randomness of its own: ``now`` and new secrets are
passed in. ``egressd.approvals.web`` is the asyncio shell around them;
``egressd.approvals.webview`` is what the page shows.

The page lives under a random per-instance path (``page_path``).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .control import Scope

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
