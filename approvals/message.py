"""The new-domain approval message: one template, rendered once, shown by every channel.

Pure: no I/O, no clock; the bundled Public Suffix List is read once, lazily
(``config.suffixes``, the copy the policy uses too).

Everything the agent controls (the domain's display form, the command, the
task, the allowed entries) is made inert here: every character that does not
render as a visible mark of its own becomes a visible escape (``\\x1b``,
``\\u202e``, ``\\u3164``; the rule is ``is_invisible``), so no text can
repaint a terminal, hide a character, reverse a line or pad a line with
blanks; and each field is bounded so the message stays readable: a field
shows at most ``MAX_FIELD_CHARS`` characters *as shown* (escapes counted),
so a channel can show the command whole (Slack's budget for its line, 2900,
is above five times that, for ``&amp;``). Channels add their own escaping
on top (Slack's ``&<>``). ``TerminalText`` does the same, read by
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

import codecs
import functools
import ipaddress
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import idna

from config import suffixes

from .interface import Answer, Settlement

__all__ = [
    "ApprovalMessage",
    "Room",
    "Shown",
    "TerminalText",
    "bounded",
    "escape",
    "is_invisible",
    "is_unrelated",
    "registered_domain",
    "render",
    "settled_text",
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
UNRELATED = "Unrelated: this domain is not named in the task or the command, and is not under an allowed domain."
CLOSING = (
    "Reply allow (this run only) or deny. If you did not expect this request,",
    "deny it: it may come from instructions planted in a file the agent read.",
)

# What ``escape`` shows as an escape: every character that does not render as a
# visible mark of its own, or that acts on the terminal or on the text around it
# (DESIGN.md: "every character that does not render visibly is escaped"):
#
# 1. by category: controls (Cc: C0, C1, DEL), format characters (Cf: bidi
#    overrides, zero-width joiners, tags), private use (Co: a glyph only some
#    font has, or none), surrogates (Cs), unassigned code points (Cn: what a
#    newer Unicode may make invisible), line and paragraph separators (Zl, Zp),
#    and every space separator but the space itself (Zs: a no-break or an
#    ideographic space looks like a space and is not one);
# 2. Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt, checked
#    against Unicode 15.0): what a renderer shows as nothing whatever its
#    category, among them the Hangul fillers (Lo), the variation selectors and
#    the combining grapheme joiner (Mn);
# 3. characters whose glyph is blank: U+2800 BRAILLE PATTERN BLANK, U+1D159
#    MUSICAL SYMBOL NULL NOTEHEAD.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp", "Zs"})
_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)
_BLANK_GLYPHS = (0x2800, 0x1D159)
_INVISIBLE_CODES = frozenset(
    [code for first, last in _DEFAULT_IGNORABLE for code in range(first, last + 1)] + list(_BLANK_GLYPHS)
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


# Output relayed to a terminal can be large, so ``escape`` finds which escaped
# characters occur (C-speed scans) and replaces each with ``str.replace``: ASCII
# text through ``bytes.translate``, other text through a character class of the
# escaped categories, built once from ``unicodedata``. Past this many distinct
# ones (text made to be slow), one ``re.sub`` pass instead.
_MAX_REPLACE_PASSES = 16
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


def is_invisible(ch: str) -> bool:
    """Whether ``escape`` shows the character ``ch`` as an escape (the three rules above)."""
    return ch != " " and (ord(ch) in _INVISIBLE_CODES or unicodedata.category(ch) in _ESCAPED_CATEGORIES)


@functools.cache
def _escaped_bmp() -> tuple[int, ...]:
    """The code points below U+10000 ``escape`` escapes (about 20 ms, once)."""
    return tuple(c for c in range(0x10000) if is_invisible(chr(c)))


@functools.cache
def _candidates(keep_layout: bool) -> re.Pattern[str]:
    """One character that may need escaping: an escaped one below U+10000, or any above (checked one by one)."""
    ranges: list[list[int]] = []
    for code in _escaped_bmp():
        if keep_layout and code in (0x09, 0x0A):
            continue
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    members = "".join(f"\\u{a:04x}-\\u{b:04x}" for a, b in ranges)
    return re.compile(f"[{members}\\U00010000-\\U0010ffff]")


def _escape_char(ch: str) -> str:
    if not is_invisible(ch):
        return ch
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str, *, keep_layout: bool = False) -> str:
    """Return ``text`` with every character ``is_invisible`` calls so as a visible escape.

    ``\\xNN`` up to U+00FF, ``\\uNNNN`` up to U+FFFF, ``\\UNNNNNNNN`` above;
    each character on its own, so the escape of a text is the escapes of its
    characters one after another. ``keep_layout`` keeps newline and tab, for
    text shown line by line (a command's output relayed to a terminal:
    ``TerminalText``). About 3 ms a megabyte of ASCII, 20 of other text.
    """
    if text.isascii():
        found = {chr(b) for b in text.encode("ascii").translate(None, _PRINTABLE_ASCII)}
        if keep_layout:
            found -= {"\n", "\t"}
    else:
        pattern = _candidates(keep_layout)
        found = set(pattern.findall(text))
        if len(found) > _MAX_REPLACE_PASSES:
            return text.translate({ord(ch): _escape_char(ch) for ch in found})
    # An escape is printable ASCII, never escaped itself: the order of the passes does not matter.
    for ch in found:
        text = text.replace(ch, _escape_char(ch))
    return text


class TerminalText:
    """A command's output (bytes, read by read) as text a terminal shows inertly.

    Whatever the reads' boundaries, the result is that of the whole output:

    1. UTF-8 is decoded incrementally: a character split between two reads is
       held until it is whole; a byte that is not UTF-8 shows as ``\\xNN``
       (a raw 0x9b is CSI to some terminals);
    2. CR LF becomes LF (the terminal's own output processing returns the
       carriage); a lone CR is escaped, as it would let the command overwrite
       the line it is on, its own text or anything drawn there before it; a CR
       at the end of a read waits for the next one;
    3. then ``escape`` with newline and tab kept: no ESC, no C0 or C1
       control, no DEL, no format or bidi character reaches the terminal.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
        self._carriage = False

    def feed(self, data: bytes) -> str:
        """The text of the next read (possibly empty: the rest of a character is still to come)."""
        return self._text(self._decoder.decode(data), final=False)

    def end(self) -> str:
        """What is left at the end of the output: an incomplete character or a CR, escaped."""
        return self._text(self._decoder.decode(b"", final=True), final=True)

    def _text(self, text: str, *, final: bool) -> str:
        if self._carriage:
            text = "\r" + text
            self._carriage = False
        if not final and text.endswith("\r"):
            text = text[:-1]
            self._carriage = True
        if "\r" in text:
            text = text.replace("\r\n", "\n")
        return escape(text, keep_layout=True)


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
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isdigit() or port == "*"):
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
    ``intro domain command task allowed unrelated closing scope``, so a channel
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
    unrelated = is_unrelated(
        host,
        command=command_shown.read if command_shown else None,
        task=task_shown.read if task_shown else None,
        allowed=allowed,
    )

    lines: list[tuple[str, str]] = [
        ("intro", INTRO),
        ("domain", domain_line),
        ("command", f"Command: {command_text}"),
        ("task", f"Task: {task_text}"),
        ("allowed", f"Allowed domains: {allowed_text}"),
    ]
    if unrelated:
        lines.append(("unrelated", UNRELATED))
    lines.extend(("closing", line) for line in CLOSING)
    if site is not None and not _is_ip(host):
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
    )


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


def settled_text(settlement: Settlement) -> str:
    """One line saying how an approval ended, for people (escaped by the broker already)."""
    if settlement.channel is not None:
        verb = "allowed" if settlement.reason is None else "denied"
        return f"{verb} by {settlement.by or 'someone'} via {settlement.channel}"
    return {
        Answer.TIMEOUT: "expired (denied)",
        Answer.NO_APPROVER: "denied: nobody could be asked",
        Answer.SHUTTING_DOWN: "denied: egressd stopped",
    }.get(settlement.answer, settlement.reason or "settled")
