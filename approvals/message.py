"""The new-domain approval message: one template, rendered once, shown by every channel.

Pure: no I/O, no clock; the bundled Public Suffix List is read once, lazily
(``config.suffixes``, the copy the policy uses too).

Everything the agent controls (the domain's display form, the command, the
task, the allowed entries) is made inert here: control and format characters
become visible escapes (``\\x1b``, ``\\u202e``), so no text can repaint a
terminal, hide a character or reverse a line; and each field is bounded so
the message stays readable. Channels add their own escaping on top (Slack's
``&<>``). ``TerminalText`` does the same, read by read, for a command's
output relayed to the terminal an approval prompt is drawn on.

The "unrelated" line: the domain is unrelated when

1. neither the task nor the command names it, or a name on the same
   registered domain (``api.github.com`` is named by "github.com" or by
   "docs.github.com"; never by "evilgithub.com"); and
2. it is not an allowed host, under an allowed host, or on the registered
   domain of one (the allowlist's ``*.example.com`` relates
   ``example.com`` and ``a.b.example.com``). "Under" follows the policy:
   a public suffix between the two breaks it, so ``*.amazonaws.com`` does
   not relate ``bucket.s3.amazonaws.com``, anyone's bucket.

Registered domains come from the Public Suffix List with its private
section, so ``alice.github.io`` and ``bob.github.io`` are unrelated.
"""

from __future__ import annotations

import codecs
import functools
import ipaddress
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import idna

from config import suffixes

from .interface import Settlement

__all__ = [
    "ApprovalMessage",
    "TerminalText",
    "bounded",
    "escape",
    "is_unrelated",
    "registered_domain",
    "render",
    "settled_text",
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

# Categories shown as escapes: controls (C0, C1, DEL), format characters
# (bidi overrides, zero-width joiners), line/paragraph separators, surrogates
# and unassigned code points.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})

# A run of dot-separated labels: how a name appears inside a command or a
# task ("curl https://api.github.com/x", "see docs.python.org"). \w covers
# letters of any script, so IDN spellings are found too.
# The lookbehind starts a match only where a run of name characters starts:
# without it a long run with no dot is retried from each of its characters
# (quadratic: a 10,000-character command held the event loop for seconds).
_NAME_IN_TEXT = re.compile(r"(?<![\w-])[\w-]+(?:\.[\w-]+)+")


# Output relayed to a terminal can be large, so ``escape`` finds which escaped
# characters occur (C-speed scans) and replaces each with ``str.replace``: ASCII
# text through ``bytes.translate``, other text through a character class of the
# escaped categories, built once from ``unicodedata``. Past this many distinct
# ones (text made to be slow), one ``re.sub`` pass instead.
_MAX_REPLACE_PASSES = 16
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


@functools.cache
def _escaped_bmp() -> tuple[int, ...]:
    """The code points below U+10000 in an escaped category (about 17 ms, once)."""
    return tuple(c for c in range(0x10000) if unicodedata.category(chr(c)) in _ESCAPED_CATEGORIES)


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
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str, *, keep_layout: bool = False) -> str:
    """Return ``text`` with every control or invisible character as a visible escape.

    ``keep_layout`` keeps newline and tab, for text shown line by line (a
    command's output relayed to a terminal: ``TerminalText``).
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


def bounded(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """Escape ``text`` and cut it to ``limit`` characters of the original, saying how much is left out."""
    if len(text) <= limit:
        return escape(text)
    return f"{escape(text[:limit])}… ({len(text) - limit} more characters)"


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
    """Steps 1-2 of the module docstring, for a normalised ``host``."""
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


def render(*, host: str, port: int, command: str | None, task: str | None, allowed: Sequence[str]) -> ApprovalMessage:
    """Render the message for a held request to ``host:port`` (host normalised, ASCII)."""
    shown_host = escape(host)
    domain = f"{shown_host}:{port}"
    unicode_host = _unicode_form(host)
    site = registered_domain(host)
    notes = []
    if unicode_host is not None:
        notes.append(f"shown as {escape(unicode_host)}")
    if site is not None and (site != host or unicode_host is not None):
        notes.append(f"registered domain {escape(site)}")
    domain_line = f"Domain: {domain}" + (f" ({'; '.join(notes)})" if notes else "")

    command_text = bounded(command) if command else "(not known)"
    task_text = bounded(task) if task else "(none given)"
    shown_allowed = tuple(bounded(entry, 253) for entry in allowed[:MAX_ALLOWED_SHOWN])
    allowed_text = ", ".join(shown_allowed) if shown_allowed else "(none)"
    if len(allowed) > MAX_ALLOWED_SHOWN:
        allowed_text += f", and {len(allowed) - MAX_ALLOWED_SHOWN} more"
    unrelated = is_unrelated(host, command=command, task=task, allowed=allowed)

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


def settled_text(settlement: Settlement) -> str:
    """One line saying how an approval ended, for people (escaped by the broker already)."""
    if settlement.channel is not None:
        verb = "allowed" if settlement.reason is None else "denied"
        return f"{verb} by {settlement.by or 'someone'} via {settlement.channel}"
    return {
        "approval_timeout": "expired (denied)",
        "no_approver": "denied: nobody could be asked, or egressd stopped",
    }.get(settlement.reason or "", settlement.reason or "settled")
