"""The new-domain approval message: one template, rendered once, shown by every channel.

Pure: no I/O, no clock; the bundled Public Suffix List is read once, lazily
(``egressd.names.suffixes``, the copy the policy uses too).

Everything the agent controls (the domain's display form, the command, the
task, the allowed entries) is made inert here: every character that does not
render as a visible mark of its own becomes a visible escape (``\\x1b``,
``\\u202e``, ``\\u3164``; the rule is ``is_invisible``), so no text can
repaint a terminal, hide a character, reverse a line or pad a line with
blanks; and each field is bounded so the message stays readable: a field
shows at most ``MAX_FIELD_CHARS`` characters *as shown* (escapes counted),
so a channel can show the command whole (Slack's budget for its line, 2900,
is above five times that, for ``&amp;``). Channels add their own escaping
on top (Slack's ``&<>``). ``egressd.names.shown`` holds the rule (``escape``);
``TerminalText`` there does the same, read by
read, for a command's output relayed to the terminal an approval prompt is
drawn on. A channel with less room (a small terminal) renders the message
again with a smaller ``Room``: the same template, the same rule, on what it
shows.

The "unrelated" line is judged on the text shown (``Shown.read``): a name
past the cut, or one the cut goes through, is a name nobody reads, so it
relates nothing. The domain is unrelated when

1. neither the task nor the command, as shown, names it, or a name on the same
   registered domain (``api.github.com`` is named by "github.com" or by
   "docs.github.com"; never by "evilgithub.com"); and
2. it is not an allowed host, under an allowed host, or on the registered
   domain of one (the allowlist's ``*.example.com`` relates
   ``example.com`` and ``a.b.example.com``). "Under" follows the policy:
   a public suffix between the two breaks it, so ``*.amazonaws.com`` does
   not relate ``bucket.s3.amazonaws.com``, anyone's bucket. The allowlist
   is the operator's, not the agent's, so all of it counts, also entries
   past the ones the message lists.

Registered domains come from the Public Suffix List with its private
section, so ``alice.github.io`` and ``bob.github.io`` are unrelated.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import idna

from egressd.names import suffixes
from egressd.names.authority import Colons, split_authority
from egressd.names.shown import escape, is_invisible

__all__ = [
    "HeldRequest",
    "ApprovalMessage",
    "Room",
    "Shown",
    "bounded",
    "is_unrelated",
    "is_unrelated_write",
    "registered_domain",
    "render",
    "shorten",
    "shown",
    "stopped_asking_text",
]

# A command can be a whole script; a person reads the start of it. 500
# characters keep every channel's message well inside Slack's 3000-character
# block limit, with room for the escapes.
MAX_FIELD_CHARS = 500
# Enough allowlist entries to recognise the run; the rest are counted.
MAX_ALLOWED_SHOWN = 30

INTRO = "A command in the sandbox tried to reach a domain that is not allowlisted."
# Inside an inspected connection: the domain is allowed for its rules, this request no rule covers.
REQUEST_INTRO = "A command in the sandbox made a request that no rule for this domain covers."
# A path is shown shortened in the middle past this many characters; the query's names, not values.
MAX_PATH_CHARS = 200
MAX_QUERY_NAMES = 10
UNRELATED = "Unrelated: this domain is not named in the task or the command, and is not under an allowed domain."
UNRELATED_WRITE = "Unrelated: a write to a path the task does not name."
# Methods that only read (RFC 9110 §9.2.1 safe methods): never "a write".
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
CLOSING = (
    "Reply allow (this run only) or deny. If you did not expect this request,",
    "deny it: it may come from instructions planted in a file the agent read.",
)

# A run of dot-separated labels: how a name appears inside a command or a
# task ("curl https://api.github.com/x", "see docs.python.org"). \w covers
# letters of any script, so IDN spellings are found too.
# The lookbehind starts a match only where a run of name characters starts:
# without it a long run with no dot is retried from each of its characters
# (quadratic: a 10,000-character command held the event loop for seconds).
_NAME_IN_TEXT = re.compile(r"(?<![\w-])[\w-]+(?:\.[\w-]+)+")
# A character a name can go on with, and a name (or the start of one) at the end of a text.
_NAME_CHAR = re.compile(r"[\w.-]")
_NAME_AT_END = re.compile(r"[\w.-]+\Z")


@dataclass(frozen=True, slots=True)
class Shown:
    """A text as a person is shown it, and the part of it the "unrelated" rule reads.

    ``text`` is escaped, cut, and says how much is left out; ``read`` is the
    escaped part before that note, less a name the cut goes through.
    """

    text: str
    read: str


def shown(text: str, limit: int = MAX_FIELD_CHARS, measure: Callable[[str], int] = len) -> Shown:
    """``text`` escaped and cut so that what is shown of it measures at most ``limit``.

    1. the longest prefix of ``text`` whose escape measures at most ``limit``
       (``len``, or the columns a terminal gives it) is shown: the cut falls
       between two characters of the original, never inside an escape;
    2. when something is left out, "… (N more characters)" follows, N counted
       in the original;
    3. what the rule reads is the shown prefix; when the text goes on past the
       cut with a character a name can go on with, the name at the end of the
       prefix is left out of it too: half a name ("telemetry-collector.n") is
       no mention.
    """
    prefix, kept = _cut(text, limit, measure)
    if kept == len(text):
        return Shown(prefix, prefix)
    read = prefix
    following = text[kept]
    if _NAME_CHAR.match(following) and not is_invisible(following):
        read = _NAME_AT_END.sub("", prefix)
    return Shown(f"{prefix}… ({len(text) - kept} more characters)", read)


def _cut(text: str, limit: int, measure: Callable[[str], int]) -> tuple[str, int]:
    """The escape of the longest prefix of ``text`` that fits ``limit``, and how long that prefix is."""
    if len(text) <= limit:
        whole = escape(text)
        if measure(whole) <= limit:
            return whole, len(text)
    # Every character shows as one column or more, so no more than ``limit`` of them fit;
    # a longer prefix never shows shorter, so bisect on its length.
    low, high = 0, min(len(text), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if measure(escape(text[:middle])) <= limit:
            low = middle
        else:
            high = middle - 1
    return escape(text[:low]), low


def bounded(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """Escape ``text`` and cut it so that at most ``limit`` characters are shown, saying how much is left out."""
    return shown(text, limit).text


def shorten(name: str, limit: int, *, keep: str = "", measure: Callable[[str], int] = len) -> str | None:
    """``name`` in at most ``limit``: its middle replaced by "…", ``keep`` (the end it has to show whole) kept.

    ``keep`` is the name's registered domain (with its port): who owns a name
    is the part a person has to read, so it is never cut, while the start of
    the name stays too. None when even "…" and ``keep`` do not fit.
    """
    if measure(name) <= limit:
        return name
    if not name.endswith(keep):
        keep = ""
    rest = name[: len(name) - len(keep)]
    room = limit - measure("…") - measure(keep)
    if room < 0:
        return None
    head_room = (room + 1) // 2
    head = ""
    for ch in rest:
        if measure(head + ch) > head_room:
            break
        head += ch
    tail_room = room - measure(head)
    tail = ""
    for ch in reversed(rest[len(head):]):
        if measure(ch + tail) > tail_room:
            break
        tail = ch + tail
    return f"{head}…{tail}{keep}"


def _normal_name(text: str) -> str | None:
    """A name as the proxy compares it: lower-case, no trailing dot, IDNA A-labels."""
    name = text.strip().rstrip(".").lower()
    if not name or name.startswith("."):
        return None
    if name.isascii():
        return name
    try:
        return idna.encode(name, uts46=True).decode("ascii")
    except (idna.IDNAError, UnicodeError):
        return None


def registered_domain(name: str) -> str | None:
    """The registrable domain (eTLD+1) of a normalised name; None for a public suffix."""
    try:
        return suffixes.registrable_domain(name)
    except (ValueError, UnicodeError):
        return None


def _beneath_suffix(name: str, base: str) -> bool:
    """Whether a public suffix lies between ``base`` and ``name`` (the policy's rule; True when unsure)."""
    try:
        return suffixes.suffix_beneath(name, base) is not None
    except (ValueError, UnicodeError):
        return True


def _site(name: str) -> str:
    return registered_domain(name) or name


def _allowed_host(entry: str) -> str | None:
    """The host part of an allowlist entry's text (``*.a.com:8443`` → ``a.com``); None for IP entries."""
    text = entry.strip()
    if text.startswith("["):
        return None
    host, port = split_authority(text, colons=Colons.LAST)
    if port is None or not (port.isdigit() or port == "*"):
        host = text
    host = host.removeprefix("*.")
    if ":" in host:
        return None  # a bare IPv6 address
    return _normal_name(host)


def _names_in(text: str | None) -> set[str]:
    if not text:
        return set()
    names = set()
    for match in _NAME_IN_TEXT.finditer(text):
        name = _normal_name(match.group(0))
        if name is not None:
            names.add(name)
    return names


def is_unrelated(host: str, *, command: str | None, task: str | None, allowed: Sequence[str]) -> bool:
    """Steps 1-2 of the module docstring, for a normalised ``host``.

    ``command`` and ``task`` are the text a person reads of them
    (``Shown.read``): ``render`` never passes more.
    """
    site = _site(host)
    for name in _names_in(command) | _names_in(task):
        if name == host or _site(name) == site:
            return False
    for entry in allowed:
        other = _allowed_host(entry)
        if other is None:
            continue
        if host == other or _site(other) == site or (host.endswith("." + other) and not _beneath_suffix(host, other)):
            return False
    return True


def is_unrelated_write(method: str, path: str, task: str | None) -> bool:
    """A request that writes (not a safe method) to a path of which the task, as shown, names no segment.

    Segments shorter than three characters (``v1``, ``a``) name nothing; a
    segment counts when the task holds it as a word or a path part, case aside.
    """
    if method in SAFE_METHODS:
        return False
    words = {word.lower() for word in re.split(r"[^A-Za-z0-9_.~-]+", task or "") if word}
    segments = [segment.lower() for segment in path.split("/") if len(segment) >= 3]
    return not any(segment in words for segment in segments)


def _unicode_form(host: str) -> str | None:
    """The U-label form of a host with IDNA labels, or None when it has none (or does not decode)."""
    if not any(label.startswith("xn--") for label in host.split(".")):
        return None
    try:
        return ".".join(idna.decode(label) if label.startswith("xn--") else label for label in host.split("."))
    except (idna.IDNAError, UnicodeError):
        return None


@dataclass(frozen=True, slots=True)
class ApprovalMessage:
    """The rendered message and the values it was made of (all escaped and bounded).

    ``lines`` is the message as ``(kind, text)`` pairs, kind one of
    ``intro domain request command task allowed unrelated closing scope``, so a channel
    can emphasise the domain and the unrelated warning without re-rendering.
    """

    host: str
    port: int
    domain: str
    unicode_host: str | None
    registered_domain: str | None
    command: str
    task: str
    allowed: tuple[str, ...]
    unrelated: bool
    lines: tuple[tuple[str, str], ...]
    request: str | None = None  # the ``Request:`` line's text, for a request inside an inspected connection

    @property
    def text(self) -> str:
        """The whole message as plain text, one line per line."""
        return "\n".join(text for _, text in self.lines)


@dataclass(frozen=True, slots=True)
class Room:
    """How much of each field a channel shows; ``render``'s default is what every channel shows.

    Limits are in ``measure`` units (characters; a terminal passes columns):
    ``command`` and ``task`` for their text, ``allowed`` for the allowlist's
    entries together (None: up to ``MAX_ALLOWED_SHOWN`` of them), ``name``
    for the domain's names on the Domain line (None: whole; else shortened in
    the middle, the registered domain whole: ``shorten``).
    """

    command: int = MAX_FIELD_CHARS
    task: int = MAX_FIELD_CHARS
    allowed: int | None = None
    name: int | None = None
    measure: Callable[[str], int] = len


EVERY_CHANNEL = Room()


def render(
    *,
    host: str,
    port: int,
    command: str | None,
    task: str | None,
    allowed: Sequence[str],
    room: Room = EVERY_CHANNEL,
    request: HeldRequest | None = None,
    uploaded: int | None = None,
) -> ApprovalMessage:
    """Render the message for a held request to ``host:port`` (host normalised, ASCII).

    "Unrelated" is judged on the command and the task as this rendering
    shows them (``Shown.read``), so a smaller ``room`` can only add the warning.
    """
    shown_host = escape(host)
    domain = f"{shown_host}:{port}"
    unicode_host = _unicode_form(host)
    site = registered_domain(host)
    domain_line = _domain_line(host, port, unicode_host, site, room)

    command_shown = shown(command, room.command, room.measure) if command else None
    task_shown = shown(task, room.task, room.measure) if task else None
    command_text = command_shown.text if command_shown else "(not known)"
    task_text = task_shown.text if task_shown else "(none given)"
    shown_allowed, allowed_text = _allowed_text(allowed, room)
    if uploaded is not None:
        unrelated = False  # a domain the run was allowed to reach: the question is how much
    elif request is None:
        unrelated = is_unrelated(
            host,
            command=command_shown.read if command_shown else None,
            task=task_shown.read if task_shown else None,
            allowed=allowed,
        )
    else:  # the domain is allowed already: what may be unrelated is the write
        unrelated = is_unrelated_write(request.method, request.path, task_shown.read if task_shown else None)

    request_text = _request_text(request) if request is not None else None
    intro = INTRO if request_text is None else REQUEST_INTRO
    if uploaded is not None and request is not None:
        intro = (f"This request's body has sent {_size(uploaded)} to {shown_host}, past the per-request cap: "
                 "let it continue?")
    elif uploaded is not None:
        intro = f"This run has sent {_size(uploaded)} to {shown_host}, past its upload budget: let it continue?"
    lines: list[tuple[str, str]] = [
        ("intro", intro),
        ("domain", domain_line),
    ]
    if request_text is not None:
        lines.append(("request", f"Request: {request_text}"))
    lines += [
        ("command", f"Command: {command_text}"),
        ("task", f"Task: {task_text}"),
        ("allowed", f"Allowed domains: {allowed_text}"),
    ]
    if unrelated:
        lines.append(("unrelated", UNRELATED if request is None else UNRELATED_WRITE))
    lines.extend(("closing", line) for line in CLOSING)
    if uploaded is not None:
        worth = "cap's" if request is not None else "budget's"
        lines.append(("scope", f"Allow lets it send another {worth} worth; a deny, or no answer, ends the connection."))
    elif request is not None:
        lines.append(("scope", f"A deny covers {escape(request.method)} under {escape(request.prefix)} on "
                               f"{shown_host} for this run; allow for the run allows the same."))
    elif site is not None and not _is_ip(host):
        # DESIGN.md "Decision order": a denial covers the registered domain for the rest of the run.
        shown_site = escape(site)
        lines.append(
            (
                "scope",
                f"A deny covers *.{shown_site} for this run ({shown_site} included): "
                "no name under it is asked about again.",
            )
        )
    return ApprovalMessage(
        host=shown_host,
        port=port,
        domain=domain,
        unicode_host=escape(unicode_host) if unicode_host is not None else None,
        registered_domain=site,
        command=command_text,
        task=task_text,
        allowed=shown_allowed,
        unrelated=unrelated,
        lines=tuple(lines),
        request=request_text,
    )


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request inside an inspected connection, as an approver is shown it (never a value or a body).

    ``path`` normalised, without the query; ``prefix`` the path prefix an
    answer for the run covers; ``query_names`` the query's parameter names
    only; ``content_type`` and ``length`` as the request declares them
    (None: it declares none).
    """

    method: str
    path: str
    prefix: str
    query_names: tuple[str, ...] = ()
    content_type: str | None = None
    length: int | None = None


def _request_text(request: HeldRequest) -> str:
    """``POST /org/repo/issues (query: a, b; application/json; 1.2 KiB)``: escaped, the path shortened in the middle."""
    path = escape(request.path)
    if len(path) > MAX_PATH_CHARS:
        half = (MAX_PATH_CHARS - 1) // 2
        path = f"{path[:half]}…{path[-half:]}"
    notes = []
    if request.query_names:
        names = [escape(name)[:40] for name in request.query_names[:MAX_QUERY_NAMES]]
        more = len(request.query_names) - len(names)
        notes.append("query: " + ", ".join(names) + (f" and {more} more" if more > 0 else ""))
    if request.content_type:
        notes.append(escape(request.content_type)[:80])
    if request.length is not None:
        notes.append(_size(request.length))
    return f"{escape(request.method)} {path}" + (f" ({'; '.join(notes)})" if notes else "")


def _size(length: int) -> str:
    """A declared body size, for people: ``512 bytes``, ``1.2 KiB``, ``48.0 MiB``."""
    if length < 1024:
        return f"{length} bytes"
    size = float(length)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{size:.1f} {unit}"


def _domain_line(host: str, port: int, unicode_host: str | None, site: str | None, room: Room) -> str:
    """``Domain: host:port (shown as …; registered domain …)``, names shortened to ``room.name``."""
    shown_host = escape(host)
    shown_unicode = escape(unicode_host) if unicode_host is not None else None
    if room.name is not None:
        shown_host = _short(shown_host, site, room)
        if shown_unicode is not None:
            shown_unicode = _short(shown_unicode, (_unicode_form(site) or site) if site else None, room)
    notes = []
    if shown_unicode is not None:
        notes.append(f"shown as {shown_unicode}")
    if site is not None and (site != host or unicode_host is not None):
        notes.append(f"registered domain {escape(site)}")
    return f"Domain: {shown_host}:{port}" + (f" ({'; '.join(notes)})" if notes else "")


def _short(name: str, site: str | None, room: Room) -> str:
    """``name`` shortened to ``room.name``, its registered domain (as it is spelled in ``name``) whole."""
    assert room.name is not None
    keep = escape(site) if site is not None and (name == site or name.endswith("." + site)) else name
    return shorten(name, room.name, keep=keep, measure=room.measure) or (f"…{keep}" if keep != name else name)


def _allowed_text(allowed: Sequence[str], room: Room) -> tuple[tuple[str, ...], str]:
    """The allowlist's entries shown (each bounded), and the line's text: as many as fit, then how many more."""
    entries = tuple(bounded(entry, 253) for entry in allowed[:MAX_ALLOWED_SHOWN])
    if not entries:
        return (), "(none)"
    for count in range(len(entries), -1, -1):
        more = len(allowed) - count
        text = ", ".join(entries[:count])
        if more:
            text += f", and {more} more" if count else f"{more} entries"
        if room.allowed is None or count == 0 or room.measure(text) <= room.allowed:
            return entries[:count], text
    raise AssertionError("unreachable: no entries always fits")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def stopped_asking_text(run_id: str, limit: int) -> str:
    """The notice every channel shows once when a run has made as many approval requests as it may."""
    return (
        f"egressd stopped asking for run {bounded(run_id, 64)}: it made {limit} approval requests, "
        "the most one run may make (max_approvals_per_run). Every new domain in this run is now refused "
        "(not_allowlisted) without asking anyone."
    )


# What every channel says, once, when every client waiting for an approval gave up.
ABANDONED_TEXT = (
    "The client gave up waiting for this request. An answer still applies to the run: "
    "allow lets its later requests to this domain through, deny refuses them."
)
