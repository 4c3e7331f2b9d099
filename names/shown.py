"""Untrusted text made safe to show: one module, one named function per set of rules.

The rules differ with where the text goes, so each place has its own
function, and no two functions here share rules:

- ``escape`` (and ``TerminalText``, read by read, for a command's output):
  for a person at a terminal or in a chat: every character that does not
  render as a visible mark of its own becomes ``\\xNN``, ``\\uNNNN`` or
  ``\\UNNNNNNNN``; other Unicode (letters of any script) is kept; a
  backslash is kept as it is. The approval message, the ``approvals`` CLI.
- ``escape_mrkdwn``: Slack's three control characters as entities, on top of
  ``escape`` (Slack's "Escaping text").
- ``printable``: one line of the ``agent`` CLI's output: what ``str.isprintable``
  calls printable is kept, anything else is shown as ``ascii()`` shows it
  (``\\n``, ``\\x1b``, ``\\u200b``).
- ``ascii_escaped``: an HTTP refusal's body and the audit reader: printable
  ASCII only, a backslash doubled so that no escape can be forged, every other
  character escaped as Python does.
- ``shown_name``: DNS labels (bytes) as master-file text, ``\\DDD`` for any
  byte but a letter, digit, ``-``, ``_`` or ``*``.
- ``quoted``: untrusted text in an error message: ``repr``, bounded.
- ``logged``: untrusted text in a log line or a one-line notice: as it is
  when printable, else ``ascii()`` of it (quoted, so the reader sees it was
  escaped); optionally bounded.

Pure: no I/O.
"""

from __future__ import annotations

import codecs
import functools
import re
import unicodedata
from collections.abc import Sequence
from typing import Final

__all__ = [
    "TerminalText",
    "ascii_escaped",
    "escape",
    "escape_mrkdwn",
    "is_invisible",
    "logged",
    "printable",
    "quoted",
    "shown_name",
    "toml_string",
]


def quoted(text: str, limit: int = 80) -> str:
    """Untrusted text for an error message: Python's quoted, escaped form, cut after ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def logged(text: str, limit: int | None = None) -> str:
    """``text`` as it is if ``str.isprintable`` (and no longer than ``limit``); else ``ascii()`` of its start.

    A hostile host or URL must not repaint the terminal a log or a notice is
    read on; a plain one reads as itself.
    """
    if text.isprintable() and (limit is None or len(text) <= limit):
        return text
    return ascii(text[:limit])


# -- escape: a terminal or a chat, Unicode kept ---------------------------------------------------

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


# -- escape_mrkdwn: Slack ------------------------------------------------------------------------


def escape_mrkdwn(text: str) -> str:
    """Slack's three control characters as entities (Slack's "Escaping text" rules)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- printable: one line of the agent CLI's output ------------------------------------------------


def printable(text: str, *, keep_layout: bool = False) -> str:
    """``text`` with what ``str.isprintable`` refuses shown as ``ascii()`` shows it.

    ``keep_layout`` keeps newline and tab (a final answer shown as written).
    """
    layout = "\n\t" if keep_layout else ""
    return "".join(c if c.isprintable() or c in layout else ascii(c)[1:-1] for c in text)


# -- ascii_escaped: printable ASCII only -----------------------------------------------------------

# C0 controls, DEL and the backslash itself become \xNN / \\, so the escaped
# text is unambiguous; non-ASCII is escaped by the "backslashreplace" codec.
_ASCII_ESCAPES: Final = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {0x5C: "\\\\"}


def ascii_escaped(text: str) -> str:
    """``text`` as printable ASCII: a backslash doubled, every other character escaped.

    ``\\xNN`` up to U+00FF, ``\\uNNNN`` up to U+FFFF, ``\\UNNNNNNNN`` above:
    it prints as itself and nothing else, and no non-ASCII letter can pose
    as another.
    """
    return text.translate(_ASCII_ESCAPES).encode("ascii", "backslashreplace").decode("ascii")


# -- shown_name: DNS labels ------------------------------------------------------------------------

# Bytes shown as themselves in a name's audit text; everything else is \\DDD,
# so no name can look like a path, a query string or a terminal escape.
_SHOWN: frozenset[int] = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_*")


def shown_name(labels: Sequence[bytes]) -> str:
    """Labels as master-file text (RFC 1035 §5.1), any byte but a letter,
    digit, ``-``, ``_`` or ``*`` escaped as ``\\DDD``; ``.`` for the root."""
    if not labels:
        return "."
    return ".".join("".join(chr(b) if b in _SHOWN else f"\\{b:03d}" for b in label) for label in labels)


# -- TOML: a value in a file egressd writes (an allowlist file, a suggestion) -----------------


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quotes, backslashes and control characters escaped."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char < " " or char == "\x7f":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)
