"""The new-domain approval message: one template, rendered once, shown by every channel.

Pure: no I/O, no clock; the bundled Public Suffix List is read once, lazily.

Everything the agent controls (the domain's display form, the command, the
task, the allowed entries) is made inert here: control and format characters
become visible escapes (``\\x1b``, ``\\u202e``), so no text can repaint a
terminal, hide a character or reverse a line; and each field is bounded so
the message stays readable. Channels add their own escaping on top (Slack's
``&<>``).

The "unrelated" line: the domain is unrelated when

1. neither the task nor the command names it, or a name on the same
   registered domain (``api.github.com`` is named by "github.com" or by
   "docs.github.com"; never by "evilgithub.com"); and
2. it is not an allowed host, under an allowed host, or on the registered
   domain of one (the allowlist's ``*.example.com`` relates
   ``example.com`` and ``a.b.example.com``).

Registered domains come from the Public Suffix List with its private
section, so ``alice.github.io`` and ``bob.github.io`` are unrelated.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import idna
from publicsuffixlist import PublicSuffixList

from .interface import Settlement

__all__ = [
    "ApprovalMessage",
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


def escape(text: str) -> str:
    """Return ``text`` with every control or invisible character as a visible escape."""
    out: list[str] = []
    for ch in text:
        if unicodedata.category(ch) in _ESCAPED_CATEGORIES:
            code = ord(ch)
            if code <= 0xFF:
                out.append(f"\\x{code:02x}")
            elif code <= 0xFFFF:
                out.append(f"\\u{code:04x}")
            else:
                out.append(f"\\U{code:08x}")
        else:
            out.append(ch)
    return "".join(out)


def bounded(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """Escape ``text`` and cut it to ``limit`` characters of the original, saying how much is left out."""
    if len(text) <= limit:
        return escape(text)
    return f"{escape(text[:limit])}… ({len(text) - limit} more characters)"


@functools.cache
def _psl() -> PublicSuffixList:
    return PublicSuffixList()


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
        suffix: str | None = _psl().privatesuffix(name)
    except (ValueError, UnicodeError):
        return None
    return suffix


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
        if host == other or host.endswith("." + other) or _site(other) == site:
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
