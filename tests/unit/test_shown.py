"""egressd.names.shown: one module for showing untrusted text, one function per set of rules.

Each function is pinned by the examples where the rules differ; the two that
replaced copies elsewhere (``ascii_escaped``: the audit reader's and the HTTP
refusal's; ``printable``: the agent CLI's) are compared with those copies.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from egressd.names.shown import (
    TerminalText,
    ascii_escaped,
    escape,
    escape_mrkdwn,
    logged,
    printable,
    quoted,
    shown_name,
)

# One text, each rule: where they differ is the point of having several.
SAMPLE = "é\\\x1b[31m\u200b\n\t<a>&\U0001f600 "

DIFFERENCES = [
    (escape, "é\\\\x1b[31m\\u200b\\x0a\\x09<a>&\U0001f600 "),
    (lambda text: escape(text, keep_layout=True), "é\\\\x1b[31m\\u200b\n\t<a>&\U0001f600 "),
    (lambda text: escape_mrkdwn(escape(text)), "é\\\\x1b[31m\\u200b\\x0a\\x09&lt;a&gt;&amp;\U0001f600 "),
    (printable, "é\\\\x1b[31m\\u200b\\n\\t<a>&\U0001f600 "),
    (lambda text: printable(text, keep_layout=True), "é\\\\x1b[31m\\u200b\n\t<a>&\U0001f600 "),
    (ascii_escaped, "\\xe9\\\\\\x1b[31m\\u200b\\x0a\\x09<a>&\\U0001f600 "),
    (quoted, repr(SAMPLE)),
]


@pytest.mark.parametrize(("show", "expected"), DIFFERENCES, ids=[str(i) for i in range(len(DIFFERENCES))])
def test_each_rule_shows_one_text_its_own_way(show: object, expected: str) -> None:
    assert callable(show)
    assert show(SAMPLE) == expected


def test_escape_keeps_a_backslash_and_ascii_escaped_doubles_it() -> None:
    # escape: for people reading a message; ascii_escaped: for text read back as escapes.
    assert escape("a\\x1b") == "a\\x1b"
    assert ascii_escaped("a\\x1b") == "a\\\\x1b"


def test_quoted_is_bounded() -> None:
    assert quoted("x" * 100) == repr("x" * 80 + "...")
    assert quoted("x" * 10, limit=5) == repr("xxxxx...")


def test_shown_name_escapes_bytes_as_master_files_do() -> None:
    assert shown_name((b"a b", b"x/y", b"\x1b", b"ok")) == "a\\032b.x\\047y.\\027.ok"
    assert shown_name(()) == "."


def test_terminal_text_is_escape_with_layout_read_by_read() -> None:
    reader = TerminalText()
    assert reader.feed(b"a\r") == "a"
    assert reader.feed(b"\nb\x1b\xe2") == "\nb\\x1b"
    assert reader.feed(b"\x80\x8b") == "\\u200b"
    assert reader.end() == ""


def _audit_safe_before(text: str) -> str:
    """egressd.audit.display._safe before egressd.names.shown.ascii_escaped."""
    out: list[str] = []
    for char in text:
        code = ord(char)
        if char == "\\":
            out.append("\\\\")
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {0x5C: "\\\\"}


def _refusal_printable_before(text: str) -> str:
    """egressd.proxy.core.responses._printable before egressd.names.shown.ascii_escaped."""
    return text.translate(_ESCAPES).encode("ascii", "backslashreplace").decode("ascii")


@given(st.text())
@example("\ud800\udfff\x7f\x80\xff\u0100\uffff\U00010000\\")
def test_ascii_escaped_is_both_copies_it_replaced(text: str) -> None:
    shown = ascii_escaped(text)
    assert shown == _audit_safe_before(text) == _refusal_printable_before(text)
    assert shown.isascii() and shown.isprintable()


@given(st.text(), st.booleans())
@example("\n\t\r\x00\u2028 é", True)
def test_printable_is_the_agent_clis_rule(text: str, keep_layout: bool) -> None:
    layout = "\n\t" if keep_layout else ""
    assert printable(text, keep_layout=keep_layout) == "".join(
        c if c.isprintable() or c in layout else ascii(c)[1:-1] for c in text
    )


def test_logged_keeps_printable_text_and_quotes_the_rest() -> None:
    assert logged("example.com:443") == "example.com:443"
    assert logged("bücher.example:443") == "bücher.example:443"
    assert logged("evil\x1b[2J.example:443") == "'evil\\x1b[2J.example:443'"
    assert logged("x" * 10, 5) == "'xxxxx'"
    assert logged("x" * 5, 5) == "xxxxx"


@given(st.text(), st.one_of(st.none(), st.integers(0, 20)))
def test_logged_is_the_rule_the_gate_the_run_command_and_the_agent_had(text: str, limit: int | None) -> None:
    if limit is None:
        before = text if text.isprintable() else ascii(text)
    else:
        before = text if text.isprintable() and len(text) <= limit else ascii(text[:limit])
    assert logged(text, limit) == before
